"""The measuring side: run a config for real and record peak memory (``allocator``) and update time
(``wall-clock``), or an ``oom`` / ``failed`` outcome.

    from batchlab.run import measure          # the entry: one process, or torchrun for DP > 1
    m = measure(cfg, MeasureOptions(steps=5, isolate=True))   # isolate: a fresh subprocess (see runner.py)

Importing this package does not import torch (results load anywhere).  Your own training loop is observed by
``batchlab.observe`` (integrations/observe.py).
"""
from __future__ import annotations

from batchlab.measure.options import MeasureOptions
from batchlab.measure.result import (MeasuredMemory, MeasuredTime, Measurement, Outcome, load_measurement,
                                     measurement_from_dict, measurement_to_dict, measurement_to_json)

__all__ = ["MeasureOptions", "MeasuredMemory", "MeasuredTime", "Measurement", "Outcome", "load_measurement",
           "measurement_from_dict", "measurement_to_dict", "measurement_to_json"]
