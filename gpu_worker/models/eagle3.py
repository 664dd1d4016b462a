"""An EAGLE-3 head (``gpu_worker.eagle3_config`` for its layout): one Llama decoder layer
that reads the target's hidden states, not only tokens.

Per row at position p: ``e`` = the embedding of the token at p + 1, ``h`` = a hidden
state for position p: ``fc`` over the target's aux hidden states there (first pass), or
the head's own ``prenorm`` output at p - 1 (each further draft). Then, as vLLM's
``llama_eagle3``::

    residual = h; x = concat(input_layernorm(e), hidden_norm(h))   # 2H
    (norm_before_residual: residual = hidden_norm(h))
    residual += o_proj(attention(qkv_proj(x)))                       # H
    residual += mlp(post_attention_layernorm(residual))
    prenorm = residual; logits = lm_head(norm(prenorm))              # draft vocabulary

A draft id d is the target id ``d + d2t[d]``. The layer's K/V lives in the head's own
paged cache (``gpu_worker/eagle3.py``). Built with the decoder's layers (one rank,
the runner's numerics), so the deterministic mode's padding applies to its matmuls.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.eagle3_config import LAYER_PREFIXES, Eagle3Config
from gpu_worker.models.blocks import RotaryEmbedding, make_norm
from gpu_worker.models.decoder import Attention, GatedMLP
from gpu_worker.models.linear_method import QuantizableLinear
from gpu_worker.models.parallel import QKVParallelLinear, ReplicatedLinear, TPGroup, VocabParallelEmbedding

_FUSED = {"self_attn.q_proj.": ("self_attn.qkv_proj.", "q"), "self_attn.k_proj.": ("self_attn.qkv_proj.", "k"),
          "self_attn.v_proj.": ("self_attn.qkv_proj.", "v"), "mlp.gate_proj.": ("mlp.gate_up_proj.", 0),
          "mlp.up_proj.": ("mlp.gate_up_proj.", 1)}


class MidLayer(nn.Module):
    def __init__(self, head: Eagle3Config, tp: TPGroup) -> None:
        super().__init__()
        cfg = head.model
        self.norm_before_residual = head.norm_before_residual
        self.input_layernorm = make_norm(cfg)
        self.hidden_norm = make_norm(cfg)
        self.post_attention_layernorm = make_norm(cfg)
        self.self_attn = Attention(cfg, cfg.layers[0], tp)
        # its q/k/v read the concatenation (2H), not the residual stream
        self.self_attn.qkv_proj = QKVParallelLinear(2 * cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                                    cfg.num_kv_heads, cfg.qkv_bias, tp)
        self.mlp = GatedMLP(cfg, tp)

    def forward(self, embeds, hidden, cos_sins, kv_cache, meta) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden.clone()
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        residual += self.self_attn(x, cos_sins, kv_cache, meta)
        residual += self.mlp(self.post_attention_layernorm(residual))
        return residual


class Eagle3Head(nn.Module):
    """Parameters: ``fc``, ``midlayer.*`` (q/k/v fused into ``qkv_proj``, gate/up into
    ``gate_up_proj``), ``norm``, ``lm_head``, ``d2t`` (where the draft vocabulary is the
    smaller one), ``embed_tokens`` (``own_embeddings``; else ``embed`` is the target's)."""

    def __init__(self, head: Eagle3Config, *, max_positions: int, device, dtype, tp: TPGroup,
                 own_embeddings: bool, has_d2t: bool) -> None:
        super().__init__()
        cfg = self.config = head.model
        self.head = head
        hidden = cfg.hidden_size
        self.fc = ReplicatedLinear(len(head.aux_layers) * hidden, hidden, False, tp)
        self.midlayer = MidLayer(head, tp)
        self.norm = make_norm(cfg)
        self.lm_head = ReplicatedLinear(hidden, head.draft_vocab_size, False, tp)
        self.embed_tokens = VocabParallelEmbedding(hidden, tp) if own_embeddings else None
        self.d2t = (nn.Parameter(torch.zeros(head.draft_vocab_size, dtype=torch.long), requires_grad=False)
                    if has_d2t else None)
        # the target's embedding module where the head has none (``share_embeddings``); a
        # plain list, so its weights are not the head's parameters
        self.shared: list[nn.Module] = []
        self.rotary = [RotaryEmbedding(cfg.head_dim, rope, max_positions, device, dtype,
                                       config_max_positions=cfg.max_position_embeddings)
                       for rope in cfg.ropes]

    def share_embeddings(self, embed: nn.Module) -> None:
        """Embed ids with ``embed`` (the target's table, whole on this rank)."""
        self.shared = [embed]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens if self.embed_tokens is not None else self.shared[0])(ids)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The first pass's hidden rows from the target's concatenated aux states."""
        return self.fc(aux)

    def forward(self, input_ids, positions, hidden, kv_caches, meta) -> torch.Tensor:
        """``prenorm`` [rows, H]: the next pass's hidden rows, and ``draft_ids``' input."""
        cos_sins = [r.tables(positions) for r in self.rotary]
        return self.midlayer(self.embed(input_ids), hidden, cos_sins, kv_caches[0], meta)

    def draft_ids(self, prenorm: torch.Tensor) -> torch.Tensor:
        """The greedy target ids after each row."""
        best = self.lm_head(self.norm(prenorm)).argmax(dim=-1)
        return best if self.d2t is None else best + self.d2t[best]

    # ------------------------------------------------------------------ as the loader sees it

    def checkpoint_target(self, name: str) -> tuple[str, tuple] | None:
        """A layout tensor -> (our parameter, its part); None: carried, not used (t2d)."""
        name = name.removeprefix("model.")
        if name == "t2d" or (name == "d2t" and self.d2t is None):
            return None
        for prefix in LAYER_PREFIXES:
            if name.startswith(prefix):
                rest = name[len(prefix):]
                for part, (fused, shard) in _FUSED.items():
                    if rest.startswith(part):
                        return "midlayer." + fused + rest[len(part):], (shard,)
                return "midlayer." + rest, ()
        return name, ()

    def matmuls(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        out = []
        for module in self.modules():
            if isinstance(module, QuantizableLinear):
                out += module.method.probes(module)
        return out

    def matmul_only(self) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, QuantizableLinear) and m.method.dense]
