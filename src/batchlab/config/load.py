"""Configs from what users write: typed field values (--change / --vary / TOML), dicts (subprocesses,
the notebook), TOML ``[config]`` tables, Hugging Face ``config.json`` files and ``--model`` values.  Pure Python."""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from batchlab.config import planfile
from batchlab.config.choices import Choice, ConfigError
from batchlab.config.hf import hf_config_path, is_family, read_hf_config, spec_fields
from batchlab.config.model import PRESETS, ModelSpec, preset
from batchlab.config.run import CHANGEABLE_FIELDS, RUN_FIELDS, ACPolicy, Assumptions, RunConfig
from batchlab.config.values import parse_bytes, read_file


def config_from_dict(d: dict[str, Any]) -> RunConfig:
    """Inverse of ``to_dict`` (used by subprocess runners, TOML experiment files and the notebook)."""
    d = dict(d)
    d.update(_layout(d.pop("parallel", None), d))
    model = d.pop("model", None)
    if isinstance(model, dict):
        model = ModelSpec(**model)
    elif isinstance(model, str):
        model = preset(model)
    assumptions = d.pop("assumptions", None)
    if isinstance(assumptions, dict):
        assumptions = Assumptions(**assumptions)
    unknown = [k for k in d if k not in RUN_FIELDS]
    if unknown:
        raise ConfigError(unknown[0], f"unknown field; known: {', '.join(RUN_FIELDS)}")
    kw: dict[str, Any] = dict(d)
    if model is not None:
        kw["model"] = model
    if assumptions is not None:
        kw["assumptions"] = assumptions
    return RunConfig(**kw)


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


@functools.lru_cache(maxsize=1)
def _field_hints() -> dict[str, Any]:
    import typing

    hints: dict[str, Any] = {}
    for cls in (Assumptions, ModelSpec, RunConfig):
        hints.update(typing.get_type_hints(cls))
    return hints


def parse_field_value(name: str, text: Any) -> Any:
    """A --change/--vary/TOML value typed for its field (``micro_batch`` '4' -> 4, ``kv_heads`` 'none' ->
    None); enums and policies are parsed by the config itself."""
    import typing

    if name not in CHANGEABLE_FIELDS:
        raise ConfigError(name, f"unknown field; known: {', '.join(CHANGEABLE_FIELDS)}")
    if not isinstance(text, str):
        return text  # TOML already typed it
    text = text.strip()
    args = typing.get_args(_field_hints()[name]) or (_field_hints()[name],)
    base = next(a for a in args if a is not type(None))
    if type(None) in args and text.lower() == "none":
        return None
    if name == "memory_budget":
        return parse_bytes(name, text)
    if name == "ac":  # now, while a plan file's path is taken from the file that names it
        return ACPolicy.parse(text)
    if isinstance(base, type) and issubclass(base, Choice):  # a closed set: a value outside it is a user error
        return base.parse(name, text)
    if base is bool:
        if text.lower() not in _TRUE | _FALSE:
            raise ConfigError(name, f"{text!r} is not true or false")
        return text.lower() in _TRUE
    for kind, word in ((int, "a whole number"), (float, "a number")):
        if base is kind:
            try:
                return kind(text)
            except ValueError:
                raise ConfigError(name, f"{text!r} is not {word}") from None
    return text


def _layout(table: Any, flat: dict[str, Any]) -> dict[str, Any]:
    """The fields a ``parallel`` table (what to_jsonable writes beside the flat degrees) gives; the flat fields
    win where both name one, and must agree."""
    from batchlab.config.parallel import fields_from_table

    if table is None:
        return {}
    out = fields_from_table(table, flat)
    for k, v in out.items():
        if k in flat and flat[k] != v and k != "sharding":  # the table's engine is derived where sharding is None
            raise ConfigError(k, f"{flat[k]!r} here, {v!r} in the parallel table")
    return {k: v for k, v in out.items() if k not in flat}


def model_from_hf_config(path: str | Path, field_name: str = "hf_config", **overrides: Any) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (or a directory holding one; any model_type) from disk; no network,
    no transformers.  Overrides (layers, hidden, ...) replace what the file says."""
    raw = read_hf_config(path, field_name)
    values = spec_fields(raw, str(hf_config_path(path)), field_name)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ModelSpec(name=f"hf:{path}", **values)


HF_FAMILIES = {"llama": "llama-2-7b", "gpt2": "gpt2"}


def _is_hf_file(target: str) -> bool:
    return target.endswith(".json") or hf_config_path(target).is_file()


def hf_raw(target: str) -> dict[str, Any] | None:
    """What ``hf:TARGET`` (``model_source`` less its prefix) builds from: a config.json's fields, or
    transformers' defaults for a bare model_type; None for a batchlab preset (hf:gpt2, hf:llama-2-7b)."""
    target = HF_FAMILIES.get(target, target)
    if _is_hf_file(target) or (target not in PRESETS and is_family(target)):
        return read_hf_config(target)
    return None


def _unknown_hf(target: str) -> ConfigError:
    return ConfigError("model", f"hf:{target} is neither a config.json, a directory holding one, a batchlab preset "
                                f"({', '.join(PRESETS)}) nor a model_type transformers knows (hf:mistral, hf:qwen2, "
                                "...; those need transformers: pip install 'batchlab[hf]')")


def resolve_model(arg: str, **overrides: Any) -> tuple[ModelSpec, str]:
    """``--model``'s value -> (shape for the calculator, model_source for the harness).

    ``hf:FILE_OR_DIR`` (a config.json or a directory holding one, any model_type), ``hf:NAME`` (a batchlab
    preset built with transformers' GPT-2 or Llama classes), ``hf:MODEL_TYPE`` (transformers' default config of
    that family), a preset, or ``package.module:factory``.
    """
    if not isinstance(arg, str) or not arg.strip():
        raise ConfigError("model", "must be a preset name, hf:NAME_OR_CONFIG.json or package.module:factory")
    arg = arg.strip()
    if arg.startswith("hf:"):
        target = HF_FAMILIES.get(arg[3:], arg[3:])
        if _is_hf_file(target):
            return model_from_hf_config(target, "model", **overrides), arg
        if target in PRESETS:
            return preset(target, **overrides), arg
        if is_family(target):  # hf:mistral: transformers' default config of that model_type
            return model_from_hf_config(target, "model", **overrides), arg
        raise _unknown_hf(target)
    if ":" in arg:  # package.module:factory — the calculator cannot see inside it; the shape is a stand-in
        if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", arg):
            raise ConfigError("model", f"{arg!r} is not package.module:factory (Python names, e.g. mypkg.models:build)")
        return preset("tiny", **overrides), arg
    return preset(arg, **overrides), "builtin"


def config_from_table(table: Any, base: RunConfig | None = None) -> RunConfig:
    """A TOML ``[config]`` table (what ``batchlab fit`` writes, what experiment files hold) on top of ``base``.

    RunConfig field names; ``model`` is a preset name, ``hf:...``/``package.module:factory``, or a
    ``[config.model]`` table of ModelSpec fields; model and assumption fields may also be given flat;
    ``global_batch`` re-derives accum.
    """
    if not isinstance(table, dict):
        raise ConfigError("config", "must be a table of RunConfig fields")
    values = dict(table)
    cfg = base or RunConfig()
    model = values.pop("model", None)
    if isinstance(model, dict):
        try:
            cfg = cfg.replace(model=ModelSpec(**model))
        except TypeError as e:
            raise ConfigError("model", f"[config.model]: {e}") from None
    elif model is not None:
        spec, source = resolve_model(model)
        cfg = cfg.replace(model=spec, model_source=source)
    assumptions = values.pop("assumptions", None)
    if isinstance(assumptions, dict):
        values.update(assumptions)
    values.update(_layout(values.pop("parallel", None), values))
    global_batch = values.pop("global_batch", None)
    unknown = [k for k in values if k not in CHANGEABLE_FIELDS and k not in ("model_source",)]
    if unknown:
        raise ConfigError(unknown[0], f"unknown field; known: model, global_batch, {', '.join(CHANGEABLE_FIELDS)}")
    try:
        cfg = cfg.replace(**values)
    except TypeError as e:
        raise ConfigError("config", str(e)) from None
    if global_batch is not None:  # as --global-batch: the micro-batch is the table's, else 1
        cfg = cfg.with_global_batch(global_batch, micro_batch=values.get("micro_batch", 1))
    return cfg


def load_config_toml(path: str | Path, base: RunConfig | None = None) -> RunConfig:
    """The ``[config]`` table of a TOML file (as ``batchlab fit`` writes it) as a RunConfig."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    p = Path(path)
    raw = read_file("config", p, tomllib.loads, "TOML")
    if not isinstance(raw.get("config"), dict):
        raise ConfigError("config", f"{p} has no [config] table")
    with planfile.relative_to(p.parent):  # ac = "plan:FILE": FILE beside this file
        return config_from_table(raw["config"], base)
