"""The calculator's side of a layer profile: where it is cached, its key, and the terms for one config.

A profile (``config/profile.py``) is computed by the torch side (``trace/profile.py``) from the model's own
code and cached as JSON under platformdirs' user cache dir; this module only reads it (no torch), so the
calculator, ``--vary`` and ``fit`` use the model's real layer terms at the cost of a dictionary lookup.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from batchlab.config import ModelSource, Precision, RunConfig, to_jsonable
from batchlab.config.hf import hf_config_path
from batchlab.config.profile import LayerProfile, Terms
from batchlab.util.files import write_atomic

PROFILE_VERSION = 17  # bump when what a profile measures changes: old cache entries are then ignored
# fp16 autocast keeps the same tensors as bf16 autocast (2-byte activations, fp32 master weights)
_SAME_BYTES = {Precision.FP16_MIXED: Precision.BF16_MIXED}


PROFILED_PRECISIONS = (Precision.FP32, Precision.BF16_MIXED, Precision.BF16)  # the trainer's own precisions


def profiled_precision(p: Precision) -> Precision:
    """The precision whose profile terms describe p (fp16 and bf16 autocast keep the same bytes)."""
    return _SAME_BYTES.get(p, p)


def cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("batchlab")) / "profiles"


def _version(package: str) -> str:
    from importlib import metadata  # only when a profile is keyed: `batchlab estimate` does not import it

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def profile_key(cfg: RunConfig) -> str:
    """Hash of what the profile depends on: the HF config's contents, the shape (all but the layer count),
    the torch and transformers versions, and the backend (CUDA and CPU kernels keep different tensors)."""
    target = cfg.model_source[len("hf:"):]
    path = hf_config_path(target)
    source = path.read_text() if path.is_file() else target
    parts = dict(v=PROFILE_VERSION, source=source, shape=cfg.model.shape_id(), torch=_version("torch"),
                 transformers=_version("transformers"), backend=cfg.device_spec.backend.value, loss=str(cfg.loss))
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def cached(cfg: RunConfig) -> LayerProfile | None:
    """The cached profile for cfg's model, or None (never computed, or made by other versions)."""
    if cfg.model_kind is not ModelSource.HF:
        return None
    path = cache_dir() / f"{profile_key(cfg)}.json"
    try:
        return LayerProfile.from_dict(json.loads(path.read_text()))
    except Exception:  # noqa: BLE001 — an unreadable or malformed cache entry is a miss, recomputed
        return None


def save(profile: LayerProfile) -> Path:
    path = cache_dir() / f"{profile.key}.json"
    write_atomic(path, json.dumps(to_jsonable(profile), indent=1), "profile")  # two writers at once: no half file
    return path


def attach_cached(cfg: RunConfig) -> RunConfig:
    """cfg with its model's cached profile attached, when there is one (else cfg unchanged); a profile cfg
    carries already (from a notebook record, a subprocess) keeps what it has and gains what the cache adds."""
    if cfg.model.matching_profile is not None and terms(cfg) is not None:
        return cfg
    p, mine = cached(cfg), cfg.model.matching_profile
    if p is None:
        return cfg
    if mine is not None and mine.key == p.key and mine != p:
        p = mine.merged(p)
    return cfg.replace(model=cfg.model.with_profile(p))


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
