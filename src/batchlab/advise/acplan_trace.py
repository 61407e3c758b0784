"""The planner's model of a factory model (the formula cannot see inside it), from traces of its own code.

Two traces (every block plain, every block recomputed) give each block's kept bytes under both (the module
tree: exact bytes per block) and the peaks.  The model is a bound, checked by tracing the plan itself:
    peak(plan) = max( C + max( sum_j kept_j, max_i ( sum_{j<i} kept_j + whole_i ) ),  O )
whole_i: block i's kept bytes with nothing recomputed (its recompute rebuilds that much); C: the larger of what
the two traces' forward/backward peaks leave besides that term; O: the optimizer step.  Costs: the traced
time of recomputing every block, shared over the blocks by their activation bytes.  Policies: none and full
(a factory's blocks need not hold the matmuls the selective policies select).
"""
from __future__ import annotations

from batchlab.advise.acmodel import LayerModel
from batchlab.config import ConfigError, RunConfig
from batchlab.config.acpolicies import no_recompute, whole_block
from batchlab.formula import Calibrations

SOLVED = ("peak = max(C + max(every block's kept, each block's backward: the blocks below keep theirs while it is "
          "rebuilt whole), optimizer step), C and the blocks' bytes from two traces of the model's own code (a "
          "bound); costs: the traced recompute time shared by activation bytes; exact by dynamic programming, "
          "checked by a trace of the plan")
_TRACES: dict = {}  # cfg -> TraceEstimate: the planner traces the same plans again (frontier, presets)


def traced(cfg: RunConfig, cals: Calibrations):
    """The trace of cfg's update; a plan of one policy throughout is traced as that policy (the same wrapping:
    models/ac.py), so the frontier's ends reuse the presets' traces."""
    from batchlab.trace import estimate as trace

    key = cfg.replace(ac=cfg.ac.simplified())
    if key not in _TRACES:
        if len(_TRACES) > 256:
            _TRACES.clear()
        _TRACES[key] = trace(key, tree=True, calibrations=cals)
    return _TRACES[key]


def _blocks(t) -> list:
    """The recomputed blocks of a trace's module tree, in order."""
    return [n for n in t.tree.walk() if n.recomputed == "full"] if t.tree is not None else []


def _inner(kept: list[int], whole: list[int]) -> int:
    prefix, worst = 0, 0
    for k, w in zip(kept, whole):
        worst = max(worst, prefix + w)
        prefix += k
    return max(worst, prefix)


def trace_layer_model(cfg: RunConfig, cals: Calibrations) -> LayerModel:
    full_t = traced(cfg.replace(ac="full"), cals)  # every block recomputed: the plan full*n is this same update
    names = [n.name for n in _blocks(full_t)]
    if not names:
        raise ConfigError("ac", f"auto needs the model's blocks: {cfg.model_source} names none (models/factory.py)")
    none_t = traced(cfg.replace(ac="none"), cals)
    nodes = {x.name: x.total_bytes for x in none_t.tree.walk()} if none_t.tree is not None else {}
    whole = [nodes.get(name, 0) for name in names]
    kept = [x.total_bytes for x in _blocks(full_t)]

    def rest(t, k: list[int]) -> int:  # the forward/backward peak less the blocks' term
        ph = t.memory.phase_peaks
        return max(ph.get("forward", 0), ph.get("backward", 0)) + t.memory.margin_bytes - _inner(k, whole)

    c = max(rest(none_t, whole), rest(full_t, kept))
    opt = max(t.memory.phase_peaks.get("optimizer", 0) + t.memory.margin_bytes for t in (none_t, full_t))
    extra = max(full_t.time.seconds - none_t.time.seconds, 0.0)
    total = sum(whole) or 1
    seconds = tuple((0.0, extra * w / total) for w in whole)
    return LayerModel(cfg, (no_recompute(), whole_block()), tuple(zip(whole, kept)), seconds,
                      tuple(c + w for w in whole), c, opt, SOLVED, "trace")
