"""The single variable of an experiment: ``FIELD=A:B`` parsed, both sides built, derived changes listed.

Field names are RunConfig.replace's (CHANGEABLE_FIELDS in config.py).  Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchlab.config import CHANGEABLE_FIELDS, ConfigError, RunConfig, keep_global_batch
from batchlab.config import Keep as KeepMode  # one enum; experiments call it keep mode
from batchlab.config import parse_field_value, to_jsonable


@dataclass(frozen=True)
class Change:
    field: str
    a: Any
    b: Any

    def __str__(self) -> str:
        return f"{self.field} {_show(self.a)} -> {_show(self.b)}"


def _show(value: Any) -> str:
    return str(to_jsonable(value))


def parse_change(text: str, base: RunConfig) -> Change:
    """``FIELD=A:B`` (``A->B`` also works).  Values may hold a colon (``ac=none:every:2``): the split that
    gives two valid configs wins."""
    name, sep, values = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not name or not values:
        raise ConfigError("change", f"{text!r} is not FIELD=A:B (example: micro_batch=1:2, ac=none:full)")
    if name not in CHANGEABLE_FIELDS:
        raise ConfigError(name, f"unknown field; known: {', '.join(CHANGEABLE_FIELDS)}")
    if "->" in values:
        candidates = [tuple(values.split("->", 1))]
    else:
        parts = values.split(":")
        candidates = [(":".join(parts[:i]), ":".join(parts[i:])) for i in range(1, len(parts))]
    if not candidates:
        raise ConfigError("change", f"{text!r} needs two values A:B (example: {name}=1:2)")
    error: ConfigError | None = None
    for a_text, b_text in candidates:
        try:
            a, b = parse_field_value(name, a_text), parse_field_value(name, b_text)
            base.replace(**{name: a})
            base.replace(**{name: b})
            return Change(name, a, b)
        except ConfigError as e:
            error = error or e
        except (TypeError, ValueError) as e:
            error = error or ConfigError(name, str(e))
    assert error is not None
    raise error


def change_from_values(name: str, a: Any, b: Any) -> Change:
    """A change given as two values (experiment files): converted like command-line text."""
    name = str(name).strip().replace("-", "_")
    return Change(name, parse_field_value(name, a), parse_field_value(name, b))


@dataclass(frozen=True)
class Sides:
    a: RunConfig
    b: RunConfig
    changes: tuple[Change, ...]
    keep: KeepMode
    derived: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # changed fields nobody asked for
    warnings: tuple[str, ...] = ()

    @property
    def confounded(self) -> bool:
        return len(self.changes) > 1

    @property
    def variable(self) -> str:
        text = ", ".join(str(c) for c in self.changes)
        if self.derived:
            text += " (derived: " + ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, (a, b) in self.derived.items()) + ")"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"requested": [{"field": c.field, "a": to_jsonable(c.a), "b": to_jsonable(c.b)} for c in self.changes],
                "derived": {k: [to_jsonable(a), to_jsonable(b)] for k, (a, b) in self.derived.items()},
                "confounded": self.confounded, "variable": self.variable,
                "global_batch": {"a": self.a.global_batch, "b": self.b.global_batch},
                "global_batch_text": {"a": self.a.global_batch_text(), "b": self.b.global_batch_text()}}


def build_sides(base: RunConfig, changes: list[Change], keep: KeepMode = KeepMode.GLOBAL_BATCH,
                allow_confounded: bool = False) -> Sides:
    """Side A and side B of the experiment; raises ConfigError for anything that is not one clean change."""
    if not changes:
        raise ConfigError("change", "nothing to compare: give one change, e.g. --change micro_batch=1:2")
    names = [c.field for c in changes]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError("change", f"{twice[0]} is changed more than once")
    if len(changes) > 1 and not allow_confounded:
        raise ConfigError("change", f"{len(changes)} independent changes ({', '.join(names)}) confound the result: "
                                    "change one field, or pass --allow-confounded")
    for c in changes:
        if not base.replace(**{c.field: c.a}).diff(base.replace(**{c.field: c.b})):
            raise ConfigError(c.field, f"the same value ({_show(c.a)}) on both sides; a comparison needs two "
                                       "different values")
    keep = KeepMode.parse("keep", keep)
    sides = []
    for label, pick in (("A", lambda c: c.a), ("B", lambda c: c.b)):
        cfg = base.replace(**{c.field: pick(c) for c in changes})
        sides.append(_keep(base, cfg, names, keep, label))
    a, b = sides
    derived = {k: v for k, v in a.diff(b).items() if k not in names}
    return Sides(a, b, tuple(changes), keep, derived, tuple(_warnings(a, b, keep)))


def _keep(base: RunConfig, cfg: RunConfig, names: list[str], keep: KeepMode, label: str) -> RunConfig:
    if keep is KeepMode.ACCUM:
        return cfg
    try:
        return keep_global_batch(base, cfg, names)
    except ConfigError as e:
        raise ConfigError(e.field, f"side {label} ({', '.join(f'{n}={_show(getattr_any(cfg, n))}' for n in names)}), "
                                   f"global batch kept at {base.global_batch}: {e.message}") from None


def getattr_any(cfg: RunConfig, name: str) -> Any:
    if hasattr(cfg, name):
        return getattr(cfg, name)
    if hasattr(cfg.model, name):
        return getattr(cfg.model, name)
    return getattr(cfg.assumptions, name)


def _warnings(a: RunConfig, b: RunConfig, keep: KeepMode) -> list[str]:
    out = []
    if a.global_batch != b.global_batch:
        out.append(f"the global batch changes {a.global_batch} -> {b.global_batch} sequences"
                   + (" (--keep accum)" if keep is KeepMode.ACCUM else "")
                   + ": learning rate, warmup and schedule length (in updates) tuned for one may not suit the "
                     "other")
    elif a.tokens_per_update != b.tokens_per_update:
        out.append(f"tokens per update change {a.tokens_per_update:,} -> {b.tokens_per_update:,} (sequence "
                   "length): compare time to a token budget rather than update time")
    return out
