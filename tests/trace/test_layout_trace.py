"""The trace of a layout whose stages are traced one after another in one process, each in its own fake world:
DTensor caches shardings (device mesh included) by value, so a later stage must not meet the earlier world's meshes."""
from __future__ import annotations

import pytest

from batchlab.config import RunConfig, preset
from batchlab.formula import estimate as formula_estimate
from batchlab.trace import estimate

pytestmark = pytest.mark.distributed  # a fake process group in this process


def test_pp2_x_fsdp2_traces_both_stages_in_turn():
    cfg = RunConfig(model=preset("tiny"), seq=32, micro_batch=2, accum=2, pp=2, dp=2, zero=3)
    t = estimate(cfg)  # stage 0's rank, then stage 1's (FSDP2 DTensor parameters in both worlds)
    note = next(n for n in t.notes if n.startswith("each pipeline stage traced"))
    assert "stage 0 (rank 0)" in note and "stage 1 (rank 2)" in note
    # 1F1B: the first stage holds p = 2 micro-batches in flight, the last one (measured: 8.84 MB against 8.48 MB)
    assert "the figures shown are stage 0's" in note
    # the formula's stage 0 (its first backward: every warm-up micro-batch, one block's gradients) against it
    formula = formula_estimate(cfg).memory.ranks[0].peak_bytes
    assert abs(formula - t.memory.peak_bytes) / t.memory.peak_bytes < 0.01, (formula, t.memory.peak_bytes)
