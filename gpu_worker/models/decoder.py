"""One decoder-only transformer over a flattened, unpadded token batch, with switches.

Every linear layer sees all tokens of the step as one [num_tokens, hidden] matrix; only
attention needs to know where sequences start and end (see ``attention.py``). q/k/v and
gate/up are fused into one matmul each (each model class says how the checkpoint's
tensors map onto them, see ``registry``). What differs between families is a switch in
``ModelConfig``: norm kind and placement, q/k norms, biases, activation, dense or
mixture-of-experts MLP, multipliers, soft-caps, and each layer's window and RoPE table.

Tensor parallelism lives in the layers (``parallel.py``): each rank builds only its
shard's shapes, and ``weight_pieces`` tells the loader which slice of each checkpoint
tensor that rank reads, so no rank ever holds the full model.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.attention import AttentionMetadata, paged_attention
from gpu_worker.model_config import LayerSpec, ModelConfig
from gpu_worker.models.blocks import RMSNorm, RotaryEmbedding, make_norm
from gpu_worker.models.parallel import ColumnLinear, RowLinear, ShardedRMSNorm, TPGroup, VocabEmbedding
from gpu_worker.tp_shard import tp_shard

KVCache = tuple[torch.Tensor, torch.Tensor]
# (our parameter, index into it, cut of the checkpoint tensor: (dim, start, size) or None)
Piece = tuple[str, tuple, tuple[int, int, int] | None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, tp: TPGroup) -> None:
        super().__init__()
        shard = tp.shard
        self.num_heads, self.num_kv_heads, self.head_dim = shard.heads, shard.kv_heads, cfg.head_dim
        self.q_size, self.kv_size = shard.q_size, shard.kv_size
        self.scale = cfg.scale
        self.window, self.softcap, self.rope = spec.window, cfg.attn_softcap, spec.rope
        self.qkv_proj = ColumnLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, tp)
        self.o_proj = RowLinear(self.q_size, cfg.hidden_size, cfg.o_bias, tp)
        self.qk_norm = cfg.qk_norm
        one_plus = cfg.norm == "rms_1p"
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, one_plus)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, one_plus)
        elif cfg.qk_norm == "full" and tp.size == 1:
            self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps, one_plus)
            self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps, one_plus)
        elif cfg.qk_norm == "full":
            self.q_norm = ShardedRMSNorm(self.q_size, cfg.rms_norm_eps, one_plus, tp)
            self.k_norm = ShardedRMSNorm(self.kv_size, cfg.rms_norm_eps, one_plus, tp)

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
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.intermediate_size = tp.shard.intermediate
        self.act = tp.numerics.activation(cfg.act)
        self.gate_up_proj = ColumnLinear(cfg.hidden_size, 2 * self.intermediate_size, cfg.mlp_bias, tp)
        self.down_proj = RowLinear(self.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate).mul_(up))


class PlainMLP(nn.Module):
    """Starcoder2's fc -> activation -> proj."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.act = tp.numerics.activation(cfg.act)
        self.c_fc = ColumnLinear(cfg.hidden_size, tp.shard.intermediate, cfg.mlp_bias, tp)
        self.c_proj = RowLinear(tp.shard.intermediate, cfg.hidden_size, cfg.mlp_bias, tp)

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
    order as HF does. Under tensor parallelism each rank holds whole experts
    (``experts_start`` on): it sums its experts' share and one all-reduce adds the ranks'."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        moe = cfg.moe
        self.tp = tp
        self.num_experts = moe.num_experts
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.act = tp.numerics.activation(cfg.act)
        self.gate = ColumnLinear(cfg.hidden_size, moe.num_experts, False, tp)
        self.experts_start = tp.shard.expert_start
        self.experts = Experts(tp.shard.experts or moe.num_experts, cfg.hidden_size, moe.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # (row, slot) pairs grouped by expert: one sort instead of a mask per expert.
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = order // self.top_k
        slot_weights = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        inter = self.experts.intermediate
        start = 0
        first, held = self.experts_start, self.experts.w13.shape[0]
        for e, count in enumerate(counts):
            if count == 0 or not first <= e < first + held:
                start += count
                continue
            idx = rows[start:start + count]
            linear = self.tp.numerics.linear
            gate, up = linear(x[idx], self.experts.w13[e - first]).split(inter, dim=-1)
            h = linear(self.act(gate) * up, self.experts.w2[e - first])
            out.index_add_(0, idx, (h * slot_weights[start:start + count, None]).to(x.dtype))
            start += count
        return self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, tp: TPGroup) -> None:
        super().__init__()
        self.placement = cfg.norm_placement
        self.residual_scale = cfg.residual_scale
        self.self_attn = Attention(cfg, spec, tp)
        if spec.moe:
            self.mlp = SparseMoE(cfg, tp)
        else:
            self.mlp = PlainMLP(cfg, tp) if cfg.mlp == "plain" else GatedMLP(cfg, tp)
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
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        if tp.size == 1:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.embed_tokens = VocabEmbedding(tp.shard, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec, tp) for spec in cfg.layers)
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

    def __init__(self, cfg: ModelConfig, *, max_positions: int, device="cpu", dtype=torch.float32,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or TPGroup(tp_shard(cfg))
        self.model = DecoderModel(cfg, tp)
        self.lm_head = None if cfg.tie_word_embeddings else ColumnLinear(
            cfg.hidden_size, tp.shard.vocab_per_rank, False, tp)
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
        logits = self.tp.numerics.linear(self.model.norm(hidden), weight)
        cfg = self.config
        if self.tp.size > 1:  # every rank's vocabulary range, padding dropped
            logits = self.tp.gather_last(logits)[:, :cfg.vocab_size]
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

    def matmuls(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of every matmul the forward pass and ``compute_logits`` run: the
        shapes whose batch invariance the deterministic mode checks at start-up."""
        out = []
        for module in self.modules():
            if isinstance(module, nn.Linear):
                out.append((module.weight, module.bias))
            elif isinstance(module, Experts):
                out += [(module.w13[0], None), (module.w2[0], None)]
        if self.lm_head is None:
            out.append((self.model.embed_tokens.weight, None))
        return out

    # ------------------------------------------------------------------ weight names

    def padding_rows(self) -> dict[str, int]:
        """Parameters whose trailing rows no checkpoint tensor fills (the last rank's
        vocabulary padding) -> how many rows; the loader zeroes them."""
        shard = self.tp.shard
        pad = shard.vocab_per_rank - shard.vocab_rows
        if self.tp.size == 1 or pad == 0:
            return {}
        names = ["model.embed_tokens.weight"] + ([] if self.lm_head is None else ["lm_head.weight"])
        return {n: pad for n in names}

    def _fused_pieces(self, name: str, fused: str, shard: str | int) -> Piece:
        """Where checkpoint shard ``shard`` of fused parameter ``fused`` lands on this
        rank: (local rows, checkpoint rows) of a separate q/k/v or gate/up tensor."""
        s, hd = self.tp.shard, self.config.head_dim
        if fused == "qkv_proj":
            local = {"q": (0, s.q_size), "k": (s.q_size, s.kv_size), "v": (s.q_size + s.kv_size, s.kv_size)}
            start, size = local[shard]
            src = s.q_start * hd if shard == "q" else s.kv_start * hd
        else:
            size = s.intermediate
            start, src = shard * size, s.rank * size
        return name, (slice(start, start + size),), (0, src, size)

    def weight_pieces(self, hf_name: str) -> list[Piece] | None:
        """Checkpoint tensor name -> the pieces of it this rank loads (possibly none:
        another rank's expert), or None for a tensor that carries nothing we use."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        cfg, s = self.config, self.tp.shard
        if cfg.tie_word_embeddings and hf_name == "lm_head.weight":
            return None
        for old, new in self.renames.items():
            hf_name = hf_name.replace(old, new)
        parts = hf_name.split(".")
        if "experts" in parts:
            i = parts.index("experts")
            expert, proj = int(parts[i + 1]), parts[i + 2]
            if proj not in self.expert_mapping:
                return [(hf_name, (), None)]
            if self.tp.size > 1 and not s.expert_start <= expert < s.expert_start + s.experts:
                return []
            expert -= s.expert_start if self.tp.size > 1 else 0
            stacked, shard = self.expert_mapping[proj]
            name = ".".join(parts[:i + 1] + [stacked])
            if shard is None:
                return [(name, (expert,), None)]
            size = cfg.moe.intermediate_size
            return [(name, (expert, slice(shard * size, (shard + 1) * size)), None)]
        for frag, (fused, shard) in self.packed_modules_mapping.items():
            if f".{frag}." in hf_name:
                return [self._fused_pieces(hf_name.replace(f".{frag}.", f".{fused}."), fused, shard)]
        if ".qkv_proj." in hf_name:  # fused in the checkpoint too (Phi-3): [q; k; v] rows
            offsets = {"q": 0, "k": cfg.q_size, "v": cfg.q_size + cfg.kv_size}
            out = []
            for shard, offset in offsets.items():
                name, index, (dim, src, size) = self._fused_pieces(hf_name, "qkv_proj", shard)
                out.append((name, index, (dim, offset + src, size)))
            return out
        if ".gate_up_proj." in hf_name:  # [gate; up] rows
            out = []
            for shard in (0, 1):
                name, index, (dim, src, size) = self._fused_pieces(hf_name, "gate_up_proj", shard)
                out.append((name, index, (dim, shard * cfg.intermediate_size + src, size)))
            return out
        if self.tp.size == 1:
            return [(hf_name, (), None)]
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            return [(hf_name, (slice(0, s.vocab_rows),), (0, s.vocab_start, s.vocab_rows))]
        leaf = parts[-2] if len(parts) >= 2 else ""
        if leaf in ("o_proj", "down_proj", "c_proj") and parts[-1] == "weight":
            try:
                cols = self.get_parameter(hf_name).shape[1]
            except AttributeError:  # not ours: the loader names it
                return [(hf_name, (), None)]
            return [(hf_name, (), (1, s.rank * cols, cols))]
        if leaf == "c_fc":
            return [(hf_name, (), (0, s.rank * s.intermediate, s.intermediate))]
        if leaf in ("q_norm", "k_norm") and cfg.qk_norm == "full":
            start = s.q_start * cfg.head_dim if leaf == "q_norm" else s.kv_start * cfg.head_dim
            size = s.q_size if leaf == "q_norm" else s.kv_size
            return [(hf_name, (), (0, start, size))]
        return [(hf_name, (), None)]
