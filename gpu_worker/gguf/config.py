"""A GGUF file's metadata as an HF ``config.json`` dict, read the way llama.cpp reads it.

transformers' own GGUF mapping leaves out fields llama.cpp uses (the head size of
Qwen 3 and Gemma, Gemma 2's soft-caps, RoPE scaling, Gemma 3's local RoPE base and
window pattern, the end-of-turn token); the defaults of its config classes then stand
in for them. Here every field comes from the file, or from the value llama.cpp itself
hard-codes for that architecture (cited below), so the decoder computes what llama.cpp
does. What neither can express exactly is refused with a ``GGUFError`` naming the key.

Torch-free (the launcher writes the prepared directory's config.json with it).
"""

from __future__ import annotations

from typing import Any

from gguf.constants import GGMLQuantizationType

from gpu_worker.gguf.reader import GGUFError, GGUFFile

# GGUF general.architecture -> (HF model_type, HF architectures[0])
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),  # Mistral's GGUFs are llama too
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
# llama.cpp's model-type detection that picks Gemma's attention scale (llama-model.cpp:
# the 27B models scale by hidden / heads, the others by the head size)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_HALF = {GGMLQuantizationType.F16: "float16", GGMLQuantizationType.BF16: "bfloat16"}


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """The config.json of ``f`` (its architecture must be one of ``ARCHITECTURES``)."""
    arch = f.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{f.path}: general.architecture={arch!r} is not supported "
                        f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    if "rope_freqs.weight" in f.tensors:
        raise GGUFError(f"{f.path}: tensor rope_freqs.weight (per-frequency RoPE factors, Llama 3.1 "
                        "style) is not supported yet")
    key = _Keys(f, arch)
    model_type, class_name = ARCHITECTURES[arch]
    hidden, heads = key.int("embedding_length"), key.int("attention.head_count")
    head_dim = key.int("attention.key_length", hidden // heads)
    if key.int("attention.value_length", head_dim) != head_dim:
        raise GGUFError(f"{f.path}: {arch}.attention.value_length differs from the key length {head_dim}")
    rotary = key.int("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise GGUFError(f"{f.path}: {arch}.rope.dimension_count={rotary} (partial rotary over a "
                        f"{head_dim}-wide head) is not supported")
    tokens = f.get("tokenizer.ggml.tokens")
    cfg: dict[str, Any] = {
        "architectures": [class_name],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": key.int("feed_forward_length"),
        "num_hidden_layers": key.int("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key.int("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": key.float("attention.layer_norm_rms_epsilon", 1e-5),
        "max_position_embeddings": key.int("context_length"),
        "vocab_size": key.int("vocab_size", len(tokens) if tokens is not None else None),
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "rope_theta": key.float("rope.freq_base", 10000.0),
        "torch_dtype": _dtype(f),
        **_special_ids(f),
    }
    scaling = _rope_scaling(f, key)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    if model_type in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False  # llama.cpp runs Qwen 2 and 3 without a window
    if arch in _GEMMA_27B_LAYERS:
        cfg.update(_gemma(f, key, arch, cfg))
    return cfg


class _Keys:
    """``{arch}.name`` metadata, typed; a required key that is absent is a GGUFError."""

    def __init__(self, f: GGUFFile, arch: str) -> None:
        self.f, self.arch = f, arch

    def raw(self, name: str, default: Any = ...) -> Any:
        full = f"{self.arch}.{name}"
        if full in self.f.metadata:
            return self.f.metadata[full]
        if default is ...:
            raise GGUFError(f"{self.f.path}: metadata {full} is missing")
        return default

    def int(self, name: str, default: Any = ...) -> int:
        value = self.raw(name, default)
        if isinstance(value, list):  # per-layer values (llama.cpp allows them for head counts)
            if len(set(value)) != 1:
                raise GGUFError(f"{self.f.path}: {self.arch}.{name} differs between layers ({value[:8]}...)")
            value = value[0]
        if value is None:
            raise GGUFError(f"{self.f.path}: metadata {self.arch}.{name} is missing")
        return int(value)

    def float(self, name: str, default: Any = ...) -> float:
        return float(self.raw(name, default))


def _dtype(f: GGUFFile) -> str:
    """The file's float type when its matrices are all F16 or all BF16; else float32 (blocks
    dequantize to fp32, as transformers loads them)."""
    types = {t.ggml_type for t in f.tensors.values() if len(t.shape) > 1}
    return _HALF[next(iter(types))] if len(types) == 1 and next(iter(types)) in _HALF else "float32"


def _special_ids(f: GGUFFile) -> dict[str, Any]:
    """bos/pad ids, and the ids that end generation: eos plus llama.cpp's end-of-turn and
    end-of-message tokens (Gemma's <end_of_turn>, Llama 3's <|eot_id|>) where the file names
    them, as llama.cpp stops on all of them."""
    get = lambda name: f.get(f"tokenizer.ggml.{name}_token_id")  # noqa: E731
    eos = [i for i in (get("eos"), get("eot"), get("eom")) if i is not None]
    eos = list(dict.fromkeys(eos))
    return {"bos_token_id": get("bos"), "pad_token_id": get("padding"),
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}


def _rope_scaling(f: GGUFFile, key: _Keys) -> dict[str, Any] | None:
    """``{arch}.rope.scaling.*`` as HF's rope_scaling: linear and yarn (llama.cpp's yarn
    defaults: beta_fast 32, beta_slow 1, as HF's)."""
    kind = key.raw("rope.scaling.type", "none")
    factor = key.float("rope.scaling.factor", 1.0)
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        for name, neutral in (("rope.scaling.yarn_log_multiplier", 0.0), ("rope.scaling.yarn_ext_factor", -1.0),
                              ("rope.scaling.attn_factor", 1.0), ("rope.scaling.yarn_attn_factor", 1.0)):
            value = key.raw(name, neutral)
            if value != neutral:
                raise GGUFError(f"{f.path}: {key.arch}.{name}={value} is not supported")
        out = {"rope_type": "yarn", "factor": factor,
               "original_max_position_embeddings": key.int("rope.scaling.original_context_length")}
        for name, hf in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if key.raw(name, None) is not None:
                out[hf] = key.float(name)
        return out
    raise GGUFError(f"{f.path}: {key.arch}.rope.scaling.type={kind!r} is not supported (supported: none, "
                    "linear, yarn)")


def _gemma(f: GGUFFile, key: _Keys, arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp reads (or hard-codes) for Gemma 2 and 3 (llama-model.cpp, load_hparams)."""
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else cfg["head_dim"],
        "sliding_window": key.int("attention.sliding_window", 4096),
    }
    if arch == "gemma2":  # soft-caps: llama.cpp's defaults 50 and 30 where the file has none
        out["attn_logit_softcapping"] = key.float("attn_logit_softcapping", 50.0)
        out["final_logit_softcapping"] = key.float("final_logit_softcapping", 30.0)
    else:  # gemma3: every 6th layer global; local layers rotate with base 10000, unscaled
        pattern = key.raw("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # one flag per layer (true: sliding)
            out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
        else:
            out["sliding_window_pattern"] = int(pattern)
        out["rope_local_base_freq"] = key.float("rope.freq_base_swa", 10000.0)
        out["attn_logit_softcapping"] = None
        out["final_logit_softcapping"] = None
    return out
