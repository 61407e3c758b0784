"""What a measured run does not express of a config (torch-free): the fields it runs past, said as a warning with
each measurement, and two configs whose measured runs would be the same run, which ``compare`` refuses before
anything runs (its measured verdict would judge the formula's difference against noise).

Run past: ``--tp-overlap`` (the measured ranks run DTensor's plain collectives, on every device), the formula's
stated assumptions (the measured run observes its own figures), DeepSpeed's ``zero_optimization`` sizes (no
DeepSpeed engine runs here), the catalogue card of ``--device`` beyond its backend (the run takes the local device
of that backend, or ``--torch-device``), and an implementation not installed here beyond the code that runs in its
place (config/standin.py).  Refused outright elsewhere (run.measure, distributed.measurable):
what the harness cannot run at all (FP8 GEMMs, activation offload, DeepSpeed's and Megatron's engines).
"""
from __future__ import annotations

import dataclasses
import re

from batchlab.config import ASSUMPTION_FIELDS, Assumptions, RunConfig
from batchlab.config.deepspeed import DeepSpeedSettings
from batchlab.config.engines import TPOverlap
from batchlab.config.standin import runs_as, stand_in_text

_DEFAULT_ASSUMPTIONS = Assumptions()


def ignored(cfg: RunConfig) -> dict[str, str]:
    """The fields ``cfg`` sets that a measured run runs past, by field: why."""
    out: dict[str, str] = {}
    if cfg.parallel.tp_overlap is not TPOverlap.NONE:
        out["tp_overlap"] = (f"{cfg.parallel.tp_overlap} is priced by the formula only: the measured ranks run each "
                             "TP collective in the critical path (torch's async TP needs CUDA symmetric memory under "
                             "torch.compile, which they do not run)")
    for name in ASSUMPTION_FIELDS:
        if getattr(cfg.assumptions, name) != getattr(_DEFAULT_ASSUMPTIONS, name):
            out[name] = ("an assumption of the formula's (its figures beside a measurement use it); the run observes "
                         "its own")
    if cfg.deepspeed != DeepSpeedSettings():
        out["deepspeed"] = ("DeepSpeed's zero_optimization sizes price DeepSpeed's buffers; no DeepSpeed engine runs "
                            "here")
    return out


def warnings(cfg: RunConfig) -> list[str]:
    """One line per field the measurement of ``cfg`` ran past."""
    return [f"ignored: {name}: {why}" for name, why in ignored(cfg).items()]


def _as_run(cfg: RunConfig) -> RunConfig:
    """``cfg`` as the code that measures it runs: what a measured run ignores put back to the defaults."""
    return dataclasses.replace(runs_as(cfg), assumptions=_DEFAULT_ASSUMPTIONS, deepspeed=DeepSpeedSettings(),
                               tp_overlap=TPOverlap.NONE)


_LOCAL = re.compile(r"(cpu|cuda|mps|xpu)(:\d+)?")  # a --torch-device worth naming before torch has checked it


def reasons(a: RunConfig, b: RunConfig, torch_device: str | None = None) -> dict[str, str]:
    """Why each field of the pair that a measured run expresses no differently differs only on the formula's side:
    the fields either side runs past, an implementation that runs as another's stand-in, and two catalogue cards
    measured on one local device (``torch_device``: the one both sides are measured on, where given)."""
    why = {**ignored(b), **ignored(a)}
    stand_in = stand_in_text(a) or stand_in_text(b)
    ra, rb = runs_as(a), runs_as(b)
    if stand_in and ra.model == rb.model and ra.model_source == rb.model_source:  # else the measured code changes
        why["impl"] = stand_in
    if a.device != b.device:
        local = {torch_device or c.device_spec.backend.value for c in (a, b)}
        if len(local) == 1 and _LOCAL.fullmatch(dev := local.pop()):
            why["device"] = (f"both sides are measured on this machine's {dev} (a device's name sets the "
                             "formula's card, not the hardware a measurement runs on)")
    return why


def same_run(a: RunConfig, b: RunConfig, torch_device: str | None = None) -> tuple[str, str] | None:
    """Where ``a`` and ``b`` differ only in what a measured run does not express: (the first such field, why);
    else None."""
    diff = a.diff(b)
    if not diff:
        return None
    why = reasons(a, b, torch_device)
    if a.device != b.device and "device" not in why:
        return None
    run = _as_run(a)
    if run.diff(_as_run(b)).keys() - {"device"}:
        return None
    field = next((n for n in diff if n in why), next(iter(diff)))
    return field, why.get(field, f"both sides run {run.model.impl.label} ({run.model_source}; config/standin.py)")
