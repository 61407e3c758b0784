"""The measuring side: run a config for real and record peak memory (``allocator``) and update time
(``wall-clock``), or an ``oom`` / ``failed`` outcome.

    from batchlab.run import measure          # the entry: one process, or torchrun for DP > 1
    m = measure(cfg, MeasureOptions(steps=5, isolate=True))   # isolate: a fresh subprocess (see runner.py)

Importing this package does not import torch (results load anywhere); ``observe`` does.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchlab.measure.options import MeasureOptions
from batchlab.measure.result import (MeasuredMemory, MeasuredTime, Measurement, Outcome, load_measurement,
                                     measurement_from_dict, measurement_to_dict, measurement_to_json)

if TYPE_CHECKING:
    from batchlab.measure.observe import observe

__all__ = ["MeasureOptions", "MeasuredMemory", "MeasuredTime", "Measurement", "Outcome", "load_measurement",
           "measurement_from_dict", "measurement_to_dict", "measurement_to_json", "observe"]

_LAZY = {"observe": "batchlab.measure.observe"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'batchlab.measure' has no attribute {name!r}")
