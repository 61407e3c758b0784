"""Measured figures beside the calculator's formula estimate for the same config.  Torch-free.

relative difference = (measured - formula) / formula: +10% means the run took 10% more than predicted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchlab.config import RunConfig
from batchlab.measure.result import Measurement
from batchlab.util.units import relative_to


@dataclass
class FigureRow:
    figure: str
    unit: str  # bytes | seconds | tokens/s | phase
    measured: float | str | None
    measured_provenance: str
    formula: float | str | None = None
    formula_provenance: str = "formula"

    @property
    def relative_difference(self) -> float | None:
        """(measured - formula) / formula."""
        return relative_to(self.measured, self.formula)

    def to_dict(self) -> dict[str, Any]:
        return {"figure": self.figure, "unit": self.unit, "measured": self.measured,
                "measured_provenance": self.measured_provenance, "formula": self.formula,
                "formula_provenance": self.formula_provenance, "relative_difference": self.relative_difference}


def formula_estimate(cfg: RunConfig):
    """(Estimate or None, why there is none)."""
    from batchlab.cache.calibrations import load_all
    from batchlab.formula import compiled_note, estimate, unseen_model

    if unseen_model(cfg):
        return None, f"no formula estimate: {unseen_model(cfg)}"
    try:
        return estimate(cfg, load_all()), compiled_note(cfg)
    except Exception as e:  # noqa: BLE001 — the comparison is an aid; the measurement stands on its own
        return None, f"no formula estimate: {type(e).__name__}: {e}"


def rows(m: Measurement, est=None) -> list[FigureRow]:
    """One row per measured figure, with the formula's value where it has one."""
    out: list[FigureRow] = []
    fm, ft = (est.memory, est.time) if est is not None else (None, None)

    def of(part, name: str):
        return getattr(part, name) if part is not None else None

    if m.memory is not None:
        prov = m.memory.provenance
        # allocated tensor bytes beside the formula's tensor bytes (its peak_bytes adds an allocator margin)
        out += [FigureRow("peak memory", "bytes", m.memory.peak_bytes, prov, of(fm, "peak_tensor_bytes")),
                FigureRow("activations", "bytes", m.memory.activations_bytes, prov,
                          of(fm, "activations_bytes")),
                FigureRow("peak phase", "phase", m.memory.peak_phase, prov, of(fm, "peak_phase"))]
        if m.memory.reserved_bytes is not None:
            out.append(FigureRow("reserved (caching allocator)", "bytes", m.memory.reserved_bytes, prov))
    if m.time is not None and m.time.samples:
        prov = m.time.provenance
        out.append(FigureRow("update time (median)", "seconds", m.time.update_seconds_median, prov,
                             of(ft, "update_seconds")))
        speed = probed_speed(m)
        if speed is not None and ft is not None:  # rates calibrated at one speed price another in proportion
            out.append(FigureRow(f"update time at the probed host speed (formula x{speed:.2f})", "seconds",
                                 m.time.update_seconds_median, prov, ft.update_seconds * speed))
        out.append(FigureRow("update time IQR", "seconds", m.time.update_seconds_iqr, prov))
        if m.tokens_per_second is not None:
            out.append(FigureRow(f"useful {m.counted.per_second}", m.counted.per_second, m.tokens_per_second, prov,
                                 of(ft, "tokens_per_second")))
        if est is not None:  # the formula's FLOPs over the measured time: fractions, shown as percentages
            from batchlab.formula.flops import utilisation

            seconds = m.time.update_seconds_median
            out += [FigureRow("MFU", "fraction", utilisation(est.flops.model_flops_per_update, seconds, est.config),
                              prov, est.mfu),
                    FigureRow("HFU", "fraction", utilisation(est.flops.hardware_flops_per_update, seconds, est.config),
                              prov, est.hfu)]
    return out


def broken_time_model(figures: list[FigureRow]) -> str | None:
    """The warning that the time model is broken where its update time and the measured one differ by more than
    ``plausible.BROKEN`` either way (a poisoned calibration, not a slow run); None otherwise."""
    from batchlab.formula.plausible import ratio_text

    row = next((r for r in figures if r.figure == "update time (median)"), None)
    if row is None or not isinstance(row.formula, float) or not isinstance(row.measured, float):
        return None
    return ratio_text(row.formula, row.measured)


def probed_speed(m: Measurement) -> float | None:
    """How fast the host ran during ``m``'s timed updates against its calibration at the same thread count
    (host/speed.py: the probe's median read over the calibration's; 1.2: 20% slower); None where either
    side has no probe, or the calibration timed another bundle."""
    from batchlab.cache.calibrations import probe_reference
    from batchlab import host

    if m.time is None or not m.time.probe_seconds:
        return None
    return host.speed_factor(m.time.probe_seconds, probe_reference(m.environment.get("threads")))
