"""Architecture registry: ``model_type`` -> the model class that serves it.

Every class is the one switchable decoder (``decoder.DecoderForCausalLM``); what a class
adds is how its family's checkpoint names map onto our fused parameters. The switches
themselves come from ``model_config.PARSERS`` (torch-free, so the launcher can refuse an
unsupported checkpoint before any process starts); ``test_model_registry`` checks the
two tables name the same architectures.
"""

from __future__ import annotations

from gpu_worker.models.decoder import DecoderForCausalLM

MODELS: dict[str, type[DecoderForCausalLM]] = {}


def register(*model_types: str):
    def wrap(cls: type[DecoderForCausalLM]) -> type[DecoderForCausalLM]:
        for t in model_types:
            MODELS[t] = cls
        return cls
    return wrap


@register("llama", "mistral", "qwen2", "qwen3", "granite", "olmo2", "smollm3", "gemma2", "gemma3_text")
class LlamaForCausalLM(DecoderForCausalLM):
    """Separate q/k/v and gate/up tensors in the checkpoint, fused here."""


@register("qwen3_moe")
class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Experts as ``mlp.experts.{e}.{gate,up,down}_proj``, the router as ``mlp.gate``."""


@register("mixtral")
class MixtralForCausalLM(DecoderForCausalLM):
    """``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down)."""

    renames = {".block_sparse_moe.": ".mlp."}
    expert_mapping = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}


@register("phi3")
class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3 checkpoints already hold fused ``qkv_proj`` and ``gate_up_proj`` in our order."""

    packed_modules_mapping = {}


@register("starcoder2")
class Starcoder2ForCausalLM(DecoderForCausalLM):
    """Separate q/k/v (with biases); the MLP is ``c_fc`` / ``c_proj``, names kept as is."""

    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                              "v_proj": ("qkv_proj", "v")}


def model_class(model_type: str) -> type[DecoderForCausalLM]:
    return MODELS[model_type]
