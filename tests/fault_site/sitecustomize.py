"""Imported by every Python process started with this directory on PYTHONPATH (see
tests/faults.py). Each fault is switched on by its variable and patches one module right
after its first import; every other process and module is left as it is:

- CANDOR_TEST_FAULT_TOKEN: gpu_worker.model_runner gets a ModelRunner whose steps fail
  when they feed that token;
- CANDOR_TEST_DROP_PLAN (``INDEX:STEP``): the gpu_worker process ``INDEX`` never sees
  step plan STEP, as when its subscription reconnects while the plan is published."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, patch) -> None:
        self.target = target
        self.patch = patch

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)  # find the real module with the other finders
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module) -> None:
            exec_module(module)
            self.patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _failing_steps(token: int):
    def patch(module) -> None:
        from tests.faults import failing_forward
        module.ModelRunner._forward = failing_forward(module.ModelRunner._forward, token)
    return patch


def _dropped_plan(index: int, step_id: int):
    def patch(module) -> None:
        from tests.faults import dropping_plan
        module.Receiver.recv = dropping_plan(module.Receiver.recv, index, step_id)
    return patch


if os.environ.get("CANDOR_TEST_FAULT_TOKEN"):
    sys.meta_path.insert(0, _PatchAfterImport(
        "gpu_worker.model_runner", _failing_steps(int(os.environ["CANDOR_TEST_FAULT_TOKEN"]))))
if os.environ.get("CANDOR_TEST_DROP_PLAN"):
    _index, _step = os.environ["CANDOR_TEST_DROP_PLAN"].split(":")
    sys.meta_path.insert(0, _PatchAfterImport(
        "protocol.transport", _dropped_plan(int(_index), int(_step))))
