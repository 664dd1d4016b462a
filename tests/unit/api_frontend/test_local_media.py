"""file:// image reads (api_frontend/local_media.py) against a real directory: a file inside
is read with its media type; ``..``, a symlink out and an absolute path elsewhere are
refused as outside; a FIFO is refused without blocking the read; a missing file, a
directory and a file past the byte limit each say why; nothing is read with the flag off."""

from __future__ import annotations

import os

import pytest

from api_frontend.local_media import is_local, read, refusal
from api_frontend.media_errors import FetchError


@pytest.fixture
def root(tmp_path):
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / "a.png").write_bytes(b"png bytes")
    (inside / "b.bin").write_bytes(b"x" * 10)
    (tmp_path / "secret.png").write_bytes(b"secret")
    (inside / "out.png").symlink_to(tmp_path / "secret.png")
    (inside / "in.png").symlink_to(inside / "a.png")
    os.mkfifo(inside / "pipe.png")
    return str(inside)


def test_a_file_inside_is_read_with_its_media_type(root):
    assert read(f"file://{root}/a.png", root, 100) == ("image/png", b"png bytes")
    assert read(f"file://{root}/in.png", root, 100) == ("image/png", b"png bytes")  # a link inside
    assert read(f"file://{root}/b.bin", root, 100) == ("", b"x" * 10)


@pytest.mark.parametrize("name, code, says", [
    ("../secret.png", "unsupported_image_url", "is not inside"),
    ("out.png", "unsupported_image_url", "is not inside"),
    ("pipe.png", "image_fetch_failed", "not a regular file"),
    ("missing.png", "image_fetch_failed", "no such file"),
    (".", "image_fetch_failed", "not a regular file"),
    ("b.bin", "image_too_large", "10 bytes, more than this deployment's limit of 5 bytes"),
])
def test_what_may_not_be_read_says_why(root, name, code, says):
    with pytest.raises(FetchError) as err:
        read(f"file://{root}/{name}", root, 5)
    assert err.value.code == code and says in str(err.value)
    assert "secret" not in str(err.value).replace(name, "")  # never the resolved target


def test_an_absolute_path_elsewhere_is_outside(root):
    with pytest.raises(FetchError) as err:
        read("file:///etc/hostname", root, 100)
    assert err.value.code == "unsupported_image_url"


def test_refusals_before_any_read(root):
    assert is_local("FILE:///x") and not is_local("https://x")
    assert "reads no local files" in refusal(f"file://{root}/a.png", "")
    assert "names host 'example.com'" in refusal(f"file://example.com{root}/a.png", root)
    assert "NUL" in refusal(f"file://{root}/a%00.png", root)
    assert refusal(f"file://localhost{root}/a.png", root) is None
    assert refusal(f"file://{root}/a.png", root) is None


def test_a_file_swapped_out_after_the_check_is_refused_by_its_descriptor(root, monkeypatch):
    """The path checked inside, but what the open reaches lies outside (a symlink swapped in
    between, simulated by the open itself): the descriptor's real path refuses it."""
    secret = os.path.join(os.path.dirname(root), "secret.png")
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, flags, *a: real_open(secret, flags, *a))
    with pytest.raises(FetchError) as err:
        read(f"file://{root}/a.png", root, 100)
    assert err.value.code == "unsupported_image_url" and "is not inside" in str(err.value)
