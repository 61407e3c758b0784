"""The global-batch rules of a one-variable change: which field is re-derived so that
micro-batch x accum x DP stays the same, and applying a typed change to a config."""
from __future__ import annotations

from typing import Any

from batchlab.config.choices import ConfigError, Keep
from batchlab.config.load import parse_field_value
from batchlab.config.run import RunConfig


BATCH_FIELDS = ("micro_batch", "accum", "dp")


def keep_global_batch(base: RunConfig, cfg: RunConfig, names: list[str] | tuple[str, ...]) -> RunConfig:
    """cfg (base with ``names`` changed) brought back to base's global batch: a micro-batch or DP change
    re-derives accum, an accum change re-derives the micro-batch (the one place this rule lives)."""
    if not set(names) & set(BATCH_FIELDS):
        return cfg
    g = base.global_batch
    if "micro_batch" in names and "accum" in names:
        raise ConfigError("keep", "micro_batch and accum both change: the global batch cannot be kept by "
                                  "re-deriving one of them; use --keep accum")
    if "accum" in names:
        per = cfg.accum * cfg.dp
        if g % per:
            raise ConfigError("global_batch", f"{g} is not divisible by accum x DP = {cfg.accum} x {cfg.dp} = {per}")
        return cfg.replace(micro_batch=g // per)
    return cfg.with_global_batch(g)


def apply_change(cfg: RunConfig, name: str, value: Any, keep: Keep = Keep.GLOBAL_BATCH) -> RunConfig:
    """cfg with one field changed; with Keep.GLOBAL_BATCH the global batch is kept (keep_global_batch)."""
    new = cfg.replace(**{name: parse_field_value(name, value)})
    return keep_global_batch(cfg, new, [name]) if Keep.parse("keep", keep) is Keep.GLOBAL_BATCH else new
