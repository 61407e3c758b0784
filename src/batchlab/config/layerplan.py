"""A per-layer activation-checkpointing plan: one policy per layer, as ``--ac plan:...`` spells it.

Inline form: ``plan:`` then comma-separated items ``POLICY`` or ``POLICY*N`` (N consecutive layers), from the
first layer up, e.g. ``plan:full*2,selective*4,none*2`` for 8 layers; the items must cover every layer.
File form: ``plan:FILE`` (a ``.json`` or ``.toml`` file, as ``batchlab fit --ac auto`` writes it) whose
``per_layer`` is a list with one policy per layer, or a table {layer index: policy} (layers not named: none)
beside ``layers = N``; a file with no per_layer takes its ``ac`` (a policy such as full, over ``layers``).
POLICY is one of ``LAYER_POLICIES`` (aliases as ``--ac`` takes them).  Pure Python; the layer count is
checked against the model by RunConfig.

Which form: the text after ``plan:`` is a file when it ends in ``.json`` or ``.toml`` or holds a path
separator (``/``; ``./plan`` names a file without a suffix), and an inline plan otherwise; a policy never
holds a dot or a slash, so no spelling is both, and a file of the working directory never shadows a plan.
Every form is bounded: at most ``MAX_LAYERS`` layers; files as config/planfile.py reads them.
"""
from __future__ import annotations

import os
import re
from typing import Any

from batchlab.config import planfile
from batchlab.config.acpolicies import ACMode, aliases, layer_policies, no_recompute, whole_block
from batchlab.config.choices import ConfigError
from batchlab.config.planfile import MAX_LAYERS, shown

# what one layer may do: nothing recomputed, the whole block, or one of the selective policies inside it
LAYER_POLICIES = layer_policies()  # the catalogue's entries (config/acpolicies.py)
ALIASES = aliases()
FIELD = "ac"
_ITEM = re.compile(r"([a-z][a-z-]*)\s*(?:\*\s*([0-9]+))?")
INLINE_HELP = "plan:POLICY*N,... (e.g. plan:full*2,none*6) or plan:FILE.json|.toml"


def layer_policy(text: Any, where: str) -> ACMode:
    name = str(text).strip().lower()
    name = ALIASES.get(name, name)
    allowed = ", ".join(m.value for m in LAYER_POLICIES)
    try:
        mode = ACMode(name)
    except ValueError:
        raise ConfigError(FIELD, f"{where}: unknown layer policy {shown(text)}; allowed: {allowed}") from None
    if mode not in LAYER_POLICIES:
        raise ConfigError(FIELD, f"{where}: {shown(text)} is not a layer policy; allowed: {allowed}")
    return mode


def is_file(text: str) -> bool:
    """Whether the text after ``plan:`` names a file (the module's rule) rather than spelling a plan."""
    t = text.strip()
    return t.lower().endswith((".json", ".toml")) or "/" in t or os.sep in t or t.startswith("~")


def parse_inline(body: str) -> tuple[ACMode, ...]:
    """``none*2,full*6`` -> (NONE, NONE, FULL x 6)."""
    items = [t.strip() for t in body.split(",")]
    if not body.strip() or any(not t for t in items):
        raise ConfigError(FIELD, f"plan:{shown(body)} needs items POLICY or POLICY*N separated by commas: "
                                 f"{INLINE_HELP}")
    out: list[ACMode] = []
    for item in items:
        m = _ITEM.fullmatch(item.lower())
        if not m:
            raise ConfigError(FIELD, f"plan item {shown(item)} is not POLICY or POLICY*N (read as an inline "
                                     f"plan: {INLINE_HELP}; a file needs .json/.toml or a / in its path)")
        digits = m.group(2) or "1"
        n = int(digits) if len(digits) <= 7 else MAX_LAYERS + 1
        if not 1 <= n <= MAX_LAYERS or len(out) + n > MAX_LAYERS:
            raise ConfigError(FIELD, f"plan item {shown(item)}: a plan covers 1..{MAX_LAYERS:,} layers "
                                     "(N >= 1 in POLICY*N)")
        out += [layer_policy(m.group(1), f"plan item {shown(item)}")] * n
    return tuple(out)


def parse_file(path_text: str) -> tuple[ACMode, ...]:
    """A plan file's ``per_layer`` (a list, or a table {index: policy} beside ``layers``), or its ``ac``."""
    name = f"plan file {shown(path_text)}"
    data = planfile.read(path_text)
    per_layer = data.get("per_layer") if isinstance(data, dict) else None
    if isinstance(per_layer, list) and per_layer:
        return planfile.modes_of(per_layer, name, layer_policy)
    if isinstance(per_layer, dict) and per_layer:
        return _from_table(per_layer, planfile.layer_count(data.get("layers"), name), name)
    if isinstance(data, dict) and not per_layer and isinstance(data.get("ac"), str) and "layers" in data:
        return _from_ac(data["ac"], planfile.layer_count(data["layers"], name), name)
    raise ConfigError(FIELD, f"{name} needs per_layer: a list of policies, one per layer, or a table "
                             "{layer index: policy} with layers = N")


def _from_table(table: dict, layers: int, name: str) -> tuple[ACMode, ...]:
    out = [no_recompute()] * layers
    for key, p in table.items():
        if not re.fullmatch(r"[0-9]{1,7}", str(key)) or int(key) >= layers:
            raise ConfigError(FIELD, f"{name} names layer {shown(key)}; the model has layers 0..{layers - 1}")
        out[int(key)] = layer_policy(planfile.policy_text(p, f"{name} layer {key}"), f"{name} layer {key}")
    return tuple(out)


def _from_ac(text: str, layers: int, name: str) -> tuple[ACMode, ...]:
    """A file whose pick was a preset (``ac = "full"``, ``every:2``): that policy over its layers."""
    if text.strip().lower().startswith("plan:"):
        raise ConfigError(FIELD, f"{name}: ac {shown(text)} is a plan; give it as per_layer")
    m = re.fullmatch(r"(?:every|selective-layer):([0-9]{1,7})", text.strip().lower())
    if m and int(m.group(1)) >= 1:  # as ACPolicy.layer_modes: the first layer of every K recomputed
        return tuple(whole_block() if i % int(m.group(1)) == 0 else no_recompute() for i in range(layers))
    return (layer_policy(text, f"{name}: ac"),) * layers


def parse(body: str, original: str) -> tuple[ACMode, ...]:
    """The text after ``plan:`` (``original``: as typed, so a file name keeps its case)."""
    raw = original.strip()[len("plan:"):].strip()
    return parse_file(raw) if is_file(raw) else parse_inline(body)


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


def use(path: str | os.PathLike) -> str:
    """The ``--ac`` value that reads the plan file at ``path`` back (``./`` added where the rule needs it)."""
    text = str(path)
    return f"plan:{text}" if is_file(text) else f"plan:./{text}"
