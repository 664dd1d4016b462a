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


def effective_max_model_len(model_path: str, requested: int | None) -> int:
    """The context the deployment serves: the checkpoint's limit, or less if asked."""
    limit = int(read_model_config(model_path).get("max_position_embeddings", 2048))
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the checkpoint's "
                         f"max_position_embeddings {limit}")
    return requested
