"""A layer profile: the per-layer terms of a model's memory, fitted from traces of its own code.  Pure Python.

The torch side (``trace/profile.py``) traces a copy of the model with P and 2P layers (P: the period of its
layer pattern, 1 for most models) at a few small shapes on fake tensors and fits, per precision and
activation-checkpointing mode, the bytes kept for backward as

    bytes(b, s) = bs·b·s + bss·b·s² + s1·s + ss·s² + c

which is exact for transformer blocks (every tensor a block keeps is b·s·width or b·heads·s², plus masks
that are s² or b·s²).  The calculator (``formula/profile.py``) evaluates these at any (b, s), so a sweep
stays instant and describes the code it was given rather than batchlab's own GPT.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from batchlab.config.choices import ConfigError


@dataclass(frozen=True)
class Poly:
    """bytes(b, s) = bs·b·s + bss·b·s² + s1·s + ss·s² + c (integer coefficients, bytes)."""

    bs: int = 0
    bss: int = 0
    s1: int = 0
    ss: int = 0
    c: int = 0

    def __call__(self, b: int, s: int) -> int:
        return self.bs * b * s + self.bss * b * s * s + self.s1 * s + self.ss * s * s + self.c


@dataclass(frozen=True)
class Terms:
    """One precision, one regime (below / at or above the sliding window): the fitted activation terms.

    Bytes the forward leaves for backward, autocast's 16-bit weight copies excluded (the calculator counts
    those with the parameters); ``*_layer``: one more layer; ``outside``: embeddings, final norm, head, loss.
    """

    precision: str
    windowed: bool
    layer_full: Poly  # nothing recomputed
    layer_selective: Poly  # models/ac.py's selective policy
    layer_checkpointed: Poly  # the whole block recomputed (keeps its input)
    outside: Poly


def _poly(d: Any) -> Poly:
    return d if isinstance(d, Poly) else Poly(**d)


def _terms(d: Any) -> Terms:
    if isinstance(d, Terms):
        return d
    d = dict(d)
    for f in ("layer_full", "layer_selective", "layer_checkpointed", "outside"):
        d[f] = _poly(d[f])
    return Terms(**d)


@dataclass(frozen=True)
class LayerProfile:
    """What a model's own code keeps, for the calculator: exact parameter counts and fitted activation terms."""

    key: str  # hash of the HF config, the shape, the torch / transformers versions and the backend
    shape: str  # ModelSpec.shape_id() of the model it describes
    source: str  # how it was obtained, e.g. "trace of 2 blocks at 6 shapes"
    period: int  # layers per repeat of the layer pattern (gemma2 alternates sliding and global: 2)
    sliding_window: int | None
    embedding: int  # parameters: input (+ position) embeddings
    per_layer: int
    final: int  # final norm and anything else outside the layers and the head
    head: int  # 0 when tied to the embedding
    terms: tuple[Terms, ...] = ()

    def __post_init__(self):
        try:
            object.__setattr__(self, "terms", tuple(_terms(t) for t in self.terms))
        except TypeError as e:
            raise ConfigError("model", f"malformed layer profile: {e}") from None

    def lookup(self, precision: str, seq: int) -> Terms | None:
        windowed = self.sliding_window is not None and seq >= self.sliding_window
        return next((t for t in self.terms if t.precision == precision and t.windowed == windowed), None)

    @classmethod
    def from_dict(cls, d: Any) -> "LayerProfile":
        if isinstance(d, LayerProfile):
            return d
        if not isinstance(d, dict):
            raise ConfigError("model", f"a layer profile must be a table, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except TypeError as e:
            raise ConfigError("model", f"malformed layer profile: {e}") from None
