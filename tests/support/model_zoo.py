"""Tiny random-weight checkpoints of every supported architecture, built with transformers'
own config and model classes, for parity tests against HF (nothing is downloaded).

Weights are perturbed away from HF's initial values: norm weights (and Gemma's zero-
centred ones) around 1 with noise, biases non-zero, so a norm or bias we forget to load
changes the tokens. Every checkpoint shares the project's tiny tokenizer (vocab 2048), so
the same directory also serves through the real processes.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 2048
STD = 0.25

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0,
               eos_token_id=4, pad_token_id=5)


def _moe(**kw) -> dict:
    return dict(num_local_experts=4, num_experts_per_tok=2, **kw)


# name -> (config class, model class, config kwargs beyond _COMMON)
ARCHS: dict[str, tuple[str, str, dict]] = {
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(attention_bias=True)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])),
    "qwen3_moe-unnormed": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                           dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", _moe(sliding_window=None)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(sliding_window=24, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                    final_logit_softcapping=5.0, hidden_activation="gelu_pytorch_tanh",
                    num_hidden_layers=4)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(sliding_window=24, query_pre_attn_scalar=16, num_hidden_layers=4,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                      "full_attention"],
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                             "rope_theta": 1000000.0}})),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(num_key_value_heads=4, original_max_position_embeddings=256,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                   "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                   "long_factor": [2.0 + 0.3 * i for i in range(8)],
                                   "original_max_position_embeddings": 256})),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
                     logits_scaling=4.0, attention_bias=True, mlp_bias=True)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict()),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM",
                dict(no_rope_layers=[1, 0, 1], tie_word_embeddings=True)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM",
                   dict(sliding_window=24, use_bias=True, hidden_act="gelu_pytorch_tanh",
                        norm_epsilon=1e-5)),
    "llama-yarn-gelu": ("LlamaConfig", "LlamaForCausalLM",
                        dict(hidden_act="gelu", max_position_embeddings=1024,
                             rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                              "original_max_position_embeddings": 256})),
}


# Gemma multiplies embeddings by sqrt(hidden): smaller ones keep the layers' say in the
# residual stream (else greedy output just repeats a token).
EMBED_STD = {"gemma2": STD / 8, "gemma3_text": STD / 8}


def perturb(model, seed: int = 0, std: float = STD, embed_std: float | None = None) -> None:
    """Matrices and biases N(0, std); norm weights 1 + N(0, 0.2) (a norm weight left at
    HF's 1, or Gemma's 0, would hide a missing load)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name and embed_std is not None:
                p.copy_(noise * embed_std)
            elif "router" in name or name.endswith("mlp.gate.weight"):
                p.copy_(noise)  # clear expert choices (no near-ties in the top-k)
            else:
                p.copy_(noise * std)


def build(name: str, out: Path, tokenizer_dir: Path | None = None, **overrides) -> Path:
    """Save a tiny ``name`` checkpoint (weights, config, and the tiny tokenizer files when
    ``tokenizer_dir`` is given) into ``out``."""
    import shutil

    import transformers

    cfg_cls, model_cls, extra = ARCHS[name]
    kwargs = {**_COMMON, **extra, **overrides}
    config = getattr(transformers, cfg_cls)(**kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    perturb(model, embed_std=EMBED_STD.get(name))
    model.save_pretrained(out)
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
                shutil.copy(f, out / f.name)
    return out


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare exactly n tokens
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def build_draft(out: Path, target_dir: Path, *, seed: int = 1, layers: int = 2) -> Path:
    """A tiny Llama draft model for speculative decoding's ``draft_model`` over the target
    at ``target_dir`` (the project's tiny model, or any zoo checkpoint built with its
    tokenizer): the target's tokenizer files, vocabulary and special ids, its context,
    ``layers`` layers and weights of its own (``seed``), so few of its drafts match."""
    import json
    import shutil

    import transformers

    target = json.loads((Path(target_dir) / "config.json").read_text())
    config = transformers.LlamaConfig(
        vocab_size=target["vocab_size"], hidden_size=64, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=target["max_position_embeddings"], tie_word_embeddings=False,
        bos_token_id=target.get("bos_token_id"), eos_token_id=target.get("eos_token_id"),
        pad_token_id=target.get("pad_token_id"))
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    perturb(model, seed=seed)
    model.save_pretrained(out)
    for f in Path(target_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, Path(out) / f.name)
    return Path(out)


def build_eagle3(out: Path, target_dir: Path, *, seed: int = 2, aux_layers: list[int] | None = None,
                 draft_vocab: int | None = None, embeddings: bool = False,
                 drop: tuple[str, ...] = (), **config) -> Path:
    """A tiny random EAGLE-3 head for the target at ``target_dir`` in vLLM's checkpoint
    layout (gpu_worker/eagle3_config.py): ``config.json`` (``LlamaForCausalLMEagle3``) and
    one safetensors file with ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` and
    ``t2d``. ``aux_layers``: its ``eagle_aux_hidden_state_layer_ids`` (None: the default
    ones); ``draft_vocab``: a draft vocabulary of that many target ids (a random sorted
    subset, mapped by ``d2t``; None: the whole vocabulary); ``embeddings``: its own
    ``embed_tokens``; ``drop``: tensors left out; ``config``: config.json overrides.
    Random: few of its drafts are kept."""
    import json

    from safetensors.torch import save_file

    target = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads, head_dim, inter = 4, 2, 16, 128
    dv = draft_vocab or vocab
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
           "vocab_size": vocab, "draft_vocab_size": dv, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "max_position_embeddings": target["max_position_embeddings"],
           "tie_word_embeddings": False, "bos_token_id": target.get("bos_token_id"),
           "eos_token_id": target.get("eos_token_id")}
    if aux_layers is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers,
                               "use_aux_hidden_state": True}
    cfg.update(config)
    n_aux = len(aux_layers) if aux_layers is not None else 3
    gen = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * (cols ** -0.5)

    def norm() -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(hidden, generator=gen)
    p = "midlayer."
    tensors = {"fc.weight": mat(hidden, n_aux * hidden),
               p + "input_layernorm.weight": norm(), p + "hidden_norm.weight": norm(),
               p + "post_attention_layernorm.weight": norm(),
               p + "self_attn.q_proj.weight": mat(heads * head_dim, 2 * hidden),
               p + "self_attn.k_proj.weight": mat(kv_heads * head_dim, 2 * hidden),
               p + "self_attn.v_proj.weight": mat(kv_heads * head_dim, 2 * hidden),
               p + "self_attn.o_proj.weight": mat(hidden, heads * head_dim),
               p + "mlp.gate_proj.weight": mat(inter, hidden), p + "mlp.up_proj.weight": mat(inter, hidden),
               p + "mlp.down_proj.weight": mat(hidden, inter),
               "norm.weight": norm(), "lm_head.weight": mat(dv, hidden)}
    ids = (torch.arange(vocab) if dv == vocab
           else torch.randperm(vocab, generator=gen)[:dv].sort().values)
    tensors["d2t"] = ids - torch.arange(dv)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    if embeddings:
        tensors["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=gen) * 0.5
    for name in drop:
        tensors.pop(name)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out
