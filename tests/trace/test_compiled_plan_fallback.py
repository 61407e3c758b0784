"""estimate --trace --compile where inductor cannot plan: the partition-only trace answers, and its note says why
(a lowering that fails; a CUDA config is tests/cli/test_compile_flag.py's)."""
from __future__ import annotations

from batchlab.config import RunConfig, preset
from batchlab.trace import estimate as trace
from batchlab.trace import inductor_plan


def test_a_failing_lowering_falls_back_to_the_partition_and_says_why(monkeypatch):
    def failing(gm, example_inputs):
        raise NotImplementedError("no lowering for this op")

    monkeypatch.setattr(inductor_plan, "inductor", failing)
    cfg = RunConfig(model=preset("tiny", layers=1), seq=16, micro_batch=2, compile="blocks", ac="full")
    traced = trace(cfg)
    note = traced.notes[0]
    assert "min-cut partition" in note and "not inductor's own plan" in note and "no lowering for this op" in note
    # the partition's count of what the forward saves under full AC: the block's input, b x s x h fp32, and more
    assert traced.memory.activations_bytes >= 2 * 16 * 128 * 4
