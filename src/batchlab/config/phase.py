"""The phases of one optimizer update, as the harness marks them, the time model prices them and every report
names them.  Torch-free.

``data`` (batch made), ``forward`` and ``backward`` (per micro-batch), ``optimizer`` (unscale, clip, step,
zero_grad); ``setup`` is before the first update (building the model), ``end`` the mark after an update's last
phase.  ``recompute`` is never marked by the harness: it is the part of ``backward`` in which activation
checkpointing re-runs a block's forward ops; the op recorder (trace/ops.py) and the formula's op list
(formula/oplist.py) put those ops there, because they are dispatched and priced as forward ops.

Kept apart from config/choices.py on purpose: those are the closed sets a user chooses a run by (precision,
optimizer, ...); a phase is not chosen but observed — the harness marks it, the formula names where its peak
falls, the timeline and the reports label by it — so config does not own it, and the calculator,
measurement and reports import it from here without depending on each other.
"""
from __future__ import annotations

from batchlab.config import Choice


class Phase(Choice):
    SETUP = "setup"
    DATA = "data"
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"  # forward ops activation checkpointing repeats during backward (never a harness mark)
    OPTIMIZER = "optimizer"
    END = "end"


UPDATE_PHASES = (Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)


class Launch(Choice):
    """Who issues an op, which decides its fixed cost in the time model (formula/opcost.py)."""

    EAGER = "eager"  # eager PyTorch: the dispatcher (and autograd) per op, priced by the phase it runs in
    # a kernel of a compiled graph: one call from inductor's generated wrapper, no autograd node per op (a
    # no-grad aten call's cost, the calibrated "plain" dispatch)
    COMPILED = "compiled"
    FUSED = "fused"  # folded into another op's kernel by the compiler: no call of its own
    # a compiled graph's own call around its kernels (guards, AOTAutograd's runtime wrapper and autograd node):
    # one per graph run, forward or backward, at its own timed cost (calibrate/calls.py)
    GRAPH = "graph"
    # a non-reentrant checkpoint's own work per region (RNG state stashed and restored, hooks installed, the
    # recompute's entry): one per checkpointed region in forward and in recompute (calibrate/calls.py)
    CHECKPOINT = "checkpoint"


# the op names a graph's and a checkpoint region's own calls go by in op lists (no data; formula/opcost.py)
GRAPH_CALL, REGION_CALL = "compiled_graph", "checkpoint_region"


def own_kind(launch: Launch, phase: Phase) -> str:
    """The calibration's dispatch kind of a graph's or checkpoint region's own call in ``phase``
    ("graph-forward", "checkpoint-recompute"; calibrate/calls.py times them)."""
    return f"{launch.value}-{phase.value}"
