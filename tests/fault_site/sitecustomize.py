"""Imported by every Python process started with this directory on PYTHONPATH (see
tests/faults.py). With CANDOR_TEST_FAULT_TOKEN set, the first import of
gpu_worker.model_runner gets a ModelRunner whose steps fail when they feed that token;
every other process and module is left as it is."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_TARGET = "gpu_worker.model_runner"


class _PatchModelRunner(importlib.abc.MetaPathFinder):
    def __init__(self, token: int) -> None:
        self.token = token

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # find the real module with the other finders
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module) -> None:
            exec_module(module)
            from tests.faults import failing_forward
            module.ModelRunner._forward = failing_forward(module.ModelRunner._forward,
                                                          self.token)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("CANDOR_TEST_FAULT_TOKEN"):
    sys.meta_path.insert(0, _PatchModelRunner(int(os.environ["CANDOR_TEST_FAULT_TOKEN"])))
