"""Imported by every Python process started with this directory on PYTHONPATH (see
tests/faults.py). With CANDOR_TEST_FAULT_TOKEN or CANDOR_TEST_SCRIPTS set, the first import
of gpu_worker.model_runner gets a ModelRunner patched accordingly; every other process and
module is left as it is."""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys

_TARGET = "gpu_worker.model_runner"


class _PatchModelRunner(importlib.abc.MetaPathFinder):
    def __init__(self, token: int | None, scripts: dict[int, list[int]] | None) -> None:
        self.token = token
        self.scripts = scripts

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # find the real module with the other finders
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module) -> None:
            exec_module(module)
            from tests.faults import failing_forward, scripted_execute
            runner = module.ModelRunner
            if self.token is not None:
                runner._forward = failing_forward(runner._forward, self.token)
            if self.scripts is not None:
                runner.execute = scripted_execute(runner.execute, self.scripts)

        spec.loader.exec_module = exec_and_patch
        return spec


_token = os.environ.get("CANDOR_TEST_FAULT_TOKEN")
_scripts = os.environ.get("CANDOR_TEST_SCRIPTS")
if _token or _scripts:
    sys.meta_path.insert(0, _PatchModelRunner(
        int(_token) if _token else None,
        {int(k): v for k, v in json.loads(_scripts).items()} if _scripts else None))
