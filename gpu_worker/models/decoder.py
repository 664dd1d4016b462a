"""One decoder-only transformer over a flattened, unpadded token batch, with switches.

Every linear layer sees all tokens of the step as one [num_tokens, hidden] matrix; only
attention needs to know where sequences start and end (see ``attention.py``). q/k/v and
gate/up are fused into one matmul each (each model class says how the checkpoint's
tensors map onto them, see ``registry``). What differs between families is a switch in
``ModelConfig``: norm kind and placement, q/k norms, biases, activation, dense or
mixture-of-experts MLP, multipliers, soft-caps, and each layer's window and RoPE table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.attention import AttentionMetadata, paged_attention
from gpu_worker.model_config import LayerSpec, ModelConfig
from gpu_worker.models.blocks import RMSNorm, RotaryEmbedding, activation, make_norm

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.scale
        self.window, self.softcap, self.rope = spec.window, cfg.attn_softcap, spec.rope
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm != "none":
            q_dim, k_dim = (cfg.head_dim, cfg.head_dim) if cfg.qk_norm == "head" else (cfg.q_size, cfg.kv_size)
            one_plus = cfg.norm == "rms_1p"
            self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, one_plus)
            self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, one_plus)

    def forward(self, x, cos_sins, kv_cache: KVCache, meta: AttentionMetadata):
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        cos_sin = None if self.rope is None else cos_sins[self.rope]
        if self.qk_norm == "none" and cos_sin is not None:
            # q and k heads side by side: one rotation for both (same elementwise math).
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = RotaryEmbedding.rotate(qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim), cos_sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if self.qk_norm == "full":
                q, k = self.q_norm(q), self.k_norm(k)
            q = q.reshape(n, self.num_heads, self.head_dim)
            k = k.reshape(n, self.num_kv_heads, self.head_dim)
            if self.qk_norm == "head":
                q, k = self.q_norm(q), self.k_norm(k)
            if cos_sin is not None:
                q, k = RotaryEmbedding.rotate(q, cos_sin), RotaryEmbedding.rotate(k, cos_sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window, self.softcap)
        return self.o_proj(out.view(n, self.q_size))


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size or cfg.intermediate_size
        self.act = activation(cfg.act)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate).mul_(up))


class PlainMLP(nn.Module):
    """Starcoder2's fc -> activation -> proj."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.act = activation(cfg.act)
        self.c_fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.c_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Experts(nn.Module):
    """Every expert's fused gate|up ``w13`` [E, 2I, H] and ``w2`` [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))


class SparseMoE(nn.Module):
    """Router softmax (fp32) -> top-k -> optional renormalisation, as Mixtral and
    Qwen3-MoE do; then one batched matmul pair per expert over the rows routed to it (a
    loop over experts, never over tokens), summed back with ``index_add_`` in expert
    order as HF does."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.act = activation(cfg.act)
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # (row, slot) pairs grouped by expert: one sort instead of a mask per expert.
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.experts.w13.shape[0]).tolist()
        rows = order // self.top_k
        slot_weights = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        inter = self.experts.intermediate
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            idx = rows[start:start + count]
            gate, up = F.linear(x[idx], self.experts.w13[e]).split(inter, dim=-1)
            h = F.linear(self.act(gate) * up, self.experts.w2[e])
            out.index_add_(0, idx, (h * slot_weights[start:start + count, None]).to(x.dtype))
            start += count
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.placement = cfg.norm_placement
        self.residual_scale = cfg.residual_scale
        self.self_attn = Attention(cfg, spec)
        if spec.moe:
            self.mlp = SparseMoE(cfg)
        else:
            self.mlp = PlainMLP(cfg) if cfg.mlp == "plain" else GatedMLP(cfg)
        if self.placement in ("pre", "sandwich"):
            self.input_layernorm = make_norm(cfg)
        self.post_attention_layernorm = make_norm(cfg)
        if self.placement == "sandwich":
            self.pre_feedforward_layernorm = make_norm(cfg)
        if self.placement in ("sandwich", "post"):
            self.post_feedforward_layernorm = make_norm(cfg)

    def _add(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # in place: x is this step's own activation (never a weight or an input buffer)
        return x.add_(h if self.residual_scale == 1.0 else h.mul_(self.residual_scale))

    def forward(self, x, cos_sins, kv_cache, meta):
        if self.placement == "pre":
            x = self._add(x, self.self_attn(self.input_layernorm(x), cos_sins, kv_cache, meta))
            return self._add(x, self.mlp(self.post_attention_layernorm(x)))
        if self.placement == "sandwich":
            h = self.self_attn(self.input_layernorm(x), cos_sins, kv_cache, meta)
            x = self._add(x, self.post_attention_layernorm(h))
            return self._add(x, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))))
        x = self._add(x, self.post_attention_layernorm(self.self_attn(x, cos_sins, kv_cache, meta)))
        return self._add(x, self.post_feedforward_layernorm(self.mlp(x)))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec) for spec in cfg.layers)
        self.norm = make_norm(cfg)


class DecoderForCausalLM(nn.Module):
    """Parameter names mirror HF's except the fused ``qkv_proj`` / ``gate_up_proj`` /
    experts' ``w13`` and ``w2``; subclasses (``registry``) declare the mapping.

    The RoPE tables are plain tensors created on ``device`` (not parameters or buffers),
    so the module itself can be built on the meta device and materialised by the loader.
    """

    # HF checkpoint name fragment -> (our fused parameter fragment, shard id); nano-vllm's idea
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # per-expert checkpoint tensor names -> (our stacked parameter, shard id within an expert)
    expert_mapping: dict[str, tuple[str, int | None]] = {
        "gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None),
    }
    renames: dict[str, str] = {}  # checkpoint prefix fragments spelled differently here

    def __init__(self, cfg: ModelConfig, *, max_positions: int, device="cpu", dtype=torch.float32) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = [RotaryEmbedding(cfg.head_dim, rope, max_positions, device, dtype,
                                       config_max_positions=cfg.max_position_embeddings)
                       for rope in cfg.ropes]
        self.embed_scale = cfg.hidden_size**0.5 if cfg.embed_scale_sqrt_hidden else cfg.embed_scale

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Final hidden states (before the last norm) for every token: [num_tokens, hidden]."""
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale != 1.0:  # Gemma rounds sqrt(hidden) to the compute dtype first
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        cos_sins = [r.tables(positions) for r in self.rotary]
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, cos_sins, kv, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for selected rows only; the final norm is row-wise so it can run here."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(self.model.norm(hidden), weight)
        cfg = self.config
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

    # ------------------------------------------------------------------ weight names

    def shard_rows(self, fused: str, shard: str | int) -> tuple[int, int]:
        """Row range of ``shard`` inside a fused parameter named ``fused``."""
        cfg = self.config
        if fused == "qkv_proj":
            sizes = {"q": (0, cfg.q_size), "k": (cfg.q_size, cfg.kv_size),
                     "v": (cfg.q_size + cfg.kv_size, cfg.kv_size)}
            start, size = sizes[shard]
            return start, start + size
        size = cfg.intermediate_size if fused == "gate_up_proj" else cfg.moe.intermediate_size
        return shard * size, (shard + 1) * size

    def map_weight(self, hf_name: str) -> tuple[str, tuple] | None:
        """Checkpoint tensor name -> (our parameter name, index into it), or None for a
        tensor that carries nothing we use."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if self.config.tie_word_embeddings and hf_name == "lm_head.weight":
            return None
        for old, new in self.renames.items():
            hf_name = hf_name.replace(old, new)
        parts = hf_name.split(".")
        if "experts" in parts:
            i = parts.index("experts")
            expert, proj = int(parts[i + 1]), parts[i + 2]
            if proj not in self.expert_mapping:
                return hf_name, ()
            stacked, shard = self.expert_mapping[proj]
            name = ".".join(parts[:i + 1] + [stacked])
            if shard is None:
                return name, (expert,)
            lo, hi = self.shard_rows("experts", shard)
            return name, (expert, slice(lo, hi))
        for frag, (fused, shard) in self.packed_modules_mapping.items():
            if f".{frag}." in hf_name:
                lo, hi = self.shard_rows(fused, shard)
                return hf_name.replace(f".{frag}.", f".{fused}."), (slice(lo, hi),)
        return hf_name, ()
