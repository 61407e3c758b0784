"""The calculator's side of a layer profile: the terms for one config, from the profile its model carries.

A profile (``config/profile.py``) is computed by the torch side (``trace/profile.py``) from the model's own
code and cached as JSON (batchlab.cache.profiles, which the callers read; no file is read here), so the
calculator, ``--vary`` and ``fit`` use the model's real layer terms at the cost of a dictionary lookup.
"""
from __future__ import annotations

from collections.abc import Iterable

from batchlab.config import ModelSource, Precision, RunConfig
from batchlab.config.profile import Terms

# fp16 autocast keeps the same tensors as bf16 autocast (2-byte activations, fp32 master weights)
_SAME_BYTES = {Precision.FP16_MIXED: Precision.BF16_MIXED}


PROFILED_PRECISIONS = (Precision.FP32, Precision.BF16_MIXED, Precision.BF16)  # the trainer's own precisions


def profiled_precision(p: Precision) -> Precision:
    """The precision whose profile terms describe p (fp16 and bf16 autocast keep the same bytes)."""
    return _SAME_BYTES.get(p, p)


def layer_policies(cfg: RunConfig) -> tuple[str, ...]:
    """Each layer's policy under cfg's AC, as a layer profile names it (``config.profile.MODES``)."""
    return tuple(m.spec.profile_term or "selective" for m in cfg.ac.layer_modes(cfg.model.layers))


def profiled(cfg: RunConfig) -> bool:
    """Profiles measure the layer policies none, full and selective (every:K and plans mix them)."""
    # the policies whose per-layer bytes a profile holds: their catalogue entries name a profile term
    return all(m.spec.profile_term is not None for m in cfg.ac.layer_modes(cfg.model.layers))


def needed(cfg: RunConfig) -> frozenset[str]:
    """The layer policies whose terms cfg's estimate reads (formula/memory.py): each layer's, and under FSDP2
    (DP > 1, ZeRO >= 2) the whole layer's too, which its recompute working set is measured from."""
    if not profiled(cfg):
        return frozenset()
    return frozenset(layer_policies(cfg)) | ({"full"} if cfg.parallel.shards_gradients else set())


def _lookup(cfg: RunConfig) -> Terms | None:
    p = cfg.model.matching_profile
    return None if p is None else p.lookup(profiled_precision(cfg.precision).value, cfg.seq)


def terms(cfg: RunConfig) -> Terms | None:
    """The profile's terms for cfg's precision and sequence regime, if cfg's model carries a matching profile
    that has traced every layer policy cfg needs (profiles measure none, full and selective; every:K mixes
    the first two)."""
    from batchlab.formula import compiled  # the profile traces eager code: compiled layers have terms of their own

    if compiled.applies(cfg):
        return None
    t, used = _lookup(cfg), needed(cfg)
    return t if t is not None and used and used <= t.policies else None


def missing(cfg: RunConfig, policies: Iterable[str] | None = None) -> frozenset[str]:
    """The layer policies cfg needs and ``policies`` that cfg's profile lacks at cfg's precision and regime; none
    for a model that is not hf: or a precision profiles do not measure."""
    if cfg.model_kind is not ModelSource.HF or profiled_precision(cfg.precision) not in PROFILED_PRECISIONS:
        return frozenset()
    t = _lookup(cfg)
    wanted = needed(cfg) if policies is None else frozenset(policies) | needed(cfg)
    return wanted - (t.policies if t is not None else frozenset())


def layer_terms_source(cfg: RunConfig, builtin: str) -> str:
    """Where the calculator's layer terms come from, for the estimate's output."""
    p, t = cfg.model.matching_profile, _lookup(cfg)
    if p is not None and terms(cfg) is not None:
        return f"profile ({p.source}, cached)"
    if p is not None and not profiled(cfg):
        return f"builtin {builtin} (profiles measure AC none, full, every:K and selective layers, not {cfg.ac})"
    if p is not None and t is not None:
        return (f"builtin {builtin} (the profile has no {', '.join(sorted(needed(cfg) - t.policies))} layer terms for "
                f"--ac {cfg.ac} here yet; rerun with it to trace them)")
    if p is not None:
        return f"builtin {builtin} (the profile has no {cfg.precision} terms here yet; rerun with it to trace them)"
    if cfg.model.profile is not None:
        return f"builtin {builtin} (the profile was made for another shape; rerun to profile this one)"
    return f"builtin {builtin}"
