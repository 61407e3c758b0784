"""Reading a plan file (``--ac plan:FILE``) within limits: a regular file of at most ``MAX_BYTES``, UTF-8,
JSON or TOML nested at most ``MAX_DEPTH`` deep, JSON without repeated keys, at most ``MAX_LAYERS`` layers
in every form.  Whatever the file holds, the answer is its plan or one ConfigError on ``ac``.

A relative path is taken from the working directory, or from the directory of the file that names it (a
``--config`` TOML file, an experiment file: ``relative_to``).  Pure Python.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import re
from pathlib import Path
from typing import Any, Iterator

from batchlab.config.acpolicies import ACMode
from batchlab.config.choices import ConfigError
from batchlab.config.values import read_text

FIELD = "ac"
MAX_LAYERS = 100_000  # far above any trained model; bounds every loop over a plan's layers
MAX_BYTES = 8 << 20  # a 100,000-layer per_layer list written one policy a line is about 2.4 MB
MAX_DEPTH = 16  # fit writes 3 levels

_BASE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("plan_base", default=None)
_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'[^\'\n]*\'')


@contextlib.contextmanager
def relative_to(directory: str | Path) -> Iterator[None]:
    """Within it, relative plan paths are taken from ``directory`` (that of the file naming them)."""
    token = _BASE.set(Path(directory))
    try:
        yield
    finally:
        _BASE.reset(token)


def shown(text: Any, limit: int = 60) -> str:
    """``repr(text)``, clipped: a message stays one readable line whatever was typed."""
    if isinstance(text, int) and not isinstance(text, bool) and abs(text) >= 10**12:
        return f"a number of {len(str(abs(text))) if text.bit_length() < 10_000 else 'thousands of'} digits"
    r = repr(text)
    return r if len(r) <= limit else f"{r[:limit - 12]}...({len(r):,} chars)"


def read(path_text: str) -> Any:
    """The parsed content (JSON or TOML by the suffix; JSON otherwise) of a plan file."""
    name = f"plan file {shown(path_text)}"
    text = _text(_path(path_text, name), name)
    if _depth(text) > MAX_DEPTH:
        raise ConfigError(FIELD, f"{name} is nested more than {MAX_DEPTH} levels deep; a plan file is "
                                 "{\"per_layer\": [POLICY, ...]}")
    toml = path_text.strip().lower().endswith(".toml")
    try:
        if toml:
            import tomllib

            return tomllib.loads(text)
        return json.loads(text, object_pairs_hook=_no_repeats)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, TOMLDecodeError, too many digits
        raise ConfigError(FIELD, f"{name} is not valid {'TOML' if toml else 'JSON'}: "
                                 f"{str(e).splitlines()[0][:120]}") from None


def _path(path_text: str, name: str) -> Path:
    try:
        path = Path(path_text).expanduser()
    except RuntimeError:  # ~user of no such user, or no home directory
        raise ConfigError(FIELD, f"{name}: cannot expand '~' (no such user or no home directory)") from None
    base = _BASE.get()
    return base / path if base is not None and not path.is_absolute() else path


def _text(path: Path, name: str) -> str:
    return read_text(FIELD, path, name, MAX_BYTES,
                     missing=f"{name} not found{_where(path)} (read as a file because it ends in .json or .toml or has "
                             "a / in it; an inline plan is plan:POLICY*N,...)",
                     too_large=f"a plan file of {MAX_LAYERS:,} layers is smaller", give="a .json or .toml file")


def _where(path: Path) -> str:
    base = _BASE.get()
    return f" (relative to {base})" if base is not None and not Path(path).is_absolute() else ""


def _depth(text: str) -> int:
    """The deepest nesting of [ ] and { } outside strings (JSON's and TOML's)."""
    depth = deepest = 0
    for m in re.finditer(r"[\[\]{}]", _STRING.sub("", text)):
        depth = depth + 1 if m.group() in "[{" else max(depth - 1, 0)
        deepest = max(deepest, depth)
    return deepest


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {shown(key)} is given twice")
        out[key] = value
    return out


def layer_count(value: Any, name: str) -> int:
    """A plan's ``layers``: a whole number 1..MAX_LAYERS."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LAYERS:
        raise ConfigError(FIELD, f"{name}: layers must be a whole number 1..{MAX_LAYERS:,} (the model's count), "
                                 f"got {shown(value)}")
    return value


def policy_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(FIELD, f"{where}: a policy is a string such as \"full\", got {shown(value)}")
    return value


def modes_of(values: list, name: str, parse_one) -> tuple[ACMode, ...]:
    """A per_layer list's policies, each checked by ``parse_one(text, where)``."""
    if len(values) > MAX_LAYERS:
        raise ConfigError(FIELD, f"{name} names {len(values):,} layers; at most {MAX_LAYERS:,}")
    return tuple(parse_one(policy_text(p, f"{name} layer {i}"), f"{name} layer {i}") for i, p in enumerate(values))
