"""What the frontend's image reads (``media_fetch``: http(s); ``local_media``: file://)
share: the error that refuses one, with its code, and a URL or path as an error message
shows it (cut short, so a huge one does not fill the message)."""

from __future__ import annotations

_SHOWN_CHARS = 200


class FetchError(Exception):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def shown(url: str) -> str:
    return url if len(url) <= _SHOWN_CHARS else url[:_SHOWN_CHARS] + "..."
