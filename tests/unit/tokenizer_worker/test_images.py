"""Image URLs -> RGB images: PNG and JPEG data: URLs decode to the pixels that were sent;
remote, malformed, oversized, bomb-sized and undecodable images are ImageErrors with a
message for the client, never Pillow's own exceptions."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from tokenizer_worker.images import ImageError, ImageLimits, image_bytes, load_image


def _data_url(img: Image.Image, fmt: str = "PNG", mime: str = "image/png") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def _pattern(width: int = 7, height: int = 5) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def test_png_round_trips_pixel_for_pixel():
    img = _pattern()
    out = load_image(_data_url(img), ImageLimits())
    assert out.mode == "RGB" and out.size == (7, 5)
    assert np.array_equal(np.asarray(out), np.asarray(img))


def test_jpeg_and_rgba_become_rgb():
    jpeg = load_image(_data_url(_pattern(), "JPEG", "image/jpeg"), ImageLimits())
    assert jpeg.mode == "RGB" and jpeg.size == (7, 5)
    rgba = load_image(_data_url(_pattern().convert("RGBA")), ImageLimits())
    assert rgba.mode == "RGB"


@pytest.mark.parametrize("url, says", [
    ("https://example.com/cat.png", "remote image URL reached the tokenizer worker unfetched"),
    ("http://example.com/cat.png", "remote image URL reached the tokenizer worker unfetched"),
    ("file:///etc/passwd", "must be a base64 data: URL"),
    ("data:image/png,rawbytes", "must be a base64 data: URL"),
    ("data:image/png;base64,@@@not base64@@@", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(),
     "cannot be decoded"),
])
def test_refusals_say_why(url, says):
    with pytest.raises(ImageError, match=says):
        load_image(url, ImageLimits())


def test_truncated_png_is_refused():
    url = _data_url(_pattern(64, 64))
    head, payload = url.split(",", 1)
    short = base64.b64encode(base64.b64decode(payload)[:200]).decode()
    with pytest.raises(ImageError, match="cannot be decoded"):
        load_image(f"{head},{short}", ImageLimits())


def test_byte_limit_refuses_before_and_after_base64():
    url = _data_url(_pattern(32, 32))
    size = len(image_bytes(url, ImageLimits()))
    assert image_bytes(url, ImageLimits(max_bytes=size)) is not None
    with pytest.raises(ImageError, match=f"limit of {size - 1} bytes|limit of {size - 1}"):
        image_bytes(url, ImageLimits(max_bytes=size - 1))
    with pytest.raises(ImageError, match="larger than this deployment's limit of 10 bytes"):
        image_bytes(url, ImageLimits(max_bytes=10))


def test_pixel_limit_reads_the_header_only():
    """A 4000x4000 black PNG is a few KB; it is refused from its header's size."""
    url = _data_url(Image.new("RGB", (4000, 4000)))
    assert len(url) < 200_000
    with pytest.raises(ImageError, match="4000x4000 pixels, more than this deployment's "
                                         "limit of 1000000"):
        load_image(url, ImageLimits(max_pixels=1_000_000))
