"""The trace: one training update of the model's own code on fake tensors (PyTorch FakeTensorMode).

    from batchlab.trace import estimate
    t = estimate(cfg, tree=True)   # t.memory.peak_bytes, t.flops.recompute, t.tree ... provenance "trace"

Exact for the graph the code builds (what is saved, when it is freed, which ops run), with nothing
allocated, so it sizes models far larger than the machine.  Importing this package does not import torch;
``estimate`` does.
"""
from __future__ import annotations

from batchlab.trace.result import ModuleNode, TraceEstimate, TraceFlops, TraceMemory

__all__ = ["ModuleNode", "TraceEstimate", "TraceFlops", "TraceMemory", "estimate"]


def estimate(cfg, tree: bool = False, timeline: bool = False, calibrations=None) -> TraceEstimate:
    from batchlab.config import CompileMode

    if cfg.compile is not CompileMode.NONE:  # the partitioned graphs on fake tensors
        from batchlab.trace.compiled import estimate as _estimate
    else:
        from batchlab.trace.run import estimate as _estimate

    return _estimate(cfg, tree=tree, timeline=timeline, calibrations=calibrations)
