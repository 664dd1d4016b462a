"""file:// image URLs, read behind the operator's ``--allowed-local-media-path``
(``limits.allowed_local_media_path``; empty, the default: no file is read) and handed on,
as a fetched http(s) image is, as the ``data:`` URL of the bytes (``media_fetch`` says why
the frontend does it).

A file is read only when its real path (every symlink and ``..`` resolved) lies inside the
directory's real path, and the file opened is checked again by its descriptor, so a
symlink swapped in after the check does not lead out. It must be a regular file (a FIFO or
device is never opened for reading: the open does not block) of at most
``max_image_bytes``. The reads are blocking file I/O, so callers run ``read`` in a thread,
off the event loop. Refusals never name the resolved target or the directory itself: the
client sees only the path it sent.
"""

from __future__ import annotations

import mimetypes
import os
import stat

from yarl import URL

from api_frontend.media_errors import FetchError, shown


def is_local(url: str) -> bool:
    return url[:7].lower() == "file://"


def refusal(url: str, root: str) -> str | None:
    """Why ``url`` may not be read at all (before any file is looked at); None: it may be
    tried. ``root``: the allowed directory, "" when none is."""
    if not root:
        return ("this deployment reads no local files; start it with "
                "--allowed-local-media-path naming their directory, or send the image inline "
                "as a data: URL (data:image/png;base64,...)")
    try:
        parsed = URL(url)
    except (ValueError, TypeError):
        return "it is not a valid URL"
    host = parsed.host or ""
    if host not in ("", "localhost"):
        return f"it names host {host!r}; a file:// URL reads this machine's files only"
    if not parsed.path.startswith("/"):
        return "its path is not absolute"
    if "\0" in parsed.path:
        return "its path holds a NUL character"
    return None


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _read_up_to(fd: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def read(url: str, root: str, max_bytes: int) -> tuple[str, bytes]:
    """(media type, bytes) of the file ``url`` names under the real directory ``root``; a
    FetchError says why not. Blocking: run it in a thread."""
    path = URL(url).path
    outside = FetchError(f"the file {shown(path)} is not inside this deployment's "
                         "--allowed-local-media-path", "unsupported_image_url")
    real = os.path.realpath(path)
    if not _inside(real, root):
        raise outside
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise FetchError(f"the file {shown(path)} could not be read: no such file",
                         "image_fetch_failed") from None
    except OSError as exc:
        raise FetchError(f"the file {shown(path)} could not be read: {exc.strerror or exc}",
                         "image_fetch_failed") from None
    try:
        opened = f"/proc/self/fd/{fd}"
        if os.path.exists(opened) and not _inside(os.path.realpath(opened), root):
            raise outside  # (a symlink swapped in between the check and the open)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FetchError(f"the file {shown(path)} could not be read: it is not a regular "
                             "file", "image_fetch_failed")
        limit = f"this deployment's limit of {max_bytes} bytes (--max-image-bytes)"
        if info.st_size > max_bytes:
            raise FetchError(f"the file {shown(path)} is {info.st_size} bytes, more than "
                             f"{limit}", "image_too_large")
        data = _read_up_to(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise FetchError(f"the file {shown(path)} is larger than {limit}", "image_too_large")
    media = mimetypes.guess_type(path)[0] or ""
    return (media if media.startswith("image/") else ""), data
