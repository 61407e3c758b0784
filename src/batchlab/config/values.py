"""Checks and parsers for single user-typed values: whole numbers, sizes, files.  Pure Python."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, TypeVar

from batchlab.config.choices import ConfigError

T = TypeVar("T")


def whole_number(name: str, value: Any, *, allow_zero: bool = False) -> None:
    """A whole number > 0 (or >= 0 with ``allow_zero``), else ConfigError naming the field."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be a whole number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(name, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def parse_bytes(field_name: str, text: Any) -> int:
    """'2GiB', '512MiB', '80GB', '1e9' -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*", str(text))
    if not m:
        raise ConfigError(field_name, f"{text!r} is not a size (examples: 2GiB, 512MiB, 80GB)")
    units = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    try:
        return int(float(m.group(1)) * units[m.group(2)])
    except (ValueError, KeyError):
        raise ConfigError(field_name, f"{text!r} is not a size (examples: 2GiB, 512MiB, 80GB)") from None


def read_file(field_name: str, path: str | Path, parse: Callable[[str], T], kind: str) -> T:
    """``parse(text of path)``; a missing, unreadable or malformed file is a ConfigError on ``field_name``.
    ``kind`` names the format for the message (JSON, TOML); JSON and TOML decode errors are ValueErrors."""
    p = Path(path)
    try:
        return parse(p.read_text())
    except FileNotFoundError:
        raise ConfigError(field_name, f"no such file: {p}") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError, JSONDecodeError, TOMLDecodeError
        raise ConfigError(field_name, f"cannot read {p} as {kind}: {e}") from None
