"""Images of a chat prompt -> ``ipc.ImageInput``s and the prompt with each image's
placeholder expanded, exactly as the checkpoint's HF processor does it (LLaVA-1.5 style:
one ``<image>`` in the rendered text becomes one token per vision-tower patch).

The pixel values come from transformers' own image processor class for the checkpoint
(the reference, loaded from its ``processor_config.json``), so they equal HF's bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from protocol import ipc
from tokenizer_worker.images import ImageError, ImageLimits, load_image


class VisionPrompt:
    """One checkpoint's image preprocessing: its image processor, its image token, and how
    many tokens one image becomes."""

    def __init__(self, model_dir: str | Path, image_token_id: int) -> None:
        from transformers import AutoImageProcessor

        config = json.loads((Path(model_dir) / "processor_config.json").read_text())
        if config.get("processor_class") != "LlavaProcessor":
            raise ValueError(f"image input is served for LlavaProcessor checkpoints only, "
                             f"not {config.get('processor_class')!r}")
        self.image_token = config.get("image_token", "<image>")
        self.image_token_id = image_token_id
        self.patch_size = int(config["patch_size"])
        self.additional = int(config.get("num_additional_image_tokens", 0))
        self.drops_cls = config.get("vision_feature_select_strategy") == "default"
        self.processor = AutoImageProcessor.from_pretrained(model_dir)

    @staticmethod
    def has_images(model_dir: str | Path) -> bool:
        return (Path(model_dir) / "processor_config.json").is_file()

    @classmethod
    def for_checkpoint(cls, model_dir: str | Path) -> "VisionPrompt | None":
        """The checkpoint's image preprocessing, or None for a model that takes no images
        (no ``processor_config.json`` or no image token in its config)."""
        if not cls.has_images(model_dir):
            return None
        config = json.loads((Path(model_dir) / "config.json").read_text())
        token = config.get("image_token_index", config.get("image_token_id"))
        return None if token is None else cls(model_dir, int(token))

    def tokens_per_image(self, height: int, width: int) -> int:
        """LlavaProcessor's count: one per patch, plus the tower's extra (CLS) tokens, less
        the one the ``default`` feature strategy drops."""
        n = (height // self.patch_size) * (width // self.patch_size) + self.additional
        return n - 1 if self.drops_cls else n

    def pixel_values(self, images: list[Image.Image]) -> np.ndarray:
        out = self.processor(images=images, return_tensors="np")["pixel_values"]
        return np.ascontiguousarray(out, dtype=np.float32)

    def expand(self, ids: list[int], images: list[Image.Image]) -> tuple[list[int],
                                                                         list[ipc.ImageInput]]:
        """``ids`` with the k-th image token repeated for the k-th image, and the images'
        inputs (pixels, span, content hash). The rendered prompt must hold exactly one
        image token per image: a template that drops image parts, or text that spells the
        token itself, is refused rather than guessed at."""
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != len(images):
            raise ImageError(f"the rendered prompt holds {len(at)} image token(s) "
                             f"({self.image_token!r}) for {len(images)} image(s); the text may "
                             f"not contain {self.image_token!r} itself, and the chat template "
                             "must render image parts", param="messages")
        if not images:
            return ids, []
        pixels = self.pixel_values(images)
        out: list[int] = []
        inputs: list[ipc.ImageInput] = []
        prev = 0
        for k, pos in enumerate(at):
            one = pixels[k]
            n = self.tokens_per_image(one.shape[-2], one.shape[-1])
            out += ids[prev:pos]
            data = one.tobytes()
            inputs.append(ipc.ImageInput(pixels=data, shape=list(one.shape), dtype=str(one.dtype),
                                         offset=len(out), length=n,
                                         content_hash=hashlib.sha256(data).digest()))
            out += [self.image_token_id] * n
            prev = pos + 1
        out += ids[prev:]
        return out, inputs


def image_parts(messages: list[dict[str, Any]], limits: ImageLimits
                ) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """The messages with each ``image_url`` part as the ``{"type": "image"}`` part HF chat
    templates render, and the decoded images in prompt order. A bad image is an
    ImageError whose message names ``messages[i].content[j]``."""
    images: list[Image.Image] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if part.get("type") != "image_url":
                parts.append(part)
                continue
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else None
            where = f"messages[{i}].content[{j}]"
            if not isinstance(url, str):
                raise ImageError(f"{where}.image_url needs a string `url`", where)
            try:
                images.append(load_image(url, limits))
            except ImageError as err:
                raise ImageError(f"{where}: {err}", where, err.code) from None
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images
