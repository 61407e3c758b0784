"""FLOPs of one harness update, split by phase, recompute counted apart."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from batchlab.formula.opcost import OpCount
from batchlab.config.phase import Phase
from batchlab.trace.result import TraceFlops

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


def flops_of(ops: Iterable[OpCount]) -> TraceFlops:
    """FLOPs of one update by phase from its recorded ops (trace/ops.py: the same ``flop_registry`` formulas
    FlopCounterMode applies).  Recompute is its own phase there: ops inside a checkpointed block's forward
    while backward runs (non-reentrant checkpointing calls the block again from its unpack hook); under
    selective checkpointing the saved matmuls are served from the cache, so only what is really redone counts."""
    by_phase: dict[Phase, int] = defaultdict(int)
    for op in ops:
        by_phase[op.phase] += op.flops * op.count
    return TraceFlops.of(by_phase[Phase.FORWARD], by_phase[Phase.BACKWARD], by_phase[Phase.RECOMPUTE])


def update_under(trainer, mode, listener):
    """One update of ``trainer`` inside ``mode`` (a dispatch or FLOP-counting mode), ``listener`` told its
    phases and closed after (its hooks removed) even if the update raises; the listener's result."""
    try:
        with mode:
            trainer.update(listener=listener)
    finally:
        listener.close()
    return listener.result()
