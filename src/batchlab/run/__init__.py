"""The one entry that measures a config: one process, or one process per rank under torchrun.

    from batchlab.run import measure
    m = measure(cfg, MeasureOptions(steps=5, isolate=True))   # isolate: a fresh subprocess (measure/runner.py)

It sits above ``measure`` (one process) and ``distributed`` (torchrun + DDP), so neither imports the other's
entry point: DP > 1, or this process being one rank of a torchrun job, goes to ``distributed``; everything
else to ``measure.session`` (in this process) or ``measure.runner`` (isolated).
"""
from __future__ import annotations

import gc
from typing import TYPE_CHECKING

from batchlab.config.fp8 import FP8Recipe
from batchlab.measure.options import MeasureOptions

if TYPE_CHECKING:
    from batchlab.config import RunConfig
    from batchlab.measure.result import Measurement
    from batchlab.measure.session import Progress


def measure(cfg: "RunConfig", options: MeasureOptions | None = None,
            progress: "Progress | None" = None) -> "Measurement":
    """Measure ``cfg``.  Never raises for an out-of-memory, a crash or a timeout (they become the outcome);
    raises ConfigError for user errors (a device that is absent, a budget that cannot hold the parameters,
    a factory that does not import, ...)."""
    from batchlab import distributed
    from batchlab.config import ConfigError

    if cfg.fp8 is not FP8Recipe.NONE:  # no CPU has FP8 tensor cores, and the harness wraps no Float8Linear / TE module
        raise ConfigError("fp8", f"{cfg.fp8} is formula only (batchlab estimate); measure the run without --fp8")
    if cfg.offload_activations:  # the harness installs no saved-tensor hooks that move activations to the host
        raise ConfigError("offload_activations", "is formula only (batchlab estimate); measure the run without "
                                                 "--offload-activations")
    options = options or MeasureOptions()
    if distributed.in_torchrun():
        return distributed.measure_in_torchrun(cfg, options)
    if cfg.parallel.world_size > 1:
        return distributed.launch(cfg, options)
    if options.isolate:
        from batchlab.measure.runner import run_isolated

        return run_isolated(cfg, options, progress)
    import torch

    from batchlab.measure.session import run_inprocess

    try:
        return run_inprocess(cfg, options, progress)
    finally:
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
