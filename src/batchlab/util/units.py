"""Display-only formatting: bytes, seconds, rates, FLOPs (internal figures stay bytes and seconds)."""
from __future__ import annotations

import math

# Relative change under which two figures are called the same ("≈"): one band for --vary arrows, the formula's
# predicted directions in compare, and the measured memory verdict (CPU tracked bytes are deterministic).
SAME_TOLERANCE = 0.01


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


# SI prefixes up to zetta; beyond them scientific notation with the bare unit (one rule for every count)
_PREFIXES = (("Z", 1e21), ("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def fmt_count(x: float | None, unit: str = "") -> str:
    """1.23e12 -> '1.23 T' (+unit); 2.02e18 FLOP -> '2.02 EFLOP'; past zetta '1.2e+24 FLOP'.  The one SI
    formatter: counts, rates (FLOP/s, B/s) and decimal byte totals alike; None or a non-finite value is '-'."""
    if x is None or not math.isfinite(x):
        return "-"
    if abs(x) >= 1000 * _PREFIXES[0][1]:
        return f"{x:.3g} {unit}".rstrip()
    for suffix, size in _PREFIXES:
        if abs(x) >= size:
            return f"{x / size:.3g} {suffix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


_WORDS = (("trillion", 1e12), ("billion", 1e9), ("million", 1e6), ("thousand", 1e3))


def fmt_amount(x: float, noun: str) -> str:
    """A count of things in words: 1e12 tokens -> '1 trillion tokens' (a prefix on a noun reads badly:
    'Ttokens'); past a thousand trillion, scientific ('1e+15 tokens')."""
    if abs(x) >= 1000 * _WORDS[0][1]:
        return f"{x:.3g} {noun}"
    for word, size in _WORDS:
        if abs(x) >= size:
            return f"{x / size:.3g} {word} {noun}"
    return plural(x, noun.removesuffix("s")) if noun.endswith("s") else f"{x:.3g} {noun}"


def plural(n: float, word: str) -> str:
    """'1 thread', '2 threads'."""
    return f"{n:g} {word}" + ("" if n == 1 else "s")


def fmt_value(v, unit: str) -> str:
    """A figure by its unit: bytes, seconds, tokens/s, samples/s (few a second for an image model, so a
    decimal); anything else as text."""
    if v is None:
        return "-"
    if unit == "bytes":
        return fmt_bytes(v)
    if unit == "seconds":
        return fmt_seconds(v)
    if unit == "tokens/s":
        return f"{v:,.0f}"
    if unit == "samples/s":
        return f"{v:,.1f}"
    if unit == "fraction":  # stored as a fraction (JSON), shown as a percentage
        return fmt_percent(v)
    return str(v)


def fmt_percent(fraction: float | None) -> str:
    """A fraction (MFU 0.42) as a percentage ('42.0%'); figures stay fractions everywhere but on screen."""
    if fraction is None:
        return "-"
    return f"{fraction:.1%}" if abs(fraction) >= 0.001 else f"{fraction * 100:.2g}%"


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
