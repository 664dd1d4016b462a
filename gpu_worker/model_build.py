"""Building one model's weights on this rank: the decoder (or encoder) for a config, made
on meta (no init cost), materialised and loaded. The runner builds the served model with
it and, for speculative decoding's ``draft_model``, the draft model (draft_model.py), so
both go through the same quantization and loading paths."""

from __future__ import annotations

import logging

import torch

from gpu_worker.loader import checkpoint_names, load_weights
from gpu_worker.model_config import ModelConfig
from gpu_worker.models.decoder import DecoderForCausalLM
from gpu_worker.models.encoder import EncoderModel
from gpu_worker.models.parallel import TPGroup
from gpu_worker.quantization import kernels as quant_kernels
from gpu_worker.quantization.plan import quantize_layers
from gpu_worker.quantization.spec import GgmlSpec

log = logging.getLogger(__name__)


def build_model(config: ModelConfig, model_path: str, *, load_format: str, seed: int,
                max_positions: int, device: torch.device, dtype: torch.dtype, tp: TPGroup,
                lm_head: bool = True) -> DecoderForCausalLM | EncoderModel:
    """This rank's shard of the model at ``model_path``, its weights loaded (or seeded,
    ``dummy``). An encoder config (BERT family) builds the bidirectional ``EncoderModel``."""
    kind = EncoderModel if config.encoder is not None else DecoderForCausalLM
    with torch.device("meta"):
        model = kind(config, max_positions=max_positions, device=device, dtype=dtype, tp=tp,
                     lm_head=lm_head)
        spec = config.quantization
        if spec is not None:  # a GGUF spec names its tensors; an HF format's are the file's
            log.info(quantize_layers(model, spec, () if isinstance(spec, GgmlSpec) else
                                     checkpoint_names(model_path)))
            if device.type == "cpu" and dtype == torch.float32:
                log.info("quantized matmuls: %s", "the CPU kernels" if quant_kernels.load() is not None
                         else "dequantized slabs (the kernels could not be built)")
    model = model.to_empty(device=device).to(dtype)
    load_weights(model, model_path, load_format, seed=seed)
    return model.eval()
