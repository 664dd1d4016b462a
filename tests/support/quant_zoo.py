"""Tiny HF quantized checkpoints of a zoo model, each beside the same model dequantized to
float32 (a plain checkpoint the dense path and transformers load).

- compressed-tensors (W4A16 ``pack-quantized`` symmetric and asymmetric, W8A8
  ``int-quantized``, FP8 ``float-quantized`` with dynamic per-token activations): written
  with the library's own quantization config, ``calculate_qparams`` and
  ``ModelCompressor``; transformers loads them on CPU.
- GPTQ, AWQ and FP8 (``quant_method: fp8``, block-wise or per tensor): their quantizers
  need a GPU or calibration data, so these are written from the published layouts:
  GPTQ (AutoGPTQ v1): ``qweight`` int32 [in/8, out] (input k in bits 4 * (k % 8)),
  ``qzeros`` int32 [groups, out/8] holding zero - 1, ``scales`` fp16 [groups, out],
  ``g_idx`` int32 [in]; AWQ (GEMM): ``qweight`` int32 [in, out/8] whose nibble i holds
  output 8j + (0, 2, 4, 6, 1, 3, 5, 7)[i], ``qzeros`` likewise [groups, out/8] (zero as
  is), ``scales`` fp16 [groups, out]; FP8: ``weight`` float8_e4m3fn, ``weight_scale_inv``
  [out/128, in/128] (``weight_block_size``) or a scalar ``weight_scale`` (+ ``input_scale``).
  Weights dequantize as ``(q - zero) * scale`` and ``fp8 * scale``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_PACK = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output 8j + AWQ_PACK[i]


def _quantized_names(tensors: dict) -> list[str]:
    return [n for n, t in tensors.items() if t.dim() == 2 and n.startswith("model.layers.")]


def _write(src: Path, out: Path, tensors: dict, quantization_config: dict | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    save_file(tensors, str(out / "model.safetensors"))
    if quantization_config is not None:
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"] = quantization_config
        (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def int4_groups(w: torch.Tensor, g_idx: torch.Tensor, groups: int, symmetric: bool):
    """Min-max int4 of ``w`` [out, in] by input group: (q uint8 [out, in], scales as fp16
    [out, groups], zeros int [out, groups])."""
    scales = torch.empty(w.shape[0], groups)
    zeros = torch.empty(w.shape[0], groups, dtype=torch.long)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if symmetric:
            scales[:, g], zeros[:, g] = torch.maximum(-lo, hi) / 7, 8
        else:
            scales[:, g] = (hi - lo) / 15
            zeros[:, g] = torch.round(-lo / scales[:, g]).clamp(0, 15)
    scales = scales.half().float()
    q = (torch.round(w / scales[:, g_idx]) + zeros[:, g_idx]).clamp(0, 15).to(torch.uint8)
    return q, scales, zeros


def _pack_words(values: np.ndarray, order=tuple(range(8))) -> torch.Tensor:
    """[..., 8m] values 0..15 -> int32 [..., m], nibble i of a word holding element order[i]."""
    v = values.reshape(*values.shape[:-1], -1, 8).astype(np.uint32)
    word = sum(v[..., order[i]] << np.uint32(4 * i) for i in range(8))
    return torch.from_numpy(np.ascontiguousarray(word).view(np.int32))


def write_int4(src: Path, out: Path, ref: Path, fmt: str, group: int = 32, symmetric: bool = True,
               act_order: bool = False, seed: int = 0) -> tuple[Path, Path]:
    """GPTQ (``fmt`` gptq) or AWQ (awq) from the published layout."""
    tensors = load_file(str(src / "model.safetensors"))
    qt, dq = dict(tensors), dict(tensors)
    gen = torch.Generator().manual_seed(seed)
    orders: dict[str, torch.Tensor] = {}  # per input: GPTQ orders columns by the input's Hessian
    for name in _quantized_names(tensors):
        w = tensors[name]
        n, k = w.shape
        g_idx = torch.arange(k) // group
        if act_order:  # groups over a permutation of the input columns, one per input
            source = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            order = orders.setdefault(source, torch.randperm(k, generator=gen))
            g_idx = g_idx[torch.argsort(order)]
        q, scales, zeros = int4_groups(w, g_idx, k // group, symmetric)
        dq[name] = ((q.float() - zeros[:, g_idx].float()) * scales[:, g_idx]).contiguous()
        stem = name.removesuffix(".weight")
        del qt[name]
        if fmt == "gptq":
            qt[stem + ".qweight"] = _pack_words(q.numpy()).t().contiguous()
            qt[stem + ".qzeros"] = _pack_words((zeros - 1).t().numpy())
            qt[stem + ".g_idx"] = g_idx.to(torch.int32)
        else:
            qt[stem + ".qweight"] = _pack_words(q.t().numpy(), AWQ_PACK)
            qt[stem + ".qzeros"] = _pack_words(zeros.t().numpy(), AWQ_PACK)
        qt[stem + ".scales"] = scales.t().half().contiguous()
    config = ({"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": symmetric,
               "checkpoint_format": "gptq"} if fmt == "gptq" else
              {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": not symmetric,
               "version": "gemm"})
    return _write(src, out, qt, config), _write(src, ref, dq, None)


def write_fp8(src: Path, out: Path, ref: Path, block: tuple[int, int] | None = (128, 128)) -> tuple[Path, Path]:
    """``quant_method: fp8``: block scales (``weight_scale_inv``) or one per tensor."""
    tensors = load_file(str(src / "model.safetensors"))
    qt, dq = dict(tensors), dict(tensors)
    for name in _quantized_names(tensors):
        w = tensors[name]
        n, k = w.shape
        stem = name.removesuffix(".weight")
        if block is None:
            scale = w.abs().amax() / 448
            wq = (w / scale).to(torch.float8_e4m3fn)
            qt[stem + ".weight_scale"] = scale.reshape(())
            qt[stem + ".input_scale"] = torch.tensor(0.01)  # static activation scale (not used)
            dq[name] = wq.float() * scale
        else:
            bn, bk = block
            blocks = w.view(n // bn, bn, k // bk, bk)
            scale = blocks.abs().amax(dim=(1, 3)) / 448  # [n / bn, k / bk]
            wq = (blocks / scale[:, None, :, None]).view(n, k).to(torch.float8_e4m3fn)
            qt[stem + ".weight_scale_inv"] = scale.contiguous()
            dq[name] = (wq.float().view(n // bn, bn, k // bk, bk) * scale[:, None, :, None]).view(n, k)
        qt[name] = wq
    config = {"quant_method": "fp8", "activation_scheme": "dynamic" if block else "static", "fmt": "e4m3"}
    if block is not None:
        config["weight_block_size"] = list(block)
    return _write(src, out, qt, config), _write(src, ref, dq, None)


def write_compressed(src: Path, out: Path, ref: Path, scheme: str, group: int = 32) -> tuple[Path, Path]:
    """compressed-tensors ``scheme``: w4a16 (symmetric), w4a16-asym, w8a8 or fp8-dynamic,
    quantized and compressed by the library; ``ref``: its weights dequantized."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from transformers import AutoModelForCausalLM

    weights = {
        "w4a16": (dict(weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                                                group_size=group)), "pack-quantized"),
        "w4a16-asym": (dict(weights=QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group",
                                                     group_size=group)), "pack-quantized"),
        "w8a8": (dict(weights=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
                      input_activations=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token",
                                                         dynamic=True)), "int-quantized"),
        "fp8-dynamic": (dict(weights=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel"),
                             input_activations=QuantizationArgs(num_bits=8, type="float", symmetric=True,
                                                                strategy="token", dynamic=True)), "float-quantized"),
    }
    args, fmt = weights[scheme]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **args)}, ignore=["lm_head"]))
    dense = load_file(str(src / "model.safetensors"))
    for name, module in model.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        a = module.quantization_scheme.weights
        w = module.weight.detach()
        view = w.view(w.shape[0], -1, a.group_size) if a.strategy == "group" else w.unsqueeze(1)
        scale, zero = calculate_qparams(view.amin(-1), view.amax(-1), a)
        module.weight_scale.data.copy_(scale.view_as(module.weight_scale))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.view_as(module.weight_zero_point))
        module.quantization_status = QuantizationStatus.FROZEN
        # the reference: the library's own quantize-dequantize of this weight
        from compressed_tensors.quantization.lifecycle.forward import fake_quantize
        dense[name + ".weight"] = fake_quantize(w, module.weight_scale, getattr(module, "weight_zero_point", None),
                                                a).contiguous()
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in src.iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out, _write(src, ref, dense, None)
