"""A bidirectional encoder (BERT, RoBERTa, XLM-R) over a flattened, unpadded batch of
whole prompts, for pooling deployments.

Post-LN layers: ``LN(x + attention(x))`` then ``LN(x + MLP(x))``; embeddings are word +
absolute position (from the config's offset) + token type, then a LayerNorm. Attention is
the ``bidirectional`` backend's (no mask, no KV cache). Module names mirror HF's, except
the fused ``qkv_proj`` (the architecture's ``WeightNames`` map ``query``/``key``/
``value`` onto it); the linear layers are the tensor-parallel ones the decoder uses, so
the deterministic mode's padded matmuls and TP apply unchanged.

A classification checkpoint (a cross-encoder) keeps its head (``classify``): BERT's
``pooler`` (dense + tanh) and ``classifier``; RoBERTa's ``classifier.dense`` + tanh and
``classifier.out_proj``; both read the first token's final state.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.attention.base import AttentionMetadata
from gpu_worker.model_config import ModelConfig, architecture
from gpu_worker.models.linear_method import QuantizableLinear
from gpu_worker.models.parallel import (ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                        RowParallelLinear, TPGroup, VocabParallelEmbedding)
from gpu_worker.tp_shard import tp_shard

_PREFIXES = ("bert.", "roberta.", "model.")
# checkpoint tensors an embedding or classification deployment never reads: the buffer
# of position ids some checkpoints save, masked-LM heads
_UNUSED = ("embeddings.position_ids", "cls.", "lm_head.")


class Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        enc = cfg.encoder
        self.offset = enc.position_offset
        self.word_embeddings = VocabParallelEmbedding(cfg.hidden_size, tp)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings + enc.position_offset, cfg.hidden_size)
        self.token_type_embeddings = (nn.Embedding(enc.type_vocab_size, cfg.hidden_size)
                                      if enc.type_vocab_size else None)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(ids) + self.position_embeddings(positions + self.offset)
        if self.token_type_embeddings is not None:
            x = x + (self.token_type_embeddings(types) if types is not None
                     else self.token_type_embeddings.weight[0])
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        shard = tp.shard
        self.heads, self.head_dim, self.q_size = shard.heads, cfg.head_dim, shard.q_size
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_heads, True, tp)


class AttentionOutput(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.dense = RowParallelLinear(cfg.q_size, cfg.hidden_size, True, tp)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.self = SelfAttention(cfg, tp)
        self.output = AttentionOutput(cfg, tp)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        s, n = self.self, x.shape[0]
        q, k, v = s.qkv_proj(x).split([s.q_size] * 3, dim=-1)
        shape = (n, s.heads, s.head_dim)
        out = meta.attend(q.reshape(shape), k.reshape(shape), v.reshape(shape))
        return self.output.LayerNorm(x + self.output.dense(out.reshape(n, s.q_size)))


class Intermediate(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, True, tp)


class Output(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.dense = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, tp)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.act = tp.numerics.activation(cfg.act)
        self.attention = Attention(cfg, tp)
        self.intermediate = Intermediate(cfg, tp)
        self.output = Output(cfg, tp)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.attention(x, meta)
        h = self.output.dense(self.act(self.intermediate.dense(x)))
        return self.output.LayerNorm(x + h)


class Stack(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(cfg, tp) for _ in range(cfg.num_layers))


class Pooler(nn.Module):
    """BERT's pooler: dense + tanh over the first token (its classifier reads it)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(cfg.hidden_size, cfg.hidden_size, True, tp)


class RobertaHead(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(cfg.hidden_size, cfg.hidden_size, True, tp)
        self.out_proj = ReplicatedLinear(cfg.hidden_size, cfg.encoder.num_labels, True, tp)


class EncoderModel(nn.Module):
    """The runner's model interface (``forward``, ``final_norm``, ``matmuls``,
    ``matmul_only``, ``checkpoint_target``) for an encoder; ``forward`` also takes each
    row's token type. No LM head: pooling only."""

    has_lm_head = False
    rotary: list = []

    def __init__(self, cfg: ModelConfig, *, max_positions: int, device="cpu", dtype=torch.float32,
                 tp: TPGroup | None = None, lm_head: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.weight_names = architecture(cfg.model_type).weights
        self.tp = tp = tp or TPGroup(tp_shard(cfg))
        self.head = cfg.encoder.head
        self.embeddings = Embeddings(cfg, tp)
        self.encoder = Stack(cfg, tp)
        if self.head == "bert":
            self.pooler = Pooler(cfg, tp)
            self.classifier = ReplicatedLinear(cfg.hidden_size, cfg.encoder.num_labels, True, tp)
        elif self.head == "roberta":
            self.classifier = RobertaHead(cfg, tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (already normed: post-LN) of every token: [num_tokens, hidden]."""
        x = self.embeddings(input_ids, positions, token_types)
        for layer in self.encoder.layer:
            x = layer(x, meta)
        return x

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # post-LN: the last layer's output is HF's last_hidden_state

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        """The head's logits [rows, num_labels] from each sequence's first-token state."""
        if self.head == "bert":
            return self.classifier(torch.tanh(self.pooler.dense(first)))
        if self.head == "roberta":
            return self.classifier.out_proj(torch.tanh(self.classifier.dense(first)))
        raise ValueError("this encoder has no classification head")

    def matmuls(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The batched matmuls (the head's run one row at a time: ``Pooler``)."""
        out = []
        for name, module in self.named_modules():
            if isinstance(module, QuantizableLinear) and not name.startswith(("pooler", "classifier")):
                out += module.method.probes(module)
        return out

    def matmul_only(self) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, QuantizableLinear) and m.method.dense]

    def checkpoint_target(self, name: str) -> tuple[str, tuple] | None:
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if name.startswith(_UNUSED) or (name.startswith("pooler.") and self.head != "bert"):
            return None
        if name.startswith("classifier.") and self.head == "none":
            return None
        return self.weight_names.target(name, False)
