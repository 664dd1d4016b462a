"""Where each image of a request translated onto chat sits under chat's names and under the
request's own, so an error about an image (a bad one, one past the count limit: found by
the chat translation or by the tokenizer worker, both under ``messages[i].content[j]``)
names the part the client sent (``input[2].content[1]``, ``messages[0].content[3]``).

The translations keep images in order, so the k-th image part of the chat messages is the
k-th image the request held."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from api_frontend.errors import ApiError


def chat_image_paths(messages: list[dict[str, Any]]) -> list[str]:
    """``messages[i].content[j]`` of every ``image_url`` part, in order."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") == "image_url":
                out.append(f"messages[{i}].content[{j}]")
    return out


_CHAT_URL = ".image_url.url"  # where chat's image_url part holds its URL


@dataclass
class ImageNames:
    paths: dict[str, str] = field(default_factory=dict)  # chat's path -> the request's
    url_field: str = _CHAT_URL  # where the request's own image part holds its URL

    @classmethod
    def of(cls, messages: list[dict[str, Any]], own: list[str],
           url_field: str = _CHAT_URL) -> "ImageNames":
        return cls(dict(zip(chat_image_paths(messages), own)), url_field)

    def rename(self, err: ApiError) -> bool:
        """Name the request's own part in ``err`` when it is about an image (its URL:
        ``url_field`` under the part); False: not."""
        param = err.param or ""
        for chat, own in self.paths.items():
            if param == chat or param.startswith(chat + "."):
                rest = param[len(chat):]
                if rest.startswith(_CHAT_URL):
                    rest = self.url_field + rest[len(_CHAT_URL):]
                err.param = own + rest
                err.message = err.message.replace(chat, own)
                return True
        return False
