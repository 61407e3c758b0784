"""A per-layer activation-checkpointing plan: one policy per layer, as ``--ac plan:...`` spells it.

Inline form: ``plan:`` then comma-separated items ``POLICY`` or ``POLICY*N`` (N consecutive layers), from the
first layer up, e.g. ``plan:full*2,selective*4,none*2`` for 8 layers; the items must cover every layer.
File form: ``plan:FILE`` (a ``.json`` or ``.toml`` file, as ``batchlab fit --ac auto`` writes it) whose
``per_layer`` is a list with one policy per layer, or a table {layer index: policy} (layers not named: none).
POLICY is one of ``LAYER_POLICIES`` (aliases as ``--ac`` takes them).  Pure Python; the layer count is
checked against the model by RunConfig.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from batchlab.config.choices import ACMode, ConfigError

# what one layer may do: nothing recomputed, the whole block, or one of the selective policies inside it
LAYER_POLICIES = (ACMode.NONE, ACMode.FULL, ACMode.SELECTIVE, ACMode.SELECTIVE_OP, ACMode.MEGATRON,
                  ACMode.SELECTIVE_ATTN)
ALIASES = {"op": "selective-op", "torchtitan-op": "selective-op", "megatron": "megatron-selective",
           "core-attn": "megatron-selective", "keep-attention": "selective-attn", "attn": "selective-attn"}
MAX_LAYERS = 100_000
FIELD = "ac"


def layer_policy(text: Any, where: str) -> ACMode:
    name = str(text).strip().lower()
    name = ALIASES.get(name, name)
    allowed = ", ".join(m.value for m in LAYER_POLICIES)
    try:
        mode = ACMode(name)
    except ValueError:
        raise ConfigError(FIELD, f"{where}: unknown layer policy {text!r}; allowed: {allowed}") from None
    if mode not in LAYER_POLICIES:
        raise ConfigError(FIELD, f"{where}: {text!r} is not a layer policy; allowed: {allowed}")
    return mode


def parse_inline(body: str) -> tuple[ACMode, ...]:
    """``none*2,full*6`` -> (NONE, NONE, FULL x 6)."""
    out: list[ACMode] = []
    items = [t.strip() for t in body.split(",")]
    if not body.strip() or any(not t for t in items):
        raise ConfigError(FIELD, f"plan:{body!r} needs items POLICY or POLICY*N separated by commas, "
                                 "e.g. plan:full*2,none*6")
    for item in items:
        m = re.fullmatch(r"([a-z-]+)\s*(?:\*\s*(\d+))?", item.lower())
        if not m:
            raise ConfigError(FIELD, f"plan item {item!r} is not POLICY or POLICY*N (e.g. full*2)")
        n = int(m.group(2) or 1)
        if not 1 <= n <= MAX_LAYERS or len(out) + n > MAX_LAYERS:
            raise ConfigError(FIELD, f"plan item {item!r}: N must be 1..{MAX_LAYERS}")
        out += [layer_policy(m.group(1), f"plan item {item!r}")] * n
    return tuple(out)


def parse_file(path_text: str, layers: int | None = None) -> tuple[ACMode, ...]:
    """A plan file's ``per_layer`` (a list, or a table {index: policy} needing ``layers``)."""
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ConfigError(FIELD, f"plan file {path_text!r} not found (plan:FILE.json|toml, or plan:POLICY*N,...)")
    try:
        if path.suffix.lower() == ".toml":
            import tomllib

            data = tomllib.loads(path.read_text())
        else:
            data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(FIELD, f"plan file {path_text!r} is not valid {path.suffix[1:] or 'JSON'}: "
                                 f"{str(e).splitlines()[0]}") from None
    per_layer = data.get("per_layer") if isinstance(data, dict) else None
    if isinstance(per_layer, list) and per_layer:
        return tuple(layer_policy(p, f"plan file layer {i}") for i, p in enumerate(per_layer))
    if isinstance(per_layer, dict) and per_layer:
        return _from_table(per_layer, data.get("layers", layers), path_text)
    raise ConfigError(FIELD, f"plan file {path_text!r} needs per_layer: a list of policies, one per layer, "
                             "or a table {layer index: policy}")


def _from_table(table: dict, layers: Any, path_text: str) -> tuple[ACMode, ...]:
    if not isinstance(layers, int) or layers < 1:
        raise ConfigError(FIELD, f"plan file {path_text!r}: a per_layer table needs layers = N (the model's count)")
    out = [ACMode.NONE] * layers
    for key, p in table.items():
        if not re.fullmatch(r"\d+", str(key)) or int(key) >= layers:
            raise ConfigError(FIELD, f"plan file {path_text!r} names layer {key!r}; the model has layers "
                                     f"0..{layers - 1}")
        out[int(key)] = layer_policy(p, f"plan file layer {key}")
    return tuple(out)


def parse(body: str, original: str) -> tuple[ACMode, ...]:
    """The text after ``plan:`` (``original``: as typed, so a file name keeps its case)."""
    raw = original.strip()[len("plan:"):].strip()
    if raw.lower().endswith((".json", ".toml")) or Path(raw).expanduser().is_file():
        return parse_file(raw)
    return parse_inline(body)


def runs(layers: tuple[ACMode, ...]) -> list[tuple[int, int, ACMode]]:
    """Consecutive layers under one policy: (first layer, count, policy), first layer first."""
    out: list[tuple[int, int, ACMode]] = []
    for i, mode in enumerate(layers):
        if out and out[-1][2] is mode:
            out[-1] = (out[-1][0], out[-1][1] + 1, mode)
        else:
            out.append((i, 1, mode))
    return out


def compact(layers: tuple[ACMode, ...]) -> str:
    """The inline spelling, runs merged: (NONE, NONE, FULL) -> ``none*2,full``."""
    return ",".join(mode.value + (f"*{n}" if n > 1 else "") for _, n, mode in runs(layers))
