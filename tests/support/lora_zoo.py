"""Tiny PEFT LoRA adapters for the zoo's checkpoints, built with peft's own classes and
saved with its own ``save_pretrained`` (nothing is downloaded), and PEFT's greedy tokens
as the reference.

PEFT starts ``lora_B`` at zero (an untrained adapter changes nothing); the builder draws
every LoRA matrix from a seeded generator instead, large enough that each adapter's
greedy tokens differ from the base model's and from the other adapters'.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STD = 0.15
# the two adapters the LoRA tests batch together: rank 8 on all seven projections, and
# rank 4 rslora on q, v and down of two of the three layers
NAMED = {"full": dict(rank=8, alpha=16, seed=1),
         "qv": dict(rank=4, alpha=8, seed=2, rslora=True, targets=["q_proj", "v_proj", "down_proj"],
                    layers=[0, 2])}


def build_adapter(base_dir: str | Path, out: str | Path, *, rank: int, alpha: float,
                  targets: list[str] | None = None, seed: int = 0, rslora: bool = False,
                  layers: list[int] | None = None, **extra) -> Path:
    """Save an adapter for the checkpoint in ``base_dir`` into ``out``; ``extra``: more
    ``LoraConfig`` fields (``use_dora``, ``modules_to_save`` ...)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL,
                        use_rslora=rslora, lora_dropout=0.0, layers_to_transform=layers, **extra)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * STD)
    model.save_pretrained(out)
    return Path(out)


def build_named(base_dir: str | Path, out_root: str | Path) -> dict[str, Path]:
    """The ``NAMED`` adapters for ``base_dir``, each in ``out_root / name``."""
    return {name: build_adapter(base_dir, Path(out_root) / name, **kw) for name, kw in NAMED.items()}


def edit_config(adapter_dir: str | Path, **fields) -> None:
    """Rewrite fields of an adapter's adapter_config.json (a refusal test's input)."""
    path = Path(adapter_dir) / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def peft_model(base_dir: str | Path, adapter_dir: str | Path):
    """PEFT's model: the base checkpoint with the adapter applied as PEFT computes it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    model.generation_config.eos_token_id = None  # compare exactly n tokens
    return model


def peft_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False)
    return out[0, len(prompt):].tolist()
