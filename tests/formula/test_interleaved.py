"""The interleaved 1F1B schedule step by step (formula/interleaved.py, formula/fsdp_interleaved.py) against its
references: the order torch's own ``ScheduleInterleaved1F1B`` computes for every rank (its ``pipeline_order``), and
the bytes the trace counts on each stage's first rank (``batchlab estimate --trace``: the measurement's own build
on fake tensors, exact against the forked gloo ranks on docs/accuracy/parallel.md)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from batchlab.config import RunConfig, preset
from batchlab.formula import estimate
from batchlab.formula.interleaved import rank_actions, steps


def _torch_order(p: int, v: int, m: int) -> dict[int, list[tuple[int, bool]]]:
    """torch's pipeline order per rank as (local chunk, backward?), its idle slots dropped; the schedule built over
    stand-in stages carrying what its constructor reads (no process group)."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import _ComputationType

    stages = [SimpleNamespace(group_size=p, group_rank=0, num_stages=p * v, stage_index=j * p) for j in range(v)]
    order = ScheduleInterleaved1F1B(stages, n_microbatches=m).pipeline_order
    return {r: [(a.stage_index // p, a.computation_type == _ComputationType.FULL_BACKWARD) for a in acts if a]
            for r, acts in order.items()}


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (2, 3, 4), (4, 2, 8), (4, 2, 4), (2, 2, 6), (4, 3, 8)])
def test_each_ranks_order_is_torchs(p, v, m):
    order = _torch_order(p, v, m)
    for r in range(p):
        assert list(rank_actions(p, v, m, r)) == order[r], r


def test_sends_are_held_to_the_steps_end():
    """Rank 0 of 2, chunks 0 and 1 (pipeline stages 0 and 2), 4 micro-batches: by the end it sent on all 8 outputs
    and sent back the input gradients of stage 2's 4 backwards (stage 0 has none); every chunk made its gradients."""
    *_, end = steps(2, 2, 4, 0)
    assert (end.chunk, end.held, end.made, end.sent, end.sends) == (None, (0, 0), (True, True), 8, 4)
    # its highest step: chunk 0's second backward, 3 + 2 micro-batches held, both chunks' gradients made
    b = [s for s in steps(2, 2, 4, 0) if s.backward and s.chunk == 0][1]
    assert (b.held, b.made, b.sent, b.sends) == ((3, 2), (True, True), 8, 2)


# (flags, trace peak of each stage's first rank in bytes)
TRACED = [
    (dict(seq=64, micro_batch=4, accum=4, pp=2, pp_virtual=2), (27_506_688, 21_596_180)),
    (dict(seq=32, micro_batch=2, accum=4, pp=2, pp_virtual=3, layers=6), (17_466_624, 15_630_868)),
    (dict(seq=32, micro_batch=2, accum=4, pp=4, pp_virtual=2, layers=8),
     (12_682_240, 11_370_496, 11_370_496, 11_141_140)),
    (dict(seq=32, micro_batch=2, accum=4, pp=2, pp_virtual=2, dp=2, zero=3), (11_963_136, 10_094_100)),
    (dict(seq=32, micro_batch=2, accum=4, pp=2, pp_virtual=2, dp=2, zero=2), (11_531_008, 9_760_276)),
    (dict(seq=32, micro_batch=2, accum=4, pp=2, pp_virtual=3, layers=6, dp=2, zero=2), (16_080_384, 14_309_652)),
    # 4 chunks: more than the schedule's window of 3 gathered chunks
    (dict(seq=32, micro_batch=2, accum=4, pp=2, pp_virtual=4, layers=8, dp=2, zero=3), (20_268_800, 18_203_144)),
]


@pytest.mark.parametrize("flags, traced", TRACED, ids=[str(f) for f, _ in TRACED])
def test_each_stage_peak_is_the_traces_within_1_percent(flags, traced):
    flags = dict(flags)
    layers = flags.pop("layers", 4)
    cfg = RunConfig(model=dataclasses.replace(preset("tiny"), layers=layers), pp_schedule="interleaved-1f1b", **flags)
    for got, want in zip((r.peak_bytes for r in estimate(cfg).memory.ranks), traced, strict=True):
        assert abs(got - want) / want < 0.01, (got, want)
