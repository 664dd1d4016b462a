"""One decoder-only transformer over a flattened, unpadded token batch, with switches.

Every linear layer sees all tokens of the step as one [num_tokens, hidden] matrix; only
attention needs to know where sequences start and end (its backend's metadata, see
``attention/``). q/k/v and gate/up are fused into one matmul each. What differs between
families is a switch in ``ModelConfig``, set by the family's module in
``gpu_worker/architectures/``: norm kind and placement (one layer class per placement),
q/k norms, biases, activation, dense or mixture-of-experts MLP, multipliers, soft-caps,
and each layer's window and RoPE table.

Tensor parallelism lives in the layers (``parallel.py``): each rank builds only its
shard's shapes, and each layer's ``weight_loader`` reads its slice of a checkpoint
tensor, so no rank ever holds the full model. Which checkpoint tensor feeds which
parameter is the architecture's ``WeightNames`` (``checkpoint_target``).
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.architectures import llava, qwen2_vl
from gpu_worker.attention.base import AttentionMetadata
from gpu_worker.model_config import LayerSpec, ModelConfig, architecture
from gpu_worker.models import fused_moe
from gpu_worker.models import row_ops
from gpu_worker.models.blocks import RMSNorm, RotaryEmbedding, add_then_norm, make_norm
from gpu_worker.models.layer_loop import LayerLoop
from gpu_worker.models.layer_program import prenorm_program
from gpu_worker.models.linear_method import QuantizableLinear
from gpu_worker.models.parallel import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                        ReplicatedLinear, RowParallelLinear, ShardedRMSNorm, TPGroup,
                                        VocabParallelEmbedding)
from gpu_worker.models.vision import build_vision
from gpu_worker.models.weights import CheckpointTensor, copy_into
from gpu_worker.tp_shard import tp_shard

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, tp: TPGroup) -> None:
        super().__init__()
        shard = tp.shard
        self.num_heads, self.num_kv_heads, self.head_dim = shard.heads, shard.kv_heads, cfg.head_dim
        self.q_size, self.kv_size = shard.q_size, shard.kv_size
        self.window, self.softcap, self.rope = spec.window, cfg.attn_softcap, spec.rope
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.qkv_bias, tp)
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, cfg.o_bias, tp)
        self.qk_norm = cfg.qk_norm
        eps, one_plus, hd = cfg.rms_norm_eps, cfg.norm == "rms_1p", cfg.head_dim
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(hd, eps, one_plus)
            self.k_norm = RMSNorm(hd, eps, one_plus)
        elif cfg.qk_norm == "full":  # over this rank's heads of the whole projection
            self.q_norm = ShardedRMSNorm(shard.q_start * hd, self.q_size, eps, one_plus, tp)
            self.k_norm = ShardedRMSNorm(shard.kv_start * hd, self.kv_size, eps, one_plus, tp)

    def forward(self, x, cos_sins, kv_cache: KVCache, meta: AttentionMetadata):
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        cos_sin = None if self.rope is None else cos_sins[self.rope]
        if self.qk_norm == "none" and cos_sin is not None and not row_ops.applies(qkv):
            # q and k heads side by side: one rotation for both (same elementwise math).
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = RotaryEmbedding.rotate(qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim), cos_sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        elif self.qk_norm == "none" and cos_sin is not None and qkv.stride(-1) == 1:
            # the CPU kernel: q and k rotated out of the projection in one call (rope's
            # bits), v a view of it
            q, k, v = row_ops.load().rope_qkv(qkv, cos_sin[0], cos_sin[1], self.num_heads, self.num_kv_heads)
        else:  # (the CPU kernel rotates q and k into contiguous tensors, one call each)
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
        out = meta.attend(q, k, v, kv_cache[0], kv_cache[1], self.window, self.softcap)
        return self.o_proj(out.view(n, self.q_size))


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.intermediate_size = tp.shard.intermediate
        self.act_name, self.act = cfg.act, tp.numerics.activation(cfg.act)
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                       cfg.mlp_bias, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act_name == "silu" and row_ops.applies(gate_up):  # one call, batch-invariant
            return self.down_proj(row_ops.load().silu_mul(gate_up, self.intermediate_size))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate).mul_(up))


class PlainMLP(nn.Module):
    """Starcoder2's fc -> activation -> proj."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.act = tp.numerics.activation(cfg.act)
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)
        self.c_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Experts(nn.Module):
    """This rank's experts, whole (``first`` .. ``first + held``): each one's fused
    gate|up ``w13`` [2I, H] and ``w2`` [H, I], stacked."""

    def __init__(self, first: int, held: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.first, self.intermediate = first, intermediate
        self.w13 = nn.Parameter(torch.empty(held, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(held, hidden, intermediate))

    def weight_loader(self, param: torch.Tensor, source: CheckpointTensor, expert: int, part: int | None) -> int:
        """Expert ``expert``'s tensor (``part`` of ``w13``: 0 gate, 1 up); another rank's: none."""
        local = expert - self.first
        if not 0 <= local < param.shape[0]:
            return 0
        dst = param[local] if part is None else param[local].narrow(0, part * self.intermediate, self.intermediate)
        return copy_into(dst, source)


class SparseMoE(nn.Module):
    """Router softmax (fp32) -> top-k -> optional renormalisation, as Mixtral and
    Qwen3-MoE do; then, on CPU in float32, the fused kernel (``fused_moe``); elsewhere one
    batched matmul pair per expert over the rows routed to it (a loop over experts, never
    over tokens). Both sum a token's experts in expert order, as HF's ``index_add_``.
    Under tensor parallelism each rank holds whole experts: it sums its experts' share
    and one all-reduce adds the ranks'."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        moe = cfg.moe
        self.tp = tp
        self.num_experts = moe.num_experts
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.act_name, self.act = cfg.act, tp.numerics.activation(cfg.act)
        self.gate = ReplicatedLinear(cfg.hidden_size, moe.num_experts, False, tp)
        self.experts = Experts(tp.shard.expert_start, tp.shard.experts, cfg.hidden_size, moe.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        kernel = fused_moe.load() if fused_moe.applies(x, self.act_name) else None
        if kernel is not None:
            out = kernel(x, weights, chosen, self.experts.w13, self.experts.w2, self.experts.first)
        else:
            out = self.per_expert(x, weights, chosen)
        return self.tp.all_reduce(out)

    def per_expert(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """This rank's experts' share, one matmul pair per expert (any device or dtype)."""
        # (row, slot) pairs grouped by expert: one sort instead of a mask per expert.
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = order // self.top_k
        slot_weights = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        inter = self.experts.intermediate
        start = 0
        first, held = self.experts.first, self.experts.w13.shape[0]
        linear = self.tp.numerics.linear
        for e, count in enumerate(counts):
            if count == 0 or not first <= e < first + held:
                start += count
                continue
            idx = rows[start:start + count]
            gate, up = linear(x[idx], self.experts.w13[e - first]).split(inter, dim=-1)
            h = linear(self.act(gate) * up, self.experts.w2[e - first])
            out.index_add_(0, idx, (h * slot_weights[start:start + count, None]).to(x.dtype))
            start += count
        return out


class DecoderLayer(nn.Module):
    """Attention and MLP with residuals; where the norms sit is the subclass
    (``LAYERS``, by ``ModelConfig.norm_placement``)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, tp: TPGroup) -> None:
        super().__init__()
        self.residual_scale = cfg.residual_scale
        self.self_attn = Attention(cfg, spec, tp)
        if spec.moe:
            self.mlp = SparseMoE(cfg, tp)
        else:
            self.mlp = PlainMLP(cfg, tp) if cfg.mlp == "plain" else GatedMLP(cfg, tp)

    def _add(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # in place: x is this step's own activation (never a weight or an input buffer)
        return x.add_(h if self.residual_scale == 1.0 else h.mul_(self.residual_scale))

    def program(self):
        """This layer's forward as a flat program (``layer_program``), or why it keeps
        its module."""
        return f"{type(self).__name__} (pre-norm layers only)"


class PreNormLayer(DecoderLayer):
    """Norms before attention and MLP (Llama and most families)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, tp: TPGroup) -> None:
        super().__init__(cfg, spec, tp)
        self.input_layernorm = make_norm(cfg)
        self.post_attention_layernorm = make_norm(cfg)  # HF's name; it sits before the MLP

    def forward(self, x, cos_sins, kv_cache, meta):
        h = self.self_attn(self.input_layernorm(x), cos_sins, kv_cache, meta)
        return self._add(x, self.mlp(add_then_norm(self.post_attention_layernorm, x, h, self.residual_scale)))

    def program(self):
        return prenorm_program(self)


class SandwichLayer(DecoderLayer):
    """Norms before and after attention and MLP (Gemma)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, tp: TPGroup) -> None:
        super().__init__(cfg, spec, tp)
        self.input_layernorm = make_norm(cfg)
        self.post_attention_layernorm = make_norm(cfg)
        self.pre_feedforward_layernorm = make_norm(cfg)
        self.post_feedforward_layernorm = make_norm(cfg)

    def forward(self, x, cos_sins, kv_cache, meta):
        h = self.self_attn(self.input_layernorm(x), cos_sins, kv_cache, meta)
        x = self._add(x, self.post_attention_layernorm(h))
        return self._add(x, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))))


class PostNormLayer(DecoderLayer):
    """Norms after attention and MLP, on the branch only (OLMo 2)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, tp: TPGroup) -> None:
        super().__init__(cfg, spec, tp)
        self.post_attention_layernorm = make_norm(cfg)
        self.post_feedforward_layernorm = make_norm(cfg)

    def forward(self, x, cos_sins, kv_cache, meta):
        x = self._add(x, self.post_attention_layernorm(self.self_attn(x, cos_sins, kv_cache, meta)))
        return self._add(x, self.post_feedforward_layernorm(self.mlp(x)))


LAYERS: dict[str, type[DecoderLayer]] = {"pre": PreNormLayer, "sandwich": SandwichLayer, "post": PostNormLayer}


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.hidden_size, tp)
        layer = LAYERS[cfg.norm_placement]
        self.layers = nn.ModuleList(layer(cfg, spec, tp) for spec in cfg.layers)
        self.norm = make_norm(cfg)


class TokenRowsHead(ReplicatedLinear):
    """A causal LM's ``score`` head made at load time from its LM head's rows
    (``cluster.token_classifier``, vLLM's ``classifier_from_token``): the rows of
    ``score_token_ids``, or with ``score_two_way`` the one row lm_head[yes] - lm_head[no]
    (the second id minus the first), so sigmoid(score) = softmax([l_no, l_yes])[1].
    Only those rows are read from the checkpoint; the difference is taken in fp32 (as
    vLLM does) and stored in the model's dtype."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__(cfg.hidden_size, cfg.score_labels, False, tp)
        self.token_ids, self.two_way = list(cfg.score_token_ids), cfg.score_two_way

    def weight_loader(self, param: torch.Tensor, source: CheckpointTensor) -> int:
        rows = torch.cat([source.narrow(0, i, 1).read().to(torch.float32) for i in self.token_ids])
        weight = rows[1:2] - rows[0:1] if self.two_way else rows
        if tuple(weight.shape) != tuple(param.shape):
            raise ValueError(f"{source.name}: rows {self.token_ids} give a score head of "
                             f"{tuple(weight.shape)}, expected {tuple(param.shape)}")
        param.copy_(weight.to(param.dtype))
        return param.numel()


class DecoderForCausalLM(nn.Module):
    """Parameter names mirror HF's except the fused ``qkv_proj`` / ``gate_up_proj`` /
    experts' ``w13`` and ``w2``; the architecture's ``WeightNames`` map a checkpoint onto
    them (``checkpoint_target``).

    The RoPE tables are plain tensors created on ``device`` (not parameters or buffers),
    so the module itself can be built on the meta device and materialised by the loader.

    ``lm_head=False`` (a pooling deployment) builds no LM head and loads none: the
    checkpoint may be a base model without one (sentence-transformers saves ``Qwen3Model``,
    whose tensor names lack the ``model.`` prefix).

    A config with ``vision`` (LLaVA, Gemma 3) also builds the image path (``vision``: tower
    and projector, replicated on every rank); ``forward``'s ``images`` splices its embeddings
    over the placeholder rows, after the token embedding (as HF's ``masked_scatter``).
    """

    def __init__(self, cfg: ModelConfig, *, max_positions: int, device="cpu", dtype=torch.float32,
                 tp: TPGroup | None = None, lm_head: bool = True) -> None:
        super().__init__()
        self.config = cfg
        self.weight_names = architecture(cfg.model_type).weights
        self.tp = tp = tp or TPGroup(tp_shard(cfg))
        self.model = DecoderModel(cfg, tp)
        self.lm_head = (VocabParallelEmbedding(cfg.hidden_size, tp)
                        if lm_head and not cfg.tie_word_embeddings else None)
        self.has_lm_head = lm_head
        # a *ForSequenceClassification's head over the last token's normed state (made of
        # LM-head rows for a causal LM served as a classifier: TokenRowsHead)
        self.score = (None if not cfg.score_labels
                      else TokenRowsHead(cfg, tp) if cfg.score_token_ids
                      else ReplicatedLinear(cfg.hidden_size, cfg.score_labels, False, tp))
        self.rotary = [RotaryEmbedding(cfg.head_dim, rope, max_positions, device, dtype,
                                       config_max_positions=cfg.max_position_embeddings)
                       for rope in cfg.ropes]
        self.embed_scale = cfg.hidden_size**0.5 if cfg.embed_scale_sqrt_hidden else cfg.embed_scale
        self.vision = (build_vision(cfg.vision, cfg.hidden_size)
                       if cfg.vision is not None and lm_head else None)

    # Each layer as a flat program (``layer_program``) where it allows one, the module
    # where not; None (the default): every layer's module. Set by ``flatten``, with
    # ``loop``: all of them in one C++ call (``layer_loop``) where they allow it.
    programs: list | None = None
    loop: LayerLoop | None = None

    def flatten(self) -> str:
        """Run the layers as flat programs from now on, in one C++ loop where they allow
        it (call it once the weights are loaded and finished: both look them up now);
        says what runs."""
        made = [layer.program() for layer in self.model.layers]
        kept = [why for why in made if isinstance(why, str)]
        self.programs = [layer if isinstance(p, str) else p for layer, p in zip(self.model.layers, made)]
        if kept:
            return (f"{len(made) - len(kept)} of {len(made)} layers as flat programs, the others as modules "
                    f"({'; '.join(sorted(set(kept)))})")
        loop = LayerLoop.build(self)
        self.loop = None if isinstance(loop, str) else loop
        return (f"all {len(made)} layers as flat programs, "
                + ("in one C++ loop (batch-invariant attention steps)" if self.loop is not None
                   else f"from Python (not one C++ loop: {loop})"))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata,
        images: tuple[torch.Tensor, torch.Tensor] | None = None, *, flat: bool = True,
    ) -> torch.Tensor:
        """Final hidden states (before the last norm) for every token: [num_tokens, hidden].
        ``positions``: [num_tokens], or [3, num_tokens] for M-RoPE (Qwen2-VL's image
        tokens). ``images``: (rows, embeddings) that replace those rows' token embeddings.
        ``flat``: the layers' programs where ``flatten`` made them (False: the modules,
        as a step with LoRA adapter rows needs: programs skip the adapters' hooks)."""
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale != 1.0:  # Gemma rounds sqrt(hidden) to the compute dtype first
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        if images is not None:
            x = x.index_copy(0, images[0], images[1].to(x.dtype))
        cos_sins = [r.tables(positions) for r in self.rotary]
        if flat and self.loop is not None and not self.aux_layers and self.loop.runs(meta):
            return self.loop(x, cos_sins, kv_caches, meta)
        layers = self.programs if flat and self.programs is not None else self.model.layers
        if self.aux_layers:
            return self._forward_capturing(layers, x, cos_sins, kv_caches, meta)
        for layer, kv in zip(layers, kv_caches):
            x = layer(x, cos_sins, kv, meta)
        return x

    # Speculative decoding's eagle3 (gpu_worker/eagle3.py): the residual stream entering
    # each of these layers (vLLM's numbering: len(layers) is the last one's output) is
    # kept, concatenated in this order, in ``captured`` [num_tokens, len * hidden] after
    # each forward. Empty (the default): nothing is kept and forward is unchanged.
    aux_layers: tuple[int, ...] = ()
    captured: torch.Tensor | None = None

    def _forward_capturing(self, layers, x, cos_sins, kv_caches, meta) -> torch.Tensor:
        taps, hidden = self.aux_layers, x.shape[-1]
        out = x.new_empty(x.shape[0], len(taps) * hidden)

        def keep(i: int) -> None:  # (copied: the layers add into x in place)
            for j, layer_id in enumerate(taps):
                if layer_id == i:
                    out[:, j * hidden:(j + 1) * hidden].copy_(x)
        for i, (layer, kv) in enumerate(zip(layers, kv_caches)):
            keep(i)
            x = layer(x, cos_sins, kv, meta)
        keep(len(layers))
        self.captured = out
        return x

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last norm over selected rows: HF's ``last_hidden_state`` (what pooling reads)."""
        return self.model.norm(hidden)

    def classify(self, last: torch.Tensor) -> torch.Tensor:
        """A sequence classifier's logits [rows, labels] from the pooled (normed) state."""
        return self.score(last)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for selected rows only; the final norm is row-wise so it can run here."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = head.logits(self.model.norm(hidden))
        cfg = self.config
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

    def matmuls(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of every matmul the forward pass and ``compute_logits`` run (a
        quantized layer's: its method's ``probes``): the shapes whose batch invariance the
        deterministic mode checks at start-up."""
        out = []
        for module in self.modules():
            if module is self.score:  # (run one row at a time: gpu_worker.pooler)
                continue
            if isinstance(module, QuantizableLinear):
                out += module.method.probes(module)
            elif isinstance(module, Experts) and module.w13.shape[0]:
                out += [(module.w13[0], None), (module.w2[0], None)]
        if self.has_lm_head:  # (a pooling model computes no logits)
            head = self.model.embed_tokens if self.lm_head is None else self.lm_head
            out += head.method.probes(head)
        return out

    def matmul_only(self) -> list[nn.Module]:
        """Modules whose ``weight`` nothing but their matmul reads (every dense linear layer,
        an untied LM head; not a tied embedding table, which lookups read too): a packed copy
        can stand in for it (``Numerics.pack``)."""
        out = [m for m in self.modules() if isinstance(m, QuantizableLinear) and m.method.dense]
        return out + ([self.lm_head] if self.lm_head is not None and self.lm_head.method.dense else [])

    def checkpoint_targets(self, name: str) -> list[tuple[str, tuple] | None]:
        """Every parameter checkpoint tensor ``name`` feeds: its own (``checkpoint_target``)
        and, for a TokenRowsHead, the ``score`` rows read from the LM head (the embedding
        table where the head is tied to it)."""
        targets = [self.checkpoint_target(name)]
        if isinstance(self.score, TokenRowsHead) and self._lm_head_tensor(name):
            targets.append(("score.weight", ()))
        return targets

    def _lm_head_tensor(self, name: str) -> bool:
        full = name if name.startswith(("model.", "lm_head.")) else "model." + name
        if not self.config.tie_word_embeddings:
            return full == "lm_head.weight"
        return self.weight_names.target(full, True) == ("model.embed_tokens.weight", ())

    def checkpoint_target(self, name: str) -> tuple[str, tuple] | None:
        """Checkpoint tensor ``name`` -> (our parameter, the ids its layer's weight_loader
        takes), or None for a tensor that carries nothing we use."""
        if name.startswith("score.") and self.score is not None:
            return name, ()
        if self.config.vision is not None:
            name = (qwen2_vl.checkpoint_name(name) if self.config.vision.merge_size
                    else llava.checkpoint_name(name, self.config.vision))
            if name is None or name.startswith("vision."):
                return None if name is None or self.vision is None else (name, ())
        if not name.startswith(("model.", "lm_head.")):  # a base model's checkpoint
            name = "model." + name
        if name.startswith("lm_head.") and not self.has_lm_head:
            return None
        return self.weight_names.target(name, self.config.tie_word_embeddings)
