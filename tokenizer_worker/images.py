"""An ``image_url`` content part -> a decoded RGB image, inside the deployment's limits.

Images are decoded here, in the tokenizer worker, and nowhere else (DESIGN's process split):
the frontend only checks the URL's shape, and fetches an http(s) one on an allowed host
into the data: URL that arrives here (``api_frontend.media_fetch`` says why there). Every failure is an ``ImageError`` whose message
says what was wrong, so the caller can answer a 400 naming the message and part; Pillow's own
exceptions (truncated file, unknown format, decompression bomb) never escape.
"""

from __future__ import annotations

import base64
import binascii
import io
import re

import msgspec
from PIL import Image

_DATA_URL = re.compile(r"data:(?P<mime>image/[A-Za-z0-9.+-]+)?(?P<params>(;[^;,]*)*?);base64,",
                       re.IGNORECASE)
DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_PIXELS = 4096 * 4096


class ImageLimits(msgspec.Struct, frozen=True):
    """The most one image may be: ``max_bytes`` of encoded file, ``max_pixels`` once decoded
    (width x height, checked from the header before the pixels are decoded)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS


class ImageError(ValueError):
    """An image the request must be refused for; the message is the client's, ``param``
    the part it names (``messages[i].content[j]``) once known, ``code`` the error code."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_image") -> None:
        super().__init__(message)
        self.param, self.code = param, code


def image_bytes(url: str, limits: ImageLimits) -> bytes:
    """The encoded file inside a ``data:image/...;base64,`` URL. A remote URL arrives
    fetched (the frontend's work); one that did not is refused, never fetched here."""
    if url.startswith(("http://", "https://")):
        raise ImageError("a remote image URL reached the tokenizer worker unfetched; the "
                         "frontend fetches those on hosts this deployment allows "
                         "(--allowed-media-domains), or send the image inline as a data: URL "
                         "(data:image/png;base64,...)")
    match = _DATA_URL.match(url)
    if match is None:
        raise ImageError("an image URL must be a base64 data: URL "
                         "(data:image/png;base64,...)")
    payload = url[match.end():]
    # base64 is 4 characters per 3 bytes: refuse before decoding what is too big anyway
    if len(payload) * 3 // 4 > limits.max_bytes + 2:
        raise ImageError(f"the image is larger than this deployment's limit of "
                         f"{limits.max_bytes} bytes (--max-image-bytes)", code="image_too_large")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image's data: URL is not valid base64") from None
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image is {len(data)} bytes, more than this deployment's limit "
                         f"of {limits.max_bytes} (--max-image-bytes)", code="image_too_large")
    return data


def decode_image(data: bytes, limits: ImageLimits) -> Image.Image:
    """The image as RGB (what the HF image processors convert to), its size checked from the
    header first so a small file that decodes to a huge image is refused unread."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > limits.max_pixels:
                raise ImageError(f"the image is {width}x{height} pixels, more than this "
                                 f"deployment's limit of {limits.max_pixels} (--max-image-pixels)",
                                 code="image_too_large")
            img.load()
            return img.convert("RGB")
    except ImageError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageError(f"the image cannot be decoded ({type(exc).__name__})") from None


def load_image(url: str, limits: ImageLimits) -> Image.Image:
    return decode_image(image_bytes(url, limits), limits)
