"""Shared fixtures: one tiny checkpoint and one running server per test session."""

from __future__ import annotations

import pytest

from tests.support.server import CandorServer


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="tests/e2e/test_e2e_interactions.py: every allowed pair of features in "
                          "a cell of its own instead of the pairwise covering array")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """The test runs at 1 and at 2 torch threads (a kernel's rows must not depend on it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from launcher.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def server(tiny_model_dir):
    """The default topology (5 roles) on a free port, shared by the e2e tests."""
    srv = CandorServer(tiny_model_dir, "--served-model-name", "tiny-llama",
                       "--max-model-len", "1024").start()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    """The reference: HF transformers on the same checkpoint, greedy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)
