"""Facts about a checkpoint directory that every role agrees on, read from config.json
with the standard library only (lean roles must not import torch or transformers)."""

from __future__ import annotations

import json
import os


def read_model_config(model_path: str) -> dict:
    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    # multimodal wrappers keep the language model's fields under text_config
    return config.get("text_config", config) if "max_position_embeddings" not in config else config


def takes_images(model_path: str) -> bool:
    """Whether requests to this checkpoint may carry images: a vision config beside the
    text model's and an HF processor config (LLaVA, Gemma 3), or a preprocessor config
    that names the processor (the hub's Qwen2-VL). Which ones the gpu_worker can serve is
    its model registry's to say, before any process starts."""
    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    return "vision_config" in config and has_processor(model_path)


def has_processor(model_path: str) -> bool:
    """An HF processor config beside the checkpoint: ``processor_config.json``, or a
    ``preprocessor_config.json`` that names its ``processor_class``."""
    if os.path.isfile(os.path.join(model_path, "processor_config.json")):
        return True
    path = os.path.join(model_path, "preprocessor_config.json")
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as fh:
        return json.load(fh).get("processor_class") is not None


def max_seq_length(model_path: str) -> int | None:
    """sentence-transformers' input bound (``sentence_bert_config.json``), if it sets one."""
    path = os.path.join(model_path, "sentence_bert_config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        value = json.load(fh).get("max_seq_length")
    return int(value) if value else None


def effective_max_model_len(model_path: str, requested: int | None) -> int:
    """The context the deployment serves: the checkpoint's limit (an embedding
    checkpoint's sentence-transformers ``max_seq_length`` bounds it too: longer inputs
    were never trained), or less if asked."""
    config = read_model_config(model_path)
    limit = int(config.get("max_position_embeddings", 2048))
    what = "max_position_embeddings"
    if config.get("model_type") in ("roberta", "xlm-roberta"):  # positions start at pad + 1
        limit -= int(config.get("pad_token_id", 1)) + 1
        what = "max_position_embeddings less its padding offset"
    st_limit = max_seq_length(model_path)
    if st_limit is not None and st_limit < limit:
        limit, what = st_limit, "sentence-transformers max_seq_length"
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the checkpoint's {what} {limit}")
    return requested


DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")
_CANONICAL = {"half": "float16", "float16": "float16", "fp16": "float16", "bfloat16": "bfloat16",
              "bf16": "bfloat16", "float": "float32", "float32": "float32", "fp32": "float32"}


def resolve_dtype(requested: str, device: str, model_path: str) -> tuple[str, str]:
    """(the compute dtype, why): ``auto`` follows the checkpoint's ``torch_dtype`` on an
    accelerator and computes in fp32 on CPU (faster there than bf16/fp16 emulation)."""
    if requested != "auto":
        if requested not in _CANONICAL:
            raise ValueError(f"unknown dtype {requested!r} (choices: {', '.join(DTYPE_CHOICES)})")
        return _CANONICAL[requested], f"--dtype {requested}"
    cfg = read_model_config(model_path)
    saved = _CANONICAL.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"), "float32")
    if not device.startswith("cuda"):
        if saved == "float32":
            return "float32", "auto: the checkpoint's float32"
        return "float32", f"auto on {device}: float32 (the checkpoint is {saved})"
    return saved, f"auto: the checkpoint's {saved}"
