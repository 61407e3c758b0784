"""The layer-profile cache: one JSON file per model code, shape, torch and transformers versions and backend,
under platformdirs' user cache dir.  Read by the calculator's callers, who attach the profile to the config
(formula/profile.py reads the terms from the config, never a file).  Torch-free."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from batchlab.config import ModelSource, RunConfig, to_jsonable
from batchlab.config.hf import hf_config_path
from batchlab.config.profile import LayerProfile
from batchlab.formula.profile import terms
from batchlab.util.files import write_atomic

PROFILE_VERSION = 18  # bump when what a profile measures changes: old cache entries are then ignored


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
