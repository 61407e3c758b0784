"""What the per-op time model (formula/opcost.py) needs, measured on the local device: matmul FLOP/s by call
size (fp32, bf16; linear layers, attention's batched matmuls, fused attention), element-wise bandwidth by
size, per-element kernels, and the fixed cost per op.

``batchlab calibrate`` measures it in about 20 s (a 10 s budget spread over 3 rounds, plus fixed costs) and
caches it per device, torch version and thread count under platformdirs' user cache dir; the formula and the
trace then price their ops with it for that device instead of nominal figures, and say so
(``Calibration.source``).  measure and compare calibrate this CPU
once automatically (``auto``).

    from batchlab.calibrate import load_all, load_cached
    cal = load_cached("cpu", threads=1)   # a batchlab device name (RunConfig.device), or None
    cal.op_costs()                        # formula.opcost.OpCosts; cal.source says how it was obtained
    estimate(cfg, load_all())             # the caller reads the cache; formula.estimate stays a pure function

Importing this package does not import torch (callers of the formula read the cache); measuring does.
record.py: the record and its cache; kernels.py, dispatch.py: what is timed; family.py: a Hugging Face model's own
dispatch per op, measured once per model code; run.py: measure, ensure, auto.
"""
from __future__ import annotations

from batchlab.calibrate.kernels import timed_rates
from batchlab.formula.calibration import (Calibration, cache_dir, default_threads, load_all, load_cached,
                                      probe_reference, save)
from batchlab.calibrate.run import auto, ensure, measure

__all__ = ["Calibration", "auto", "cache_dir", "default_threads", "ensure", "load_all", "load_cached", "measure",
           "probe_reference", "save", "timed_rates"]
