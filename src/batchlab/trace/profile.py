"""Derive a model's layer terms from its own code: trace copies with P and 2P layers at small shapes.

For each precision and activation-checkpointing mode, the bytes one forward leaves for backward are
measured on fake tensors (the CPU measurement's StorageTracker, nothing allocated) at micro-batch 1 and 2
and three sequence lengths, and fitted exactly as ``bs·b·s + bss·b·s² + s1·s + ss·s² + c`` (config/profile.py);
the difference between P and 2P layers is P layers' share, the rest is the embeddings, final norm, head
and loss.  P is the period of the layer pattern (``layer_types``: gemma2 alternates sliding and global).
A model with a sliding window gets a second set of terms fitted at s >= window (another code path).
"""
from __future__ import annotations

import time
from fractions import Fraction

import torch

from batchlab.config import ACPolicy, ModelSource, Precision, RunConfig
from batchlab.config.profile import LayerProfile, Poly, Terms
from batchlab.formula import profile as cache
from batchlab.measure.harness import Trainer
from batchlab.measure.memory import tracker_for
from batchlab.trace.patches import eager_branches
from batchlab.trace.run import _fake_mode, trace_device

MODES = {"layer_full": "none", "layer_selective": "selective", "layer_checkpointed": "full"}


def _period(cfg: RunConfig) -> int:
    """Smallest P with layer_types[i] == layer_types[i % P] (1 without a pattern)."""
    from batchlab.models.hf import hf_config

    types = list(getattr(hf_config(cfg), "layer_types", None) or [])
    return next((p for p in range(1, len(types) + 1) if all(t == types[i % p] for i, t in enumerate(types))), 1)


def _kept_bytes(trainer: Trainer, b: int, s: int) -> int:
    """Bytes the forward creates and leaves for backward, autocast's weight copies excluded (the calculator
    counts those with the parameters)."""
    batch = trainer.workload.make_batch(trainer.generator, b, s, trainer.device)
    tracker = tracker_for(trainer)
    with tracker:
        tracker.mark("forward")
        with trainer._autocast():
            loss = trainer.workload.loss_sum(trainer.model, *batch)
        tracker.mark("backward")
        # the tracker's own bookkeeping: storages created since the forward began, with their category
        kept = sum(n for k, (n, cat) in tracker._live.items()
                   if k not in tracker._forward_start_keys and cat != "parameters")
        del loss
    return kept


def _fit(points: dict[tuple[int, int], int]) -> tuple[Poly, int]:
    """Exact fit of f(b, s) = bs·b·s + bss·b·s² + s1·s + ss·s² + c over b in {1, 2} and three s; returns the
    polynomial and the largest residual over the points (0 for transformer blocks)."""
    s_values = sorted({s for _, s in points})
    per_b = {s: Fraction(points[(2, s)] - points[(1, s)]) for s in s_values}  # bs·s + bss·s²
    s1, s2 = s_values[0], s_values[1]
    bss = (per_b[s2] / s2 - per_b[s1] / s1) / (s2 - s1)
    bs = per_b[s1] / s1 - bss * s1
    rest = [(s, Fraction(points[(1, s)]) - per_b[s]) for s in s_values]  # s1·s + ss·s² + c: a parabola
    (x0, y0), (x1, y1), (x2, y2) = rest
    ss = ((y2 - y0) / (x2 - x0) - (y1 - y0) / (x1 - x0)) / (x2 - x1)
    lin = (y1 - y0) / (x1 - x0) - ss * (x1 + x0)
    c = y0 - lin * x0 - ss * x0 * x0
    poly = Poly(*(round(v) for v in (bs, bss, lin, ss, c)))
    return poly, max(abs(poly(b, s) - v) for (b, s), v in points.items())


def _shapes(cfg: RunConfig, windowed: bool) -> list[tuple[int, int]]:
    w = cfg.model.sliding_window
    step = max(1, min(16, (w - 1) // 3)) if w and not windowed else 16
    start = w if windowed else step
    return [(b, start + i * step) for b in (1, 2) for i in range(3)]


def _measure(cfg: RunConfig, layers: int, precision: Precision, mode: str, shapes, device) -> dict:
    trainer = Trainer(cfg.replace(layers=layers, precision=precision, ac=ACPolicy.parse(mode), seq=shapes[0][1],
                                  micro_batch=1, accum=1, dp=1, zero=0), device)
    return {shape: _kept_bytes(trainer, *shape) for shape in shapes}


def _terms(cfg: RunConfig, period: int, precision: Precision, windowed: bool, device) -> tuple[Terms, int]:
    shapes = _shapes(cfg, windowed)
    fitted, residual = {}, 0
    outside = None
    for name, mode in MODES.items():
        one, r1 = _fit(_measure(cfg, period, precision, mode, shapes, device))
        two, r2 = _fit(_measure(cfg, 2 * period, precision, mode, shapes, device))
        layer = Poly(*(round(Fraction(b - a, period)) for a, b in zip(_coeffs(one), _coeffs(two))))
        fitted[name] = layer
        if mode == "none":  # embeddings, final norm, head and loss: what P layers do not explain
            outside = Poly(*(a - period * l for a, l in zip(_coeffs(one), _coeffs(layer))))
        residual = max(residual, r1, r2)
    return Terms(precision=precision.value, windowed=windowed, outside=outside, **fitted), residual


def _coeffs(p: Poly) -> tuple[int, ...]:
    return p.bs, p.bss, p.s1, p.ss, p.c


def _param_counts(cfg: RunConfig, period: int, device) -> dict[str, int]:
    """Exact parameter counts of the model's code: embeddings, one layer, the rest, the (untied) head."""
    trainer = Trainer(cfg.replace(layers=period, ac="none", precision="fp32"), device)
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
    return dict(embedding=sum(embedding.values()), per_layer=sum(in_layers.values()) // period, final=final,
                head=sum(head.values()))


def compute(cfg: RunConfig) -> LayerProfile:
    """Trace and fit cfg's model (an hf: source); a few seconds, nothing allocated."""
    assert cfg.model_kind is ModelSource.HF, cfg.model_source
    start = time.perf_counter()
    device, _ = trace_device(cfg)
    period = _period(cfg)
    regimes = (False, True) if cfg.model.sliding_window else (False,)
    with eager_branches(), _fake_mode():
        params = _param_counts(cfg, period, device)
        fitted = [_terms(cfg, period, p, w, device) for p in cache.PROFILED_PRECISIONS for w in regimes]
    residual = max(r for _, r in fitted)
    blocks = f"{period} and {2 * period} blocks"
    source = (f"trace of {blocks} at {len(_shapes(cfg, False))} shapes on {device.type}"
              + (f", fit residual {residual} B" if residual else "") + f", {time.perf_counter() - start:.1f} s")
    return LayerProfile(key=cache.profile_key(cfg), shape=cfg.model.shape_id(), source=source, period=period,
                        sliding_window=cfg.model.sliding_window, terms=tuple(t for t, _ in fitted), **params)


def with_profile(cfg: RunConfig) -> RunConfig:
    """cfg with its model's layer profile attached: from the cache, else computed now and cached.
    Other model sources are returned unchanged (the builtin GPT's terms are the calculator's own)."""
    if cfg.model_kind is not ModelSource.HF:
        return cfg
    cfg = cache.attach_cached(cfg)
    if cfg.model.matching_profile is not None:
        return cfg
    profile = compute(cfg)
    cache.save(profile)
    return cfg.replace(model=cfg.model.with_profile(profile))
