"""FLOPs of one harness update: torch's FlopCounterMode, split by phase, recompute counted apart."""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn
from torch.utils.flop_counter import (FlopCounterMode, flop_registry, register_flop_formula,
                                      sdpa_backward_flop_count, sdpa_flop_count)

from batchlab.models.ac import Checkpointed
from batchlab.trace.result import TraceFlops
from batchlab.trace.tree import HookSet

_aten = torch.ops.aten


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                            **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def register_cpu_attention_flops() -> None:
    """FlopCounterMode has formulas for the CUDA SDPA kernels only; CPU's flash kernel would count 0.

    Same counts as torch's own formulas for the CUDA kernels (two matmuls forward, five backward, no
    causal halving), so CPU and CUDA traces agree.  Idempotent, and a no-op once torch registers its own.
    """
    for op, formula in ((_aten._scaled_dot_product_flash_attention_for_cpu, _cpu_sdpa_flop),
                        (_aten._scaled_dot_product_flash_attention_for_cpu_backward, _cpu_sdpa_backward_flop)):
        if op not in flop_registry:
            register_flop_formula(op)(formula)


class PhaseFlops(HookSet):
    """A harness probe that splits one FlopCounterMode's count by phase.

    Recompute is counted directly: FLOPs inside a checkpointed block's own forward while backward runs
    (non-reentrant checkpointing calls the block again from its unpack hook).  Under selective
    checkpointing the saved matmuls are served from the cache, so only what is really redone counts.
    """

    def __init__(self, counter: FlopCounterMode, model: nn.Module):
        super().__init__()
        self.counter = counter
        self.phase: str | None = None
        self.by_phase: dict[str, int] = defaultdict(int)
        self.recompute = 0
        self._last = 0
        for m in model.modules():
            if isinstance(m, Checkpointed):
                self._handles.append(m.block.register_forward_pre_hook(self._block_start))
                self._handles.append(m.block.register_forward_hook(self._block_end, always_call=True))

    def _take(self) -> int:
        now = self.counter.get_total_flops()
        delta, self._last = now - self._last, now
        return delta

    def mark(self, phase: str) -> None:
        if self.phase is not None:
            self.by_phase[self.phase] += self._take()
        self.phase = phase

    def _block_start(self, module, args) -> None:
        if self.phase == "backward":
            self.by_phase["backward"] += self._take()

    def _block_end(self, module, args, output) -> None:
        if self.phase == "backward":
            self.recompute += self._take()

    def result(self) -> TraceFlops:
        return TraceFlops.of(self.by_phase["forward"], self.by_phase["backward"], self.recompute)


def count_update_flops(trainer) -> TraceFlops:
    """Run one update of ``trainer`` under FlopCounterMode and return its FLOPs by phase."""
    register_cpu_attention_flops()
    counter = FlopCounterMode(display=False)
    return update_under(trainer, counter, PhaseFlops(counter, trainer.raw_model))


def update_under(trainer, mode, probe):
    """One update of ``trainer`` inside ``mode`` (a dispatch or FLOP-counting mode), ``probe`` told its
    phases and closed after (its hooks removed) even if the update raises; the probe's result."""
    try:
        with mode:
            trainer.update(probe=probe)
    finally:
        probe.close()
    return probe.result()
