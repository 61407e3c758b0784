"""What the per-op time model (formula/opcost.py) needs, measured on the local device: matmul FLOP/s by call
size (fp32, bf16; linear layers, attention's batched matmuls, fused attention), element-wise bandwidth by
size, per-element kernels, and the fixed cost per op.

``batchlab calibrate`` measures it in about 20 s (a 10 s budget spread over 3 rounds, plus fixed costs) and
caches it per device, torch version and thread count under platformdirs' user cache dir; the formula and the
trace then price their ops with it for that device instead of nominal figures, and say so
(``Calibration.source``).  measure and compare calibrate this CPU
once automatically (``auto``), only the parts their configs need (calibration.SCOPES: 16-bit kernels, selective
checkpointing's dispatch, local ranks' contention and link are measured when a config uses them).

    from batchlab.calibrate import load_all, load_cached
    cal = load_cached("cpu", threads=1)   # a batchlab device name (RunConfig.device), or None
    cal.op_costs()                        # formula.opcost.OpCosts; cal.source says how it was obtained
    estimate(cfg, load_all())             # the caller reads the cache; formula.estimate stays a pure function

Importing this package does not import torch (callers of the formula read the cache); measuring does.
The record is formula/calibration.py, its cache batchlab.cache.calibrations; kernels.py, dispatch.py: what is timed; family.py: a Hugging Face model's own
dispatch per op, measured once per model code; run.py: measure, ensure, auto.
"""
from __future__ import annotations

from typing import Any

from batchlab.cache.calibrations import cache_dir, default_threads, load_all, load_cached, probe_reference, save
from batchlab.formula.calibration import Calibration

# what measures, imported on first use: the calculator's callers read the cache only (``batchlab estimate``)
_LAZY = {"timed_rates": "batchlab.calibrate.kernels", "auto": "batchlab.calibrate.run",
         "ensure": "batchlab.calibrate.run", "measure": "batchlab.calibrate.run"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'batchlab.calibrate' has no attribute {name!r}")

__all__ = ["Calibration", "auto", "cache_dir", "default_threads", "ensure", "load_all", "load_cached", "measure",
           "probe_reference", "save", "timed_rates"]
