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

from dataclasses import dataclass, fields, replace
from typing import Any

from batchlab.config.choices import ConfigError


@dataclass(frozen=True)
class Poly:
    """bytes(b, s) = bs·b·s + bss·b·s² + s1·s + ss·s² + c (integer coefficients, bytes), fitted for b >= 2;
    at b = 1 broadcasting keeps some tensors unmaterialised (an s x s mask expanded over the batch), so
    ``b1`` = (s, s², 1) coefficients of the difference there."""

    bs: int = 0
    bss: int = 0
    s1: int = 0
    ss: int = 0
    c: int = 0
    b1: tuple[int, int, int] = (0, 0, 0)

    def __post_init__(self):
        object.__setattr__(self, "b1", tuple(int(v) for v in self.b1))

    def __call__(self, b: int, s: int) -> int:
        base = self.bs * b * s + self.bss * b * s * s + self.s1 * s + self.ss * s * s + self.c
        return base + (self.b1[0] * s + self.b1[1] * s * s + self.b1[2] if b == 1 else 0)


@dataclass(frozen=True)
class Knots:
    """A quantity measured at b = 1, 2 and 3 over a set of sequence lengths: a phase's high point is a maximum
    over events (the loss's gradient, one layer's, one weight's), piecewise in s, so it is interpolated
    (piecewise parabolas in s, ``_interpolate``; linear in b from 2 and 3, b = 1 its own row)."""

    s: tuple[int, ...] = ()
    at_b1: tuple[int, ...] = ()
    at_b2: tuple[int, ...] = ()
    at_b3: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("s", "at_b1", "at_b2", "at_b3"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))

    def __call__(self, b: int, s: int) -> int:
        if not self.s:
            return 0
        if b == 1:
            return max(0, round(_interpolate(self.s, self.at_b1, s)))
        e2, e3 = _interpolate(self.s, self.at_b2, s), _interpolate(self.s, self.at_b3, s)
        return max(0, round(e2 + (b - 2) * (e3 - e2)))


def _parabola_at(xs, ys, i: int, x: float) -> float:
    """The Lagrange parabola through knots i, i + 1, i + 2, at x (exact for one event a·s² + b·s + c)."""
    (x0, x1, x2), (y0, y1, y2) = xs[i:i + 3], ys[i:i + 3]
    return (y0 * (x - x1) * (x - x2) / ((x0 - x1) * (x0 - x2)) + y1 * (x - x0) * (x - x2) / ((x1 - x0) * (x1 - x2))
            + y2 * (x - x0) * (x - x1) / ((x2 - x0) * (x2 - x1)))


def _interpolate(xs: tuple[int, ...], ys: tuple[int, ...], x: int) -> float:
    """A maximum of events, each a·s² + b·s + c with a, b >= 0, so convex: never above the chord, never below
    an event.  Between two knots: the larger of the parabolas through three knots on either side (each is one
    event where no other overtakes it there, and then a lower bound), capped by the chord; so a leader that
    changes inside the interval is followed.  Near the ends, parabolas through the interval's knots and a
    neighbour; past the last knot the parabola through the last three."""
    if x <= xs[0]:
        return ys[0]
    if len(xs) < 3:
        return ys[-1] if x >= xs[-1] else ys[0] + (ys[1] - ys[0]) * (x - xs[0]) / (xs[1] - xs[0])
    if x > xs[-1]:
        return _parabola_at(xs, ys, len(xs) - 3, x)
    i = next(i for i in range(1, len(xs)) if x <= xs[i]) - 1  # x in [xs[i], xs[i + 1]]
    chord = ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])
    fits = lambda starts: [_parabola_at(xs, ys, j, x) for j in starts if 0 <= j <= len(xs) - 3]  # noqa: E731
    one_sided = fits((i - 2, i + 1))  # knots i-2..i, and i+1..i+3
    if len(one_sided) < 2:
        one_sided += fits((i - 1, i))  # through the interval and a neighbour
    return min(chord, max(one_sided))


MODES = ("full", "selective", "checkpointed")  # a layer's policy: nothing recomputed, selective, the whole block


@dataclass(frozen=True)
class Terms:
    """One precision, one regime (below / at or above the sliding window): the fitted activation terms.

    Bytes the forward leaves for backward, autocast's 16-bit weight copies excluded (the calculator counts
    those with the parameters), per layer policy (``MODES``); ``layer_*``: one more layer; ``outside_*``: what
    the layers do not explain (embeddings, final norm, head, loss, and tensors built once per forward and
    handed to every block: a checkpointed block keeps its inputs, so a mask or ALiBi bias is kept there and
    not without AC); ``forward_*``: the forward's high point above what is live as backward starts (logits
    and the loss; with recompute a block's working set, which checkpointing frees but not before it peaks).
    A policy's four fields are None until it is traced (``policies``: those that are); the last three fields
    do not depend on the policy and come with the first one traced.
    """

    precision: str
    windowed: bool
    layer_full: Poly | None = None
    layer_selective: Poly | None = None  # models/ac.py's selective policy
    layer_checkpointed: Poly | None = None  # the whole block recomputed (keeps its input)
    outside_full: Poly | None = None
    outside_selective: Poly | None = None
    outside_checkpointed: Poly | None = None
    forward_full: Knots | None = None
    forward_selective: Knots | None = None
    forward_checkpointed: Knots | None = None
    backward_full: Knots | None = None  # backward's high point above what is live as it starts
    backward_selective: Knots | None = None
    backward_checkpointed: Knots | None = None
    optimizer_temporaries: int = 0  # the optimizer step's temporaries (its largest parameter's)
    copies_layer: int = 0  # autocast's 16-bit weight copies a layer's matmuls keep (bytes; 0 without autocast)
    copies_outside: int = 0  # ... the head's and anything else's outside the layers

    def __post_init__(self):
        for m in MODES:
            traced = [getattr(self, f"{part}_{m}") is not None for part in PARTS]
            if any(traced) and not all(traced):
                raise TypeError(f"policy {m} is traced in part only")

    @property
    def policies(self) -> frozenset[str]:
        """The layer policies traced so far."""
        return frozenset(m for m in MODES if self.layer(m) is not None)

    def layer(self, mode: str) -> Poly | None:
        return getattr(self, f"layer_{mode}")

    def outside(self, mode: str) -> Poly | None:
        return getattr(self, f"outside_{mode}")

    def forward(self, mode: str) -> Knots | None:
        return getattr(self, f"forward_{mode}")

    def backward(self, mode: str) -> Knots | None:
        return getattr(self, f"backward_{mode}")

    def merged(self, other: "Terms") -> "Terms":
        """These terms with the policies only ``other`` has (same precision and regime; the shared fields are
        the same in both, measured on the same code)."""
        assert (self.precision, self.windowed) == (other.precision, other.windowed), (self, other)
        added = {f"{part}_{m}": getattr(other, f"{part}_{m}") for m in other.policies - self.policies for part in PARTS}
        return replace(self, **added)


PARTS = ("layer", "outside", "forward", "backward")  # a policy's fields in Terms


def _poly(d: Any) -> Poly | None:
    return d if d is None or isinstance(d, Poly) else Poly(**d)


def _knots(d: Any) -> Knots | None:
    return d if d is None or isinstance(d, Knots) else Knots(**d)


def _terms(d: Any) -> Terms:
    if isinstance(d, Terms):
        return d
    d = dict(d)
    for m in MODES:
        for f in (f"layer_{m}", f"outside_{m}"):
            d[f] = _poly(d.get(f))
        for f in (f"forward_{m}", f"backward_{m}"):
            d[f] = _knots(d.get(f))
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
    # buffers (bytes): resident all along, e.g. GPT-J's sinusoidal position table, a causal-mask buffer per layer
    buffers_per_layer: int = 0
    buffers_outside: int = 0
    seconds: str = ""  # how long each tracing took, and what it traced

    def __post_init__(self):
        try:
            object.__setattr__(self, "terms", tuple(_terms(t) for t in self.terms))
        except TypeError as e:
            raise ConfigError("model", f"malformed layer profile: {e}") from None

    def lookup(self, precision: str, seq: int) -> Terms | None:
        windowed = self.sliding_window is not None and seq >= self.sliding_window
        return next((t for t in self.terms if t.precision == precision and t.windowed == windowed), None)

    def merged(self, other: "LayerProfile") -> "LayerProfile":
        """This profile with what ``other`` adds: the same model's terms traced for more precisions, regimes or
        layer policies (its source line, the newer, is kept)."""
        assert (self.key, self.shape) == (other.key, other.shape), (self.key, other.key)
        terms = {(t.precision, t.windowed): t for t in self.terms}
        for t in other.terms:
            at = (t.precision, t.windowed)
            terms[at] = terms[at].merged(t) if at in terms else t
        log = dict.fromkeys(x for s in (self.seconds, other.seconds) for x in s.split("; ") if x)  # each once
        return replace(self, source=other.source, terms=tuple(terms.values()), seconds="; ".join(log))

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
