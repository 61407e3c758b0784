"""Short names of where a figure's inputs come from, for default terminal output.  The full citations (URLs,
issue numbers, derivations) stay in the assumptions, shown under --verbose and kept in --json and the report."""
from __future__ import annotations

from batchlab.config.fp8 import FP8Recipe
from batchlab.config import RunConfig
from batchlab.config.devices import short_sources
from batchlab.formula.efficiency import achievable_fraction
from batchlab.util.units import fmt_bytes, fmt_count


def time_model_label(cfg: RunConfig, ceiling_source: str) -> str:
    """'calibrated on this device' or 'nominal, 0.52 of peak (published H100 runs)'."""
    if ceiling_source.startswith("calibrated"):
        return "calibrated on this device"
    frac = achievable_fraction(cfg)
    return f"nominal, {frac.value:.2f} of peak ({frac.short})"


def device_line(cfg: RunConfig, ceiling_source: str, label: str = "sources") -> str:
    """One line: the device's capacity and peak with short source names, and the time model's kind."""
    dev = cfg.device_spec
    rates, memory = short_sources(dev)
    capacity = (f"{fmt_bytes(cfg.memory_budget)} --memory-budget" if cfg.memory_budget is not None
                else f"{fmt_bytes(dev.memory_bytes)} {memory}")
    fp8 = (f", FP8 GEMMs {fmt_count(dev.peak_flops_fp8, 'FLOP/s')} {(dev.fp8_source or 'unsourced').split(':')[0]}"
           if cfg.fp8 is not FP8Recipe.NONE else "")  # --fp8: the linear layers' rate (formula/fp8.py)
    return (f"{label}: {capacity}, {fmt_count(dev.peak_flops(cfg.precision), 'FLOP/s')} {rates}{fp8}; "
            f"time model: {time_model_label(cfg, ceiling_source)}")
