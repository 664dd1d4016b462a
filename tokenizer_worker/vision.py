"""Images of a chat prompt -> ``ipc.ImageInput``s and the prompt with each image's
placeholder expanded, exactly as the checkpoint's HF processor does it: LLaVA-1.5 style
(``VisionPrompt``: one ``<image>`` in the rendered text becomes one token per
vision-tower patch, in the ids) or Gemma 3's (``Gemma3VisionPrompt``: each
``<start_of_image>`` in the rendered text becomes ``\n\n<start_of_image>``, the image
token ``mm_tokens_per_image`` times, ``<end_of_image>\n\n``, in the text before it is
tokenized, as Gemma3Processor does, so the newlines merge with their neighbours as HF's do;
with pan-and-scan on, an image's crops follow it, in Gemma3Processor's words).

The pixel values come from transformers' own image processor class for the checkpoint
(the reference, loaded from its ``processor_config.json``), so they equal HF's bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import math
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
        problem = processor_problem(model_dir)
        if problem is not None:
            raise ValueError(problem)
        self.image_token = config.get("image_token", "<image>")
        self.image_token_id = image_token_id
        self.patch_size = int(config["patch_size"])
        self.additional = int(config.get("num_additional_image_tokens", 0))
        self.drops_cls = config.get("vision_feature_select_strategy") == "default"
        self.processor = AutoImageProcessor.from_pretrained(model_dir)

    @staticmethod
    def has_images(model_dir: str | Path) -> bool:
        return processor_class(model_dir) is not None

    @classmethod
    def for_checkpoint(cls, model_dir: str | Path) -> "VisionPrompt | None":
        """The checkpoint's image preprocessing, or None for a model that takes no images
        (no processor named beside it, or no image token in its config)."""
        kind = processor_class(model_dir)
        if kind is None:
            return None
        config = json.loads((Path(model_dir) / "config.json").read_text())
        token = config.get("image_token_index", config.get("image_token_id"))
        if token is None:
            return None
        prompt = {"Gemma3Processor": Gemma3VisionPrompt, "Qwen2VLProcessor": QwenVisionPrompt,
                  "Qwen2_5_VLProcessor": QwenVisionPrompt}.get(kind, VisionPrompt)
        return prompt(model_dir, int(token))

    def expand_text(self, text: str, images: list[Image.Image]) -> str:
        """The rendered prompt as the processor tokenizes it (LLaVA's: unchanged)."""
        return text

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


PROCESSORS = {"LlavaProcessor", "Gemma3Processor", "Qwen2VLProcessor", "Qwen2_5_VLProcessor"}


def token_runs(ids: list[int], token_id: int) -> list[list[int]]:
    """Each maximal run of ``token_id`` in ``ids`` as [start, end) (the placeholder spans
    an expanded prompt's images take)."""
    runs: list[list[int]] = []
    for i, t in enumerate(ids):
        if t == token_id:
            if runs and runs[-1][1] == i:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
    return runs


def processor_class(model_dir: str | Path) -> str | None:
    """The HF processor the checkpoint names: ``processor_config.json``'s
    ``processor_class`` ("" where it names none), or else ``preprocessor_config.json``'s
    (the hub's Qwen2-VL checkpoints have no processor_config.json); None: no processor
    named beside it (a model that takes no images)."""
    path = Path(model_dir) / "processor_config.json"
    if path.is_file():
        return str(json.loads(path.read_text()).get("processor_class") or "")
    path = Path(model_dir) / "preprocessor_config.json"
    kind = json.loads(path.read_text()).get("processor_class") if path.is_file() else None
    return None if kind is None else str(kind)


def processor_problem(model_dir: str | Path) -> str | None:
    """Why this checkpoint's image preprocessing cannot be served exactly (None: it can),
    in one line: a processor class we do not mirror, or Gemma 3 image tokens its tokenizer
    lacks. Torch-free: the launcher asks first."""
    model_dir = Path(model_dir)
    kind = processor_class(model_dir)
    if kind not in PROCESSORS:
        return (f"image input is served for {', '.join(sorted(PROCESSORS))} checkpoints "
                f"only, not {kind or None!r}")
    if kind in _QWEN_PROCESSORS:
        model = json.loads((model_dir / "config.json").read_text())
        token = model.get("image_token_id")
        if token is None or int(token) not in _added_tokens(model_dir):
            return ("config.json's image_token_id names no added token of tokenizer.json; "
                    "Qwen2-VL's image expansion needs it")
        return None
    if kind != "Gemma3Processor":
        return None
    model = json.loads((model_dir / "config.json").read_text())
    names = _added_tokens(model_dir)
    missing = [k for k in _GEMMA3_TOKENS
               if model.get(k) is None or int(model[k]) not in names]
    if missing:
        return (f"config.json's {', '.join(missing)} name no added token of tokenizer.json; "
                "Gemma 3's image expansion needs them")
    return None


_GEMMA3_TOKENS = ("boi_token_index", "image_token_index", "eoi_token_index")
# Gemma3Processor's values for the pan-and-scan settings an image processor leaves unset
_PAN_AND_SCAN_DEFAULTS = {"pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                          "pan_and_scan_min_ratio_to_activate": 1.2}
_CROPS_TEXT = ("Here is the original image {} and here are some crops to help you see "
               "better ")  # (Gemma3Processor's, then the crops' sequences joined by spaces)


class Gemma3VisionPrompt(VisionPrompt):
    """Gemma3Processor's expansion (see the module docstring): each image is
    ``image_seq_length`` image tokens, and their span is ``whole`` (Gemma 3's image tokens
    attend each other both ways, so the scheduler keeps it in one chunk).

    Pan-and-scan (the image processor's ``do_pan_and_scan``): an image whose aspect ratio
    reaches ``pan_and_scan_min_ratio_to_activate`` is also cut, along its long side, into
    2 to ``pan_and_scan_max_num_crops`` crops of at least ``pan_and_scan_min_crop_size``
    pixels; its marker becomes Gemma3Processor's text for that ("Here is the original
    image <seq> and here are some crops to help you see better <seq> <seq>..."), and the
    original and each crop are one image input each, of ``image_seq_length`` tokens. The
    settings the image processor leaves unset are Gemma3Processor's defaults, as vLLM
    resolves them."""

    def __init__(self, model_dir: str | Path, image_token_id: int) -> None:
        from transformers import AutoImageProcessor

        model_dir = Path(model_dir)
        problem = processor_problem(model_dir)
        if problem is not None:
            raise ValueError(problem)
        config = json.loads((model_dir / "processor_config.json").read_text())
        model = json.loads((model_dir / "config.json").read_text())
        self.tokens = int(config.get("image_seq_length", model.get("mm_tokens_per_image", 256)))
        if self.tokens != int(model.get("mm_tokens_per_image", self.tokens)):
            raise ValueError(f"processor_config.json: image_seq_length {self.tokens} differs "
                             f"from config.json's mm_tokens_per_image {model['mm_tokens_per_image']}")
        names = _added_tokens(model_dir)
        # (as Gemma3Processor: ``image_token`` is the marker the template renders, the boi
        # token; ``image_token_id`` the token it expands to, ``soft_token`` its text)
        self.image_token, self.soft_token, eoi = (names[int(model[k])] for k in _GEMMA3_TOKENS)
        self.image_token_id = image_token_id
        self.sequence = f"\n\n{self.image_token}{self.soft_token * self.tokens}{eoi}\n\n"
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.pan_and_scan: dict[str, Any] | None = None
        if getattr(self.processor, "do_pan_and_scan", None):
            self.pan_and_scan = {"do_pan_and_scan": True, **{
                k: default if getattr(self.processor, k, None) is None else getattr(self.processor, k)
                for k, default in _PAN_AND_SCAN_DEFAULTS.items()}}

    def tokens_per_image(self, height: int, width: int) -> int:
        return self.tokens

    def crops(self, image: Image.Image) -> int:
        """How many pan-and-scan crops ``image`` is cut into (0: none), as
        Gemma3ImageProcessor counts them: along the long side, about its aspect ratio in
        number, within [2, max_num_crops] and at least min_crop_size pixels each."""
        if self.pan_and_scan is None:
            return 0
        min_crop = self.pan_and_scan["pan_and_scan_min_crop_size"]
        long, short = max(image.size), min(image.size)
        if short == 0 or long / short < self.pan_and_scan["pan_and_scan_min_ratio_to_activate"]:
            return 0
        n = min(math.floor(long / short + 0.5), math.floor(long / min_crop))
        n = min(self.pan_and_scan["pan_and_scan_max_num_crops"], max(2, n))
        return 0 if min(math.ceil(long / n), short) < min_crop else n

    def _image_text(self, crops: int) -> str:
        if not crops:
            return self.sequence
        return _CROPS_TEXT.format(self.sequence) + " ".join([self.sequence] * crops)

    def expand_text(self, text: str, images: list[Image.Image]) -> str:
        """Each marker expanded, when there is one per image. More markers than images
        (text that spells one) is refused here; fewer (a template that left an image out)
        comes back unexpanded, for the image-token check (``expand``) to refuse."""
        found = text.count(self.image_token)
        if found > len(images):
            raise ImageError(f"the rendered prompt holds {found} {self.image_token!r} marker(s) "
                             f"for {len(images)} image(s); the text may not contain "
                             f"{self.image_token!r} itself", param="messages")
        if found != len(images):
            return text
        pieces = text.split(self.image_token)
        return pieces[0] + "".join(self._image_text(self.crops(img)) + after
                                   for img, after in zip(images, pieces[1:]))

    def expand(self, ids: list[int], images: list[Image.Image]) -> tuple[list[int],
                                                                         list[ipc.ImageInput]]:
        """The images' inputs over the runs of image tokens the expanded text became: one
        run of exactly ``tokens`` per image and per pan-and-scan crop, or the prompt is
        refused (text that spells the image token itself)."""
        runs = token_runs(ids, self.image_token_id)
        crops = [self.crops(img) for img in images]
        wanted = len(images) + sum(crops)
        if len(runs) != wanted or any(hi - lo != self.tokens for lo, hi in runs):
            also = f", {sum(crops)} pan-and-scan crop(s)" if any(crops) else ""
            raise ImageError(f"the prompt's {self.soft_token!r} tokens do not form one run of "
                             f"{self.tokens} per image ({len(images)} image(s){also}); the text "
                             f"may not contain {self.soft_token!r} itself, and the chat "
                             "template must render image parts", param="messages")
        if not images:
            return ids, []
        pixels = self.pixel_values(images, crops)
        inputs = []
        for k, (lo, _) in enumerate(runs):
            data = pixels[k].tobytes()
            inputs.append(ipc.ImageInput(pixels=data, shape=list(pixels[k].shape),
                                         dtype=str(pixels[k].dtype), offset=lo, length=self.tokens,
                                         content_hash=hashlib.sha256(data).digest(), whole=True))
        return ids, inputs

    def pixel_values(self, images: list[Image.Image], crops: list[int] | None = None) -> np.ndarray:
        """Each image's pixels, then its crops' (``crops``: the counts ``expand`` placed
        tokens for; the image processor's own count must agree)."""
        out = self.processor(images=images, return_tensors="np", **(self.pan_and_scan or {}))
        made = [int(n) for n in out.get("num_crops", [0] * len(images))]
        if crops is not None and made != crops:
            raise RuntimeError(f"the image processor cut {made} pan-and-scan crops where "
                               f"{crops} were counted")
        return np.ascontiguousarray(out["pixel_values"], dtype=np.float32)


_QWEN_PROCESSORS = {"Qwen2VLProcessor", "Qwen2_5_VLProcessor"}


class QwenVisionPrompt(VisionPrompt):
    """Qwen2VLProcessor's expansion (Qwen2.5-VL's is the same): each image token the
    template renders (``<|image_pad|>``, between ``<|vision_start|>`` and
    ``<|vision_end|>``) becomes one per token of that image, rows x columns of its
    patch grid over ``merge_size``^2, in the text before it is tokenized. The image
    processor resizes each image to its own size (multiples of patch x merge pixels,
    between min and max pixels), so images differ in token count; each input carries its
    token grid (``ImageInput.grid``: M-RoPE positions and the tower read it) and its
    patches [patches, channels x temporal x patch x patch], as HF's processor flattens them."""

    def __init__(self, model_dir: str | Path, image_token_id: int) -> None:
        from transformers import AutoImageProcessor

        model_dir = Path(model_dir)
        problem = processor_problem(model_dir)
        if problem is not None:
            raise ValueError(problem)
        self.image_token_id = image_token_id
        names = _added_tokens(model_dir)
        self.image_token = names[image_token_id]
        video = json.loads((model_dir / "config.json").read_text()).get("video_token_id")
        self.video_token_id = None if video is None else int(video)
        self.video_token = names.get(self.video_token_id, "<|video_pad|>")
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.merge = int(self.processor.merge_size)

    def tokens_per_image(self, height: int, width: int) -> int:
        """The image's token count (its size before resizing), as the processor counts it."""
        try:
            return self.processor.get_number_of_image_patches(height, width) // self.merge**2
        except ValueError as err:  # (smart_resize: an aspect ratio past 200)
            raise ImageError(f"the image cannot be resized for this model: {err}") from None

    def expand_text(self, text: str, images: list[Image.Image]) -> str:
        """Each image token repeated for its image, when there is one per image. More
        tokens than images (text that spells one) is refused here; fewer (a template that
        left an image out) comes back unexpanded, for ``expand`` to refuse."""
        pieces = text.split(self.image_token)
        if len(pieces) - 1 > len(images):
            raise ImageError(f"the rendered prompt holds {len(pieces) - 1} {self.image_token!r} "
                             f"token(s) for {len(images)} image(s); the text may not contain "
                             f"{self.image_token!r} itself", param="messages")
        if len(pieces) - 1 != len(images):
            return text
        out = [pieces[0]]
        for img, piece in zip(images, pieces[1:]):
            out += [self.image_token * self.tokens_per_image(img.height, img.width), piece]
        return "".join(out)

    def expand(self, ids: list[int], images: list[Image.Image]) -> tuple[list[int],
                                                                         list[ipc.ImageInput]]:
        """The images' inputs over the runs of image tokens the expanded text became: one
        run per image, of its own token count, or the prompt is refused; so is a video
        token (video input is not served: HF's processor would expand it for a video)."""
        if self.video_token_id is not None and self.video_token_id in ids:
            raise ImageError(f"the prompt holds {self.video_token!r}, the video placeholder; "
                             "video input is not served, and the text may not contain "
                             f"{self.video_token!r} itself", param="messages")
        runs = token_runs(ids, self.image_token_id)
        want = [self.tokens_per_image(img.height, img.width) for img in images]
        if [hi - lo for lo, hi in runs] != want:
            raise ImageError(f"the prompt's {self.image_token!r} tokens do not form one run per "
                             f"image ({len(images)} image(s)); the text may not contain "
                             f"{self.image_token!r} itself, and the chat template must render "
                             "image parts", param="messages")
        if not images:
            return ids, []
        try:
            out = self.processor(images=images, return_tensors="np")
        except ValueError as err:
            raise ImageError(f"the image cannot be preprocessed for this model: {err}") from None
        patches = np.asarray(out["pixel_values"], dtype=np.float32)
        inputs = []
        first = 0
        for (lo, hi), (t, h, w) in zip(runs, out["image_grid_thw"].tolist()):
            grid = [int(t), int(h) // self.merge, int(w) // self.merge]
            one = np.ascontiguousarray(patches[first:first + t * h * w])
            first += t * h * w
            data = one.tobytes()
            # (the grid is part of the key: the same patch values laid out another way are
            # another image)
            digest = hashlib.sha256(data + np.asarray(grid, dtype=np.int64).tobytes()).digest()
            inputs.append(ipc.ImageInput(pixels=data, shape=list(one.shape), dtype=str(one.dtype),
                                         offset=lo, length=hi - lo, content_hash=digest,
                                         grid=grid))
        return ids, inputs


def _added_tokens(model_dir: Path) -> dict[int, str]:
    """id -> content of the tokenizer's added tokens (``tokenizer.json``)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return {}
    return {int(t["id"]): t["content"] for t in json.loads(path.read_text()).get("added_tokens", [])}


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
