"""How a prepared directory points at its GGUF file.

Every role reads a model directory (config.json, tokenizer files); a GGUF file gets one
(``launcher.gguf_checkpoint``), whose config.json names the file under ``POINTER`` with
the size and mtime it had when prepared. The weights are read from the file itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gpu_worker.gguf.reader import GGUFError

POINTER = "candor_gguf"


def pointer(gguf_path: str | Path) -> dict[str, Any]:
    stat = os.stat(gguf_path)
    return {"file": os.path.abspath(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def gguf_file_of(model_dir: str | Path) -> Path | None:
    """The GGUF file ``model_dir`` was prepared from (None: an HF checkpoint directory);
    a file changed or gone since is a GGUFError."""
    config = Path(model_dir) / "config.json"
    try:
        entry = json.loads(config.read_text()).get(POINTER)
    except (OSError, ValueError):
        return None
    if entry is None:
        return None
    path = Path(entry["file"])
    try:
        now = pointer(path)
    except OSError as err:
        raise GGUFError(f"{path}: cannot be read ({err.strerror}); {model_dir} was prepared from it") from None
    if (now["size"], now["mtime_ns"]) != (entry["size"], entry["mtime_ns"]):
        raise GGUFError(f"{path} changed since {model_dir} was prepared from it; start again to prepare it anew")
    return path
