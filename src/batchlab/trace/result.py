"""What a trace returns.  Torch-free, so reports and the notebook can load it anywhere.

Field names match the formula's Estimate and the measured Measurement where the figure is the same
(``memory.peak_bytes``, ``memory.activations_bytes``, ``memory.peak_phase``, ``flops.model_flops_per_update``,
...), so a report lays them side by side without a mapping table.  Bytes and FLOPs are per rank, per update.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchlab.config.choices import Counted
from batchlab.timeline.data import Timeline


@dataclass
class TraceMemory:
    """Tensor bytes of one steady-state update, from live-storage tracking on fake tensors."""

    peak_bytes: int  # tensor bytes live at the peak (no allocator slack: comparable with a CPU measurement)
    peak_phase: str  # data | forward | backward | optimizer
    activations_bytes: int  # created by the last micro-batch's forward and still held when its backward starts
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    breakdown: dict[str, int]  # category -> bytes live at the peak; sums to peak_bytes
    phase_peaks: dict[str, int]  # highest live tensor bytes seen in each phase
    margin_bytes: int  # reserved - allocated: on CUDA the trace replayed through the caching allocator (trace/replay.py)
    capacity_bytes: int
    fits: bool  # peak_bytes + margin_bytes <= capacity_bytes
    provenance: str = "trace"
    margin_source: str = "formula"  # "replay" (trace/replay.py), "formula" (formula/allocator.py), "assumption" (the
    # user's fixed allocator_margin) or "none" (CPU)


@dataclass
class TraceFlops:
    """FLOPs of one update counted by the formulas of torch.utils.flop_counter (matmul-class ops only;
    element-wise ops and the optimizer count 0).  Attention is counted without causal halving."""

    forward: int  # all micro-batches' forward passes
    backward: int  # backward passes, recompute excluded
    recompute: int  # forward work activation checkpointing repeats during backward
    model_flops_per_update: int  # forward + backward: the work the model needs (MFU counts this)
    hardware_flops_per_update: int  # + recompute: the work the device does (HFU counts this)
    provenance: str = "trace"

    @classmethod
    def of(cls, forward: int, backward: int, recompute: int) -> "TraceFlops":
        return cls(forward, backward, recompute, forward + backward, forward + backward + recompute)


@dataclass
class ModuleNode:
    """Bytes a module's forward leaves held for backward (what was created while it was the innermost
    running module and is still live when backward starts), with its sub-modules."""

    name: str  # qualified name in the model ("" is the model itself)
    kind: str  # class name
    self_bytes: int  # created by this module's own code, not by a sub-module
    total_bytes: int  # self_bytes + all sub-modules
    recomputed: str | None = None  # "full" or "selective" when activation checkpointing wraps the module
    children: list["ModuleNode"] = field(default_factory=list)

    def walk(self):
        yield self
        for c in self.children:
            yield from c.walk()


@dataclass
class TraceEstimate:
    config: dict[str, Any]  # RunConfig.to_dict()
    global_batch: int  # micro-batch x accum x DP
    tokens_per_update: int
    memory: TraceMemory
    flops: TraceFlops
    traced_device: str  # the kernels the trace ran (cpu when the config's device is absent here)
    trace_seconds: float  # wall-clock time of the trace itself
    tree: ModuleNode | None = None  # with tree=True
    notes: list[str] = field(default_factory=list)  # what the trace could not represent for this config
    # the per-op time model over the ops this update really ran (formula/opcost.py), one rank, no comm
    time: Any = None  # formula.opcost.TimeBreakdown (provenance "trace")
    time_model: str = ""  # its assumptions: rates and their source
    provenance: str = "trace"
    timeline: Timeline | None = None  # with timeline=True: memory over the update, op by op
    counted: Counted = Counted.TOKENS  # what one example is: tokens, or samples for a per-sample model
    traced: str = ""  # the code that ran (the workload's description)
    kv_cache: bool | None = None  # the traced model's config.use_cache (transformers' models only)
    # what torch and the model's code warned during the trace, each distinct message once: kept off the terminal
    warnings: list[str] = field(default_factory=list)
