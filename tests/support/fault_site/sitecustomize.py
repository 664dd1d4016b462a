"""Imported by every Python process started with this directory on PYTHONPATH (see
tests/support/faults.py). Each hook is switched on by its variable and patches one module right
after its first import; every other process and module is left as it is:

- CANDOR_TEST_FAULT_TOKEN, CANDOR_TEST_SCRIPTS, CANDOR_TEST_STEP_DELAY_S:
  gpu_worker.model_runner gets a ModelRunner whose steps fail when they feed that token,
  that writes the scripted tokens, or whose every step takes that much longer;
- CANDOR_TEST_DROP_PLAN (``INDEX:STEP``): the gpu_worker process ``INDEX`` never sees
  step plan STEP (protocol.transport's Receiver swallows it);
- CANDOR_TEST_KV_FAULT: gpu_worker.kv_connectors.pd_transfer's KvSender garbles,
  truncates, withholds or stalls every KV transfer (tests/support/faults.py: faulty_kv_send);
- CANDOR_TEST_KV_LAYOUT (``FIELD=VALUE``): its KvSender declares that layout field
  otherwise (tests/support/faults.py: misdeclared_kv_sender);
- CANDOR_TEST_STORE_IMPORT_LOST: gpu_worker.kv_connectors.kv_store's StoreClient no
  longer holds the blocks a plan imports (tests/support/faults.py: losing_store_import);
- CANDOR_TEST_TOKENIZER_DIES_ON (a token id): a tokenizer worker is killed between a
  request's RequestInfo and its TokenizedReq (tests/support/faults.py: dying_before_scheduling)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
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


def _patch_runner(token: int | None, scripts: dict[int, list[int]] | None,
                  delay: float | None):
    def patch(module) -> None:
        from tests.support.faults import failing_forward, scripted_execute, slow_execute
        runner = module.ModelRunner
        if token is not None:
            runner._forward = failing_forward(runner._forward, token)
        if scripts is not None:
            runner.execute = scripted_execute(runner.execute, scripts)
        if delay is not None:
            runner.execute = slow_execute(runner.execute, delay)
    return patch


def _patch_transport(dropped: str | None, dies_on: str | None):
    def patch(module) -> None:
        from tests.support.faults import dropping_plan, dying_before_scheduling
        if dropped:
            index, step_id = dropped.split(":")
            module.Receiver.recv = dropping_plan(module.Receiver.recv, int(index), int(step_id))
        if dies_on:
            module.Sender.send = dying_before_scheduling(module.Sender.send, int(dies_on))
    return patch


_token = os.environ.get("CANDOR_TEST_FAULT_TOKEN")
_scripts = os.environ.get("CANDOR_TEST_SCRIPTS")
_delay = os.environ.get("CANDOR_TEST_STEP_DELAY_S")
if _token or _scripts or _delay:
    sys.meta_path.insert(0, _PatchAfterImport("gpu_worker.model_runner", _patch_runner(
        int(_token) if _token else None,
        {int(k): v for k, v in json.loads(_scripts).items()} if _scripts else None,
        float(_delay) if _delay else None)))
_dropped = os.environ.get("CANDOR_TEST_DROP_PLAN")
_dies_on = os.environ.get("CANDOR_TEST_TOKENIZER_DIES_ON")
if _dropped or _dies_on:
    sys.meta_path.insert(0, _PatchAfterImport("protocol.transport",
                                              _patch_transport(_dropped, _dies_on)))
_kv_fault = os.environ.get("CANDOR_TEST_KV_FAULT")
_kv_layout = os.environ.get("CANDOR_TEST_KV_LAYOUT")
if _kv_fault or _kv_layout:
    def _patch_kv(module) -> None:
        from tests.support.faults import faulty_kv_send, misdeclared_kv_sender
        if _kv_fault:
            module.KvSender.send = staticmethod(faulty_kv_send(module.KvSender.send,
                                                               _kv_fault))
        if _kv_layout:
            field, _, value = _kv_layout.partition("=")
            module.KvSender.__init__ = misdeclared_kv_sender(module.KvSender.__init__,
                                                             field, value)
    sys.meta_path.insert(0, _PatchAfterImport("gpu_worker.kv_connectors.pd_transfer", _patch_kv))
if os.environ.get("CANDOR_TEST_STORE_IMPORT_LOST"):
    def _patch_store_client(module) -> None:
        from tests.support.faults import losing_store_import
        module.StoreClient.import_into = losing_store_import(module.StoreClient.import_into)
    sys.meta_path.insert(0, _PatchAfterImport("gpu_worker.kv_connectors.kv_store",
                                              _patch_store_client))
