"""Display-only formatting: bytes, seconds, rates, FLOPs (internal figures stay bytes and seconds)."""
from __future__ import annotations


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n:.0f} B"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 86400:
        return f"{s / 86400:.1f} d"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} µs"


def fmt_count(x: float | None, unit: str = "") -> str:
    """1.23e12 -> '1.23 T' (+unit)."""
    if x is None:
        return "-"
    for suffix, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.3g} {suffix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def fmt_value(v, unit: str) -> str:
    """A figure by its unit: bytes, seconds, tokens/s; anything else as text."""
    if v is None:
        return "-"
    if unit == "bytes":
        return fmt_bytes(v)
    if unit == "seconds":
        return fmt_seconds(v)
    if unit == "tokens/s":
        return f"{v:,.0f}"
    return str(v)


def relative_to(value, reference) -> float | None:
    """(value - reference) / reference for two numbers (None otherwise, or for a zero reference)."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, reference))
    return (value - reference) / reference if numbers and reference else None


def fmt_difference(relative: float | None, unit: str, value, reference) -> str:
    """A figure beside its reference in a table: ``+1.2%``, or ``same`` / ``differs`` for a phase name."""
    if relative is not None:
        return f"{relative:+.1%}"
    if unit == "phase" and reference is not None:
        return "same" if value == reference else "differs"
    return ""
