"""Flat layer programs (``gpu_worker/models/layer_program.py``) stand in for the layer
modules bit for bit, run only where they can, and never under a LoRA step.

- On families whose layers they cover (Qwen2's q|k|v biases, Mistral's window, SmolLM3's
  layers without RoPE beside ones with it), every step's hidden states and the cache the
  step writes equal the modules' exactly: prefill chunks, mixed steps and decodes, in the
  deterministic mode and out of it. (GGUF's packed blocks: tests/e2e/test_quantized_ggml.py.)
- A layer they do not cover keeps its module, and the start-up log says why.
- A step with adapter rows runs the modules (a program would skip the adapters' hooks):
  tests/unit/gpu_worker/test_lora.py's runners build programs and give PEFT's tokens.
"""

from __future__ import annotations

import pytest

from gpu_worker.models import row_ops
from tests.support import layer_programs, model_zoo

pytestmark = pytest.mark.skipif(row_ops.load() is None, reason="no C++ toolchain for the row kernels")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("programs")
    return {name: model_zoo.build(name, root / name) for name in
            ("qwen2", "mistral-window", "smollm3", "gemma2", "qwen3", "granite", "llama-yarn-gelu")}


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
@pytest.mark.parametrize("arch,programs", [("qwen2", 3), ("mistral-window", 3), ("smollm3", 2)])
def test_programs_give_every_step_the_modules_bits(zoo, arch, programs, deterministic):
    from gpu_worker.model_runner import ModelRunner

    runner = ModelRunner(str(zoo[arch]), num_blocks=16, deterministic=deterministic)
    assert runner.deterministic is deterministic
    assert layer_programs.assert_same_bits(runner) == programs


@pytest.mark.parametrize("arch,why", [
    ("gemma2", "SandwichLayer (pre-norm layers only)"),
    ("qwen3", "q/k norms or no RoPE"),
    ("granite", "a residual scale"),
    ("llama-yarn-gelu", "an MLP other than SiLU-gated"),
    ("smollm3", "q/k norms or no RoPE"),  # its layer 1 (no RoPE); layers 0 and 2 run as programs
])
def test_a_layer_programs_do_not_cover_keeps_its_module_and_says_why(zoo, arch, why):
    from gpu_worker.models.decoder import DecoderForCausalLM
    from gpu_worker.model_runner import load_config

    cfg = load_config(str(zoo[arch]))
    model = DecoderForCausalLM(cfg, max_positions=64)
    said = model.flatten()
    assert why in said, said
    kept = [p for p, m in zip(model.programs, model.model.layers) if p is m]
    assert len(kept) == (1 if arch == "smollm3" else cfg.num_layers), said
