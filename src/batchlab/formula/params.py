"""Parameter counts of a decoder-only transformer, term by term (no torch)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from batchlab.config import MLPKind, ModelSpec, NormKind, PositionKind


@dataclass(frozen=True)
class ParamCount:
    embedding: int  # token (+ learned position) tables
    per_layer: int
    layers: int
    final_norm: int
    head: int  # 0 when tied to the embedding

    @property
    def total(self) -> int:
        return self.embedding + self.per_layer * self.layers + self.final_norm + self.head

    @property
    def non_embedding(self) -> int:
        """N in the 6N rule (Kaplan et al. 2020 count non-embedding parameters)."""
        return self.per_layer * self.layers + self.final_norm


def norm_tensors(m: ModelSpec) -> int:
    """Parameter tensors of one norm: a weight, and a bias for a LayerNorm with biases."""
    return 1 if (m.norm is NormKind.RMSNORM or not m.bias) else 2


def norm_params(m: ModelSpec) -> int:
    return m.hidden * norm_tensors(m)


@functools.lru_cache(maxsize=256)  # ModelSpec is frozen; --vary calls this thousands of times
def count(m: ModelSpec) -> ParamCount:
    p = m.matching_profile
    if p is not None:  # counted from the model's own code (trace/profile.py)
        return ParamCount(embedding=p.embedding, per_layer=p.per_layer, layers=m.layers, final_norm=p.final,
                          head=p.head)
    h, kv, f, V = m.hidden, m.kv_hidden, m.ffn, m.vocab
    bias = 1 if m.bias else 0
    qkv_bias = 1 if m.qkv_bias else 0  # Qwen2: biases on q, k and v, none on the output projection
    attn = h * (h + 2 * kv) + qkv_bias * (h + 2 * kv) + h * h + bias * h
    n_mats = 3 if m.mlp is MLPKind.SWIGLU else 2
    mlp = n_mats * h * f + bias * ((n_mats - 1) * f + h)
    per_layer = attn + mlp + 2 * norm_params(m)
    embedding = V * h + position_params(m)
    head = 0 if m.tied_embeddings else V * h
    return ParamCount(embedding=embedding, per_layer=per_layer, layers=m.layers, final_norm=norm_params(m), head=head)


def position_table(m: ModelSpec) -> list[tuple[int, int]]:
    """The learned position embedding's shape (GPT-2's wpe: one row per position), [] for rotary or none."""
    return [(m.max_positions, m.hidden)] if m.position is PositionKind.LEARNED else []


def position_params(m: ModelSpec) -> int:
    return sum(rows * cols for rows, cols in position_table(m))


@functools.lru_cache(maxsize=64)
def tensor_shapes(m: ModelSpec) -> tuple[tuple[int, ...], ...]:
    """The shape of each parameter tensor of batchlab's GPT, in the order the optimizer sees them."""
    h, kv, f = m.hidden, m.kv_hidden, m.ffn
    norm = [(h,), (h,)] if (m.norm is NormKind.LAYERNORM and m.bias) else [(h,)]

    def lin(i: int, o: int) -> list[tuple[int, ...]]:  # nn.Linear(i, o): weight (o, i), bias (o,)
        return [(o, i), (o,)] if m.bias else [(o, i)]

    mlp = (lin(h, f) * 2 if m.mlp is MLPKind.SWIGLU else lin(h, f)) + lin(f, h)
    layer = norm + lin(h, h + 2 * kv) + lin(h, h) + norm + mlp
    shapes = [(m.vocab, h), *position_table(m)]
    shapes += layer * m.layers + norm
    if not m.tied_embeddings:
        shapes.append((m.vocab, h))
    return tuple(shapes)


@functools.lru_cache(maxsize=64)
def tensor_sizes(m: ModelSpec) -> tuple[int, ...]:
    """Elements of each parameter tensor of batchlab's GPT, in the order the optimizer sees them."""
    return tuple(math.prod(s) for s in tensor_shapes(m))
