"""Experiment files: one TOML file holds the baseline, the single change, the keep mode and the prediction.

    keep = "global-batch"          # or "accum"
    predict = { memory = "up", time = "same" }
    rounds = 3                     # optional: rounds, steps, warmup, token_budget, note, allow_confounded

    [config]                       # the baseline: RunConfig field names, model = "preset", and global_batch
                                   # (accum derived from it; micro_batch 1 unless given)
    model = "tiny"
    seq = 128
    global_batch = 8

    [change]                       # exactly one field (more are refused unless allow_confounded = true)
    micro_batch = [1, 2]

A relative plan file (ac = "plan:FILE") is found beside the experiment file.

In TOML, keys after a [table] header belong to that table; the top-level keys above are also accepted
there (none of them is a config field), so their order in the file does not matter.

The file's [config] is applied on top of the command-line config; on the command line, explicit
--keep / --predict / --rounds / --steps / --warmup / --token-budget / --note win over the file's.  Torch-free.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchlab.config import ConfigError, RunConfig, config_from_table, read_file, whole_number
from batchlab.config.planfile import relative_to
from batchlab.config.values import SIZE_MAX
from batchlab.experiment.change import Change, KeepMode, change_from_values, parse_change
from batchlab.experiment.predict import Direction, Metric, parse_predictions, predictions_from_mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TOP_LEVEL = ("config", "change", "keep", "predict", "rounds", "steps", "warmup", "token_budget", "note",
             "allow_confounded")


@dataclass
class ExperimentFile:
    base: RunConfig
    changes: list[Change]
    keep: KeepMode | None = None
    predictions: dict[Metric, Direction] | None = None
    options: dict[str, Any] = field(default_factory=dict)  # rounds, steps, warmup, token_budget, note, allow_confounded


def load(path: str | Path, base: RunConfig) -> ExperimentFile:
    p = Path(path)
    with relative_to(p.parent):  # plan:FILE in [config] or [change]: FILE beside the experiment file
        return _load(p, base)


def _load(p: Path, base: RunConfig) -> ExperimentFile:
    data = read_file("experiment", p, tomllib.loads, "TOML")
    data = _hoist(data)
    unknown = [k for k in data if k not in TOP_LEVEL]
    if unknown:
        raise ConfigError("experiment", f"unknown key {unknown[0]!r} in {p}; allowed: {', '.join(TOP_LEVEL)}")
    cfg = apply_config(base, data.get("config", {}))
    if "change" not in data:
        raise ConfigError("experiment", f"{p} has no [change] table (example: micro_batch = [1, 2])")
    changes = parse_changes(data["change"], cfg)
    keep = KeepMode.parse("keep", data["keep"]) if "keep" in data else None
    predict = data.get("predict")
    predictions = None
    if isinstance(predict, dict):
        predictions = predictions_from_mapping(predict)
    elif isinstance(predict, str):
        predictions = parse_predictions(predict)
    elif predict is not None:
        raise ConfigError("predict", "must be a table (predict = { memory = \"up\" }) or a string")
    options = {k: data[k] for k in OPTION_TYPES if k in data}
    check_options(options)
    return ExperimentFile(cfg, changes, keep, predictions, options)


# The file's own options and their TOML types: checked here, before anything is stored (a note = 5 saved
# would break every later `notebook show`; allow_confounded = "no" would count as true).
OPTION_TYPES = {"rounds": int, "steps": int, "warmup": int, "token_budget": int, "note": str, "allow_confounded": bool}
_TOML_TYPE = {int: "a whole number", str: "a string in quotes", bool: "true or false (a TOML boolean, no quotes)"}


def check_options(options: dict[str, Any]) -> None:
    for key, value in options.items():
        kind = OPTION_TYPES[key]
        if type(value) is not kind:  # exact: a TOML true is not a whole number
            raise ConfigError(key, f"must be {_TOML_TYPE[kind]} in the experiment file, got {value!r}")
        if kind is int:
            whole_number(key, value, allow_zero=key == "warmup", maximum=SIZE_MAX * 10**6)


def _hoist(data: dict[str, Any]) -> dict[str, Any]:
    """Top-level keys written below a [config] or [change] header move back to the top level."""
    out = dict(data)
    for table in ("config", "change"):
        if isinstance(out.get(table), dict):
            inner = dict(out[table])
            for key in TOP_LEVEL:
                if key in inner and key not in ("config", "change"):
                    if key in out:
                        raise ConfigError("experiment", f"{key} is given twice (top level and in [{table}])")
                    out[key] = inner.pop(key)
            out[table] = inner
    return out


def apply_config(base: RunConfig, table: Any) -> RunConfig:
    return config_from_table(table, base)


def parse_changes(table: Any, base: RunConfig) -> list[Change]:
    """``[change] field = [A, B]`` entries, or ``change = "field=A:B"`` (a string or a list of them)."""
    if isinstance(table, str):
        return [parse_change(table, base)]
    if isinstance(table, list) and all(isinstance(t, str) for t in table):
        return [parse_change(t, base) for t in table]
    if not isinstance(table, dict):
        raise ConfigError("change", "must be a table like micro_batch = [1, 2]")
    out = []
    for name, pair in table.items():
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ConfigError("change", f"{name} must be [A, B], got {pair!r}")
        change = change_from_values(name, *pair)
        base.replace(**{change.field: change.a})
        base.replace(**{change.field: change.b})
        out.append(change)
    return out
