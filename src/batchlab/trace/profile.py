"""Derive a model's layer terms from its own code: trace copies with P and 2P layers at small shapes.

For each precision and layer policy a config needs (nothing recomputed, selective, the whole block: what
--ac none, selective and full apply to every layer; every:K mixes the first and the last), traced when first
needed and merged into the cached profile, the bytes one forward leaves for backward are
measured on fake tensors (the CPU measurement's StorageTracker, nothing allocated) at micro-batch 1 and 2
and three sequence lengths, and fitted exactly as ``bs·b·s + bss·b·s² + s1·s + ss·s² + c`` (config/profile.py);
the difference between P and 2P layers is P layers' share, the rest is the embeddings, final norm, head
and loss.  P is the period of the layer pattern (``layer_types``: gemma2 alternates sliding and global).
A model with a sliding window gets a second set of terms fitted at s >= window (another code path).
Whole updates of 2P layers give the phases' high points at knot lengths; per micro-batch three lengths
and a check are traced and the rest derived event by event (trace/lengths.py), and the fitted shapes'
kept bytes at 2P layers come from the same updates.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from fractions import Fraction

import torch

from batchlab.config import ACPolicy, ModelSource, Precision, RunConfig
from batchlab.config.profile import MODES, Knots, LayerProfile, Poly, Terms
from batchlab.cache import profiles as cache
from batchlab.formula import profile as calculator
from batchlab.measure.memory import tracker_for
from batchlab.trace.lengths import EventLog, Run, at_shapes
from batchlab.trace.patches import eager_branches
from batchlab.trace.cuda_policy import cuda_kernels
from batchlab.trace.run import FakeTrainer, emulates_cuda, fake_mode, trace_device

# Terms' layer policies -> the --ac mode that applies it to every layer
AC_OF = {"full": "none", "selective": "selective", "checkpointed": "full"}


def _period(cfg: RunConfig) -> int:
    """Smallest P with layer_types[i] == layer_types[i % P] (1 without a pattern)."""
    from batchlab.models.hf import hf_config

    types = list(getattr(hf_config(cfg), "layer_types", None) or [])
    return next((p for p in range(1, len(types) + 1) if all(t == types[i % p] for i, t in enumerate(types))), 1)


class _KeptBytes:
    """Forwards the harness's phase marks to the tracker and notes, as backward starts, what the forward left
    (autocast's weight copies excluded: the calculator counts those with the parameters) and all that is live."""

    def __init__(self, tracker):
        self.tracker, self.kept, self.copies, self.at_backward = tracker, 0, 0, 0

    def mark(self, phase: str) -> None:
        t = self.tracker
        if phase == "backward":  # the tracker's own bookkeeping: storage -> (bytes, category)
            new = [(n, cat) for k, (n, cat) in t._live.items() if k not in t._forward_start_keys]
            self.kept = sum(n for n, cat in new if cat == "activations")
            self.copies = sum(n for n, cat in new if cat == "parameters")
            self.at_backward = t._current
        t.mark(phase)


def _update_at(trainer: FakeTrainer, b: int, s: int) -> Run:
    """One tracked update at (b, s): kept for backward, the forward's and backward's storage events, what was
    live as backward started, the optimizer step's temporaries above the model states, autocast copies kept."""
    trainer.cfg = trainer.cfg.replace(micro_batch=b, seq=s)  # the harness reads the shape from its config
    tracker = tracker_for(trainer)
    listener, log = _KeptBytes(tracker), EventLog(tracker)
    tracker.listener = log
    with tracker:
        trainer.update(listener=listener)
    snap = tracker.snapshot()
    grads = sum(p.numel() * p.element_size() for p in trainer.raw_model.parameters() if p.requires_grad)
    return Run.of(log, listener.kept, listener.at_backward, listener.copies,
                  snap.phase_peaks.get("optimizer", 0) - snap.baseline_bytes - grads)


def _parabola(points: list[tuple[int, Fraction]]) -> tuple[Fraction, Fraction, Fraction]:
    """(linear, square, constant) of the parabola through three (s, y)."""
    (x0, y0), (x1, y1), (x2, y2) = points
    ss = ((y2 - y0) / (x2 - x0) - (y1 - y0) / (x1 - x0)) / (x2 - x1)
    lin = (y1 - y0) / (x1 - x0) - ss * (x1 + x0)
    return lin, ss, y0 - lin * x0 - ss * x0 * x0


def _fit(points: dict[tuple[int, int], int]) -> tuple[Poly, int]:
    """Exact fit of f(b, s) = bs·b·s + bss·b·s² + s1·s + ss·s² + c from b in {2, 3} and three s, and of the
    b = 1 difference; returns the polynomial and the largest residual over the points (0 for transformer
    blocks)."""
    s_values = sorted({s for _, s in points})
    per_b = {s: Fraction(points[(3, s)] - points[(2, s)]) for s in s_values}  # bs·s + bss·s²
    s1, s2 = s_values[0], s_values[1]
    bss = (per_b[s2] / s2 - per_b[s1] / s1) / (s2 - s1)
    bs = per_b[s1] / s1 - bss * s1
    lin, ss, c = _parabola([(s, Fraction(points[(2, s)]) - 2 * per_b[s]) for s in s_values])
    poly = Poly(*(round(v) for v in (bs, bss, lin, ss, c)))
    if all((1, s) in points for s in s_values):
        delta = _parabola([(s, Fraction(points[(1, s)] - poly(1, s))) for s in s_values])
        poly = Poly(poly.bs, poly.bss, poly.s1, poly.ss, poly.c, tuple(round(v) for v in delta))
    return poly, max(abs(poly(b, s) - v) for (b, s), v in points.items())


def _shapes(cfg: RunConfig, windowed: bool) -> list[tuple[int, int]]:
    """Six (b, s) in one code path.  Large enough that backward's high point is set by activation gradients
    (fake tensors cost the same at any size); the smallest shape gives the floor set by weight gradients."""
    w, top = cfg.model.sliding_window, cfg.model.max_positions
    step = max(1, min(128, (w - 1) // 3 if w and not windowed else 128, (top - (w if windowed else 0)) // 3))
    start = w if windowed else step
    return [(b, start + i * step) for b in (1, 2, 3) for i in range(3)]


def _measure(cfg: RunConfig, layers: int, precision: Precision, mode: str, shapes, full: bool) -> dict:
    """(b, s) -> what ``_update_at`` returns (steady state: AdamW's state exists), or with ``full`` False
    what ``_forward_at`` returns: the kept bytes need only a forward."""
    device = trace_device(cfg)[0]
    trainer = FakeTrainer(cfg.replace(layers=layers, precision=precision, ac=ACPolicy.parse(mode), seq=shapes[0][1],
                                      micro_batch=1, accum=1, dp=1, zero=0), device)
    if not full:
        return {shape: _forward_at(trainer, *shape) for shape in shapes}
    trainer.update()
    # the optimizer step's temporaries do not depend on the shape: stepped at the smallest knot only, where
    # the least of the batch is still live (a fifth of each update's fake-tensor ops saved elsewhere)
    smallest = min(shapes, key=lambda bs: bs[0] * bs[1])

    def update(b: int, s: int) -> Run:
        with contextlib.nullcontext() if (b, s) == smallest else _without_step(trainer):
            return _update_at(trainer, b, s)

    return {shape: run.figures() for shape, run in at_shapes(update, shapes).items()}  # trace/lengths.py


@contextlib.contextmanager
def _without_step(trainer: FakeTrainer):
    """An update with the optimizer step and the schedule left out (zero_grad still frees the gradients);
    the scheduler's own wrapper around ``optimizer.step`` is put back after."""
    skip = lambda *a, **k: None  # noqa: E731
    saved = [(obj, obj.__dict__.get("step")) for obj in (trainer.optimizer, trainer.scheduler)]
    for obj, _ in saved:
        obj.step = skip
    try:
        yield
    finally:
        for obj, step in saved:
            if step is None:
                del obj.step
            else:
                obj.step = step


def _forward_at(trainer: FakeTrainer, b: int, s: int) -> tuple[int, int]:
    """(bytes the forward leaves for backward, autocast copies among them), as ``_update_at`` counts them."""
    tracker = tracker_for(trainer)
    listener = _KeptBytes(tracker)
    with tracker:  # the batch made in the data phase, as the harness makes it: the tokens a forward keeps are data
        batch = trainer.workload.make_batch(trainer.generator, b, s, trainer.device)
        listener.mark("forward")
        with trainer._autocast():
            loss = trainer.workload.loss_sum(trainer.model, *batch)
        listener.mark("backward")
        del loss
    return listener.kept, listener.copies


# knots past the fitted shapes, up to the model's max_positions: fake tensors cost the same at any length, and a
# phase's high point is a maximum of events whose leader changes with s (the loss's logits, then attention's s²)
LONG_KNOTS = (512, 768, 1024, 1536, 2048, 3072, 4096)


def _knots(cfg: RunConfig, windowed: bool) -> list[tuple[int, int]]:
    """Where the phases' high points are measured: the fitted shapes' sequences, below them short ones (where
    weight gradients rather than activation gradients set backward's), above them long ones."""
    fitted = sorted({s for _, s in _shapes(cfg, windowed)})
    w, top = cfg.model.sliding_window, cfg.model.max_positions
    in_regime = lambda s: windowed or not w or s < w  # noqa: E731 — one code path: at or past the window, or below
    short = [] if windowed else [s for s in (16, 64) if s < fitted[0] and in_regime(s)]
    # between the fitted lengths too: where the leader changes, interpolation is capped by the chord
    middle = [(a + b) // 2 for a, b in zip(fitted, fitted[1:])]
    long = [s for s in LONG_KNOTS if fitted[-1] < s <= top and in_regime(s)]
    return [(b, s) for b in (1, 2, 3) for s in sorted(short + fitted + middle + long)]


def _terms(cfg: RunConfig, period: int, precision: Precision, windowed: bool, policies: tuple[str, ...],
           known: Terms | None) -> tuple[Terms, int]:
    """The terms of ``policies`` (layer policies, ``MODES``) at one precision and regime; the fields no policy
    changes are ``known``'s when the regime has some traced already, else measured with the first policy."""
    shapes, knots = _shapes(cfg, windowed), _knots(cfg, windowed)
    s_values = tuple(sorted({s for _, s in knots}))
    fitted, residual, smallest = {}, 0, min(knots, key=lambda bs: bs[0] * bs[1])
    for name in policies:
        mode = AC_OF[name]
        at_one = _measure(cfg, period, precision, mode, shapes, full=False)
        # whole updates of 2P layers at the knots: the forward's, backward's and the optimizer's high points
        # are maxima over events (the loss, one block's working set, one weight's gradient), interpolated;
        # the fitted shapes are knots, so the kept bytes of 2P layers come from the same updates
        updates = _measure(cfg, 2 * period, precision, mode, knots, full=True)
        at_two = {k: (updates[k].kept, updates[k].copies) for k in shapes}  # as _forward_at gives them
        one, r1 = _fit({k: at_one[k][0] for k in shapes})
        two, r2 = _fit({k: at_two[k][0] for k in shapes})
        layer = _combine(two, one, Fraction(1, period), Fraction(-1, period))
        fitted[f"layer_{name}"] = layer
        fitted[f"outside_{name}"] = _combine(one, layer, 1, -period)  # per policy: a checkpointed block keeps its inputs
        for field in ("forward", "backward"):
            fitted[f"{field}_{name}"] = Knots(s_values, *(tuple(getattr(updates[(b, s)], field) for s in s_values)
                                                          for b in (1, 2, 3)))
        # shape- and policy-independent (the largest parameter's); what varies is the batch still live, counted apart
        fitted.setdefault("optimizer_temporaries", updates[smallest].optimizer)
        if mode == "none":  # the weight copies a whole layer keeps (a recomputed one keeps none)
            fitted.update(_copies(at_one, at_two, period))
        residual = max(residual, r1, r2)
    if known is not None:
        fitted.update(optimizer_temporaries=known.optimizer_temporaries, copies_layer=known.copies_layer,
                      copies_outside=known.copies_outside)
    elif "copies_layer" not in fitted:  # one forward of P and 2P layers without AC, at the smallest shape
        fitted.update(_copies(*(_measure(cfg, n, precision, "none", shapes[:1], full=False) for n in (period, 2 * period)),
                              period))
    return Terms(precision=precision.value, windowed=windowed, **fitted), residual


def _copies(at_one: dict, at_two: dict, period: int) -> dict[str, int]:
    """Autocast's weight copies a layer and the rest keep, from (kept, copies) at P and 2P layers without AC
    (they do not depend on the shape)."""
    c1, c2 = max(v[1] for v in at_one.values()), max(v[1] for v in at_two.values())
    return dict(copies_layer=(c2 - c1) // period, copies_outside=2 * c1 - c2)


def _combine(p: Poly, q: Poly, x, y) -> Poly:
    """x·p + y·q, coefficient by coefficient."""
    mix = lambda a, b: round(x * a + y * b)  # noqa: E731
    return Poly(*(mix(getattr(p, f), getattr(q, f)) for f in ("bs", "bss", "s1", "ss", "c")),
                tuple(mix(a, b) for a, b in zip(p.b1, q.b1)))


def _param_counts(cfg: RunConfig, period: int, device) -> dict[str, int]:
    """Exact parameter counts of the model's code: embeddings, one layer, the rest, the (untied) head."""
    trainer = FakeTrainer(cfg.replace(layers=period, ac="none", precision="fp32"), device)
    model, blocks = trainer.raw_model, trainer.workload.blocks
    unique = lambda params: {id(p.untyped_storage()): p.numel() for p in params}  # noqa: E731 — tied = once
    every = unique(model.parameters())
    in_layers = unique(blocks.parameters())
    emb_in = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding = unique(emb_in.parameters()) if emb_in is not None else {}
    for module in model.modules():  # learned position tables (GPT-2 wpe, OPT embed_positions)
        if isinstance(module, torch.nn.Embedding) and module is not emb_in and id(module.weight.untyped_storage()) not in in_layers:
            embedding.update(unique(module.parameters()))
    head = {k: v for k, v in (unique(emb_out.parameters()) if emb_out is not None else {}).items() if k not in embedding}
    final = sum(v for k, v in every.items() if k not in in_layers and k not in embedding and k not in head)
    stored = lambda bufs: {id(b.untyped_storage()): b.untyped_storage().nbytes() for b in bufs}  # noqa: E731
    buffers, layer_buffers = stored(model.buffers()), stored(blocks.buffers())
    return dict(embedding=sum(embedding.values()), per_layer=sum(in_layers.values()) // period, final=final,
                head=sum(head.values()), buffers_per_layer=sum(layer_buffers.values()) // period,
                buffers_outside=sum(v for k, v in buffers.items() if k not in layer_buffers))


def compute(cfg: RunConfig, base: LayerProfile | None = None, policies: Iterable[str] = ()) -> LayerProfile:
    """Trace and fit cfg's model (an hf: source) at cfg's precision and sequence regime (below or at the sliding
    window) for the layer policies cfg needs and ``policies`` (``MODES``) that ``base`` (the same model's
    profile) lacks there, merged into it; seconds, nothing allocated."""
    assert cfg.model_kind is ModelSource.HF, cfg.model_source
    start = time.perf_counter()
    device, _ = trace_device(cfg)
    period = base.period if base is not None else _period(cfg)
    windowed = cfg.model.sliding_window is not None and cfg.seq >= cfg.model.sliding_window
    precision = calculator.profiled_precision(cfg.precision)
    known = base.lookup(precision.value, cfg.seq) if base is not None else None
    todo = tuple(m for m in MODES if m in (set(policies) | calculator.needed(cfg)) - (known.policies if known else set()))
    if base is not None and not todo:
        return base
    cuda = emulates_cuda(cfg, device)  # a CUDA profile traced here: CUDA's kernel choices (trace/cuda_policy.py)
    with cuda_kernels() if cuda else contextlib.nullcontext(), eager_branches(), fake_mode():
        params = (dict(embedding=base.embedding, per_layer=base.per_layer, final=base.final, head=base.head,
                       buffers_per_layer=base.buffers_per_layer, buffers_outside=base.buffers_outside)
                  if base is not None else _param_counts(cfg, period, device))
        terms, residual = _terms(cfg, period, precision, windowed, todo, known)
    lengths = sorted({s for _, s in _knots(cfg, False)})
    kernels = "cpu with CUDA's kernel choices" if cuda else device.type
    source = (f"trace of {period} and {2 * period} blocks at {len(_shapes(cfg, False))} shapes on {kernels}, "
              f"high points at {len(lengths)} lengths to seq {lengths[-1]}"
              + (f", fit residual {residual} B" if residual else ""))
    log = (f"{precision.value}{' at s >= window' if windowed else ''} {'+'.join(todo)}: "
           f"{time.perf_counter() - start:.1f} s")
    new = LayerProfile(key=cache.profile_key(cfg), shape=cfg.model.shape_id(), source=source, period=period,
                       sliding_window=cfg.model.sliding_window, terms=(terms,), seconds=log, **params)
    return base.merged(new) if base is not None else new


def with_profile(cfg: RunConfig, policies: Iterable[str] | None = None) -> RunConfig:
    """cfg with its model's layer profile attached, covering cfg's precision and regime for the layer policies
    cfg needs and ``policies`` (``MODES``; e.g. every policy a --vary ac=... evaluates): from the cache, the
    policies it lacks traced now and cached with the rest.  Other model sources are returned unchanged (the
    builtin GPT's terms are the calculator's own)."""
    if cfg.model_kind is not ModelSource.HF:
        return cfg
    cfg = cache.attach_cached(cfg)
    todo = calculator.missing(cfg, policies)
    if not todo:
        return cfg
    # the layer terms are eager PyTorch's (the formula's): traced without --compile; and one process's, as the
    # profile's key says (the copies of P and 2P layers it traces split into no pipeline; the formula cuts stages)
    one = cfg.replace(compile="none", pp=1, pp_virtual=1, pp_schedule=RunConfig().pp_schedule)
    profile = compute(one, base=cfg.model.matching_profile, policies=todo)
    latest = cache.cached(cfg)  # another process may have added policies meanwhile: keep them
    if latest is not None and latest.key == profile.key and latest != cfg.model.matching_profile:
        profile = latest.merged(profile)
    cache.save(profile)
    return cfg.replace(model=cfg.model.with_profile(profile))
