"""Checks and parsers for single user-typed values: whole numbers, sizes, files.  Pure Python."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable, TypeVar

from batchlab.config.choices import ConfigError

T = TypeVar("T")

INT64_MAX = 2**63 - 1  # SQLite integers, torch int64: the largest whole number batchlab stores or passes on
SEED_MAX = 2**64 - 1  # torch.manual_seed accepts [−2^63, 2^64)
SIZE_MAX = 10**7  # model dimensions and batch counts: far above any real model, and loops over layers stay short


def flag(name: str, value: Any) -> None:
    """True or false, else ConfigError naming the field (a TOML string "yes" is not a flag)."""
    if not isinstance(value, bool):
        raise ConfigError(name, f"must be true or false, got {value!r}")


def whole_number(name: str, value: Any, *, allow_zero: bool = False, maximum: int = INT64_MAX) -> None:
    """A whole number > 0 (or >= 0 with ``allow_zero``) and <= ``maximum``, else ConfigError naming the field."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be a whole number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(name, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    if value > maximum:
        raise ConfigError(name, f"must be <= {maximum:,}, got {_short(value)}")


def finite_number(name: str, value: Any, *, minimum: float | None = None, positive: bool = False,
                  maximum: float | None = None) -> float:
    """A finite real number (not bool, NaN or ±inf), > 0 with ``positive``, within [minimum, maximum]; as float.
    Strings are parsed (``"1e12"``); anything else is a ConfigError naming the field."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ConfigError(name, f"must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(name, f"must be a number, got {value!r}")
    try:
        v = float(value)
    except OverflowError:
        raise ConfigError(name, f"must be a finite number, got {_short(value)}") from None
    if not math.isfinite(v):
        raise ConfigError(name, f"must be a finite number, got {value!r}")
    if positive and v <= 0:
        raise ConfigError(name, f"must be > 0, got {value!r}")
    if minimum is not None and v < minimum:
        raise ConfigError(name, f"must be >= {minimum:g}, got {value!r}")
    if maximum is not None and v > maximum:
        raise ConfigError(name, f"must be <= {maximum:g}, got {value!r}")
    return v


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:8]}...({len(text)} digits)"


def parse_bytes(field_name: str, text: Any) -> int:
    """'2GiB', '512MiB', '80GB', '1e9' -> bytes (> 0, at most INT64_MAX)."""
    if isinstance(text, int) and not isinstance(text, bool):
        whole_number(field_name, text)
        return text
    bad = f"{text!r} is not a size (examples: 2GiB, 512MiB, 80GB)"
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*", str(text)) if isinstance(text, (str, float)) else None
    if not m:
        raise ConfigError(field_name, bad)
    units = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    try:
        number = float(m.group(1))
    except ValueError:
        raise ConfigError(field_name, bad) from None
    if not math.isfinite(number) or number * units[m.group(2)] > INT64_MAX:
        raise ConfigError(field_name, f"{text!r} is beyond any device's memory (at most {INT64_MAX:,} bytes)")
    size = int(number * units[m.group(2)])
    if size <= 0:
        raise ConfigError(field_name, f"{text!r} must be more than 0 bytes")
    return size


FILE_MAX_BYTES = 64 << 20  # a config, an experiment, a config.json or a notebook export is far smaller


def read_text(field_name: str, path: Path, name: str, limit: int = FILE_MAX_BYTES, missing: str | None = None,
              too_large: str = "", give: str = "a file") -> str:
    """The text of ``path`` (``name`` in messages): a regular file, opened without blocking (a fifo or a device is
    refused, not waited on), of at most ``limit`` bytes, UTF-8; anything else one ConfigError on ``field_name``.
    ``missing``: the whole message for a file that is not there; ``too_large`` and ``give`` end the others."""
    import os
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(field_name, missing or f"no such file: {name}") from None
    except OSError as e:  # a symlink loop, a name too long, no permission
        raise ConfigError(field_name, f"{name}: cannot open it: {e.strerror or e}") from None
    except ValueError:  # a NUL byte in the name
        raise ConfigError(field_name, f"{name}: a path cannot hold a NUL character") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a device, fifo or socket)"
            raise ConfigError(field_name, f"{name} is {kind}; give {give}")
        chunks, got = [], 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise ConfigError(field_name, f"{name}: cannot read it: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if got > limit:
        raise ConfigError(field_name, f"{name} is larger than {limit >> 20} MiB" + (f"; {too_large}" if too_large else ""))
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(field_name, f"{name} is not UTF-8 text (byte {e.start})") from None


def read_file(field_name: str, path: str | Path, parse: Callable[[str], T], kind: str) -> T:
    """``parse(text of path)`` (``read_text``: a regular UTF-8 file within ``FILE_MAX_BYTES``); a missing,
    unreadable or malformed file is a ConfigError on ``field_name``.  ``kind`` names the format for the
    message (JSON, TOML); JSON and TOML decode errors are ValueErrors."""
    p = Path(path)
    text = read_text(field_name, p, str(p), give=f"{kind} in a regular file")
    try:
        return parse(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, TOMLDecodeError, too many digits or levels
        raise ConfigError(field_name, f"cannot read {p} as {kind}: {str(e).splitlines()[0][:200]}") from None
