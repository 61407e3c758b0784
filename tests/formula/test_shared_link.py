"""Gloo's link as local ranks time-sharing the cores meet it (formula/links.py): only the ranks' own CPU part of a
message and of its bytes stretches with the sharing, and data-, tensor- and pipeline-parallel messages cross the
same link.  References: hand computation; message counts of real runs (an FSDP2 update's collectives,
tests/formula/test_fsdp_messages.py; the tensor-parallel all-reduces benchmarks/parallel_time_parts.py counted on a
real TP2 update: 84 per update of the tiny GPT at micro-batch 4 x sequence 64, 4 micro-batches)."""
from __future__ import annotations

import dataclasses

import pytest

from batchlab.config import RunConfig
from batchlab.formula import flops, memory
from batchlab.formula.links import Link
from batchlab.formula.timing import nominal_costs, timing


def test_only_the_cpu_part_of_a_message_and_of_its_bytes_stretches():
    link = Link(1e9, 1e-3, "hand")  # 1 ns a byte, 1 ms a message
    # 2 ranks a core: the 0.2 ms of CPU a message holds runs at half speed (+0.2 ms), the 0.5 ns a byte too
    shared = link.time_shared(2.0, {"message": 2e-4, "byte": 0.5e-9})
    assert shared.latency_s == pytest.approx(1.2e-3)
    assert 1 / shared.bytes_per_s == pytest.approx(1.5e-9)
    assert link.time_shared(3.0, {"message": 2e-4, "byte": 0.0}).latency_s == pytest.approx(1.4e-3)
    # unmeasured: the whole message is taken for the ranks' CPU work; a core each: nothing stretches
    assert link.time_shared(2.0).latency_s == pytest.approx(2e-3)
    assert 1 / link.time_shared(2.0).bytes_per_s == pytest.approx(2e-9)
    assert link.time_shared(1.0, {"message": 2e-4, "byte": 0.0}) is link
    # a CPU part measured above the link's own figure (another moment's load) stretches the whole figure, no more
    assert link.time_shared(2.0, {"message": 5e-3, "byte": 0.0}).latency_s == pytest.approx(2e-3)


def _costs(cfg, cores: int, latency: float, cpu: dict):
    return dataclasses.replace(nominal_costs(cfg), link_bytes_per_s=1e9, link_latency_s=latency, threads=1,
                               cores=cores, rank_skew=0.0, contention={}, link_cpu_seconds=cpu)


def test_a_data_parallel_ring_crosses_the_shared_link():
    # ZeRO-3 over 2 ranks, 4 blocks + the root, 4 micro-batches: 40 all-gathers of 1 message, 20 reduce-scatters
    # that gloo runs as all-reduces (2 messages) + the token count's all-reduce (2): 82 messages; on 1 core (2 ranks
    # a core) each costs 1 ms + its 0.25 ms of CPU once more
    cfg = RunConfig(seq=64, micro_batch=4, accum=4, dp=2, zero=3)
    cpu = {"message": 2.5e-4, "byte": 0.0}
    slow, fast = (timing(cfg, flops(cfg), memory(cfg), _costs(cfg, 1, s, cpu)) for s in (1e-3, 0.0))
    assert slow.allreduce_seconds - fast.allreduce_seconds == pytest.approx(82 * 1.25e-3)
    # unmeasured: all of it stretches, the bytes too
    whole, bytes_only = (timing(cfg, flops(cfg), memory(cfg), _costs(cfg, 1, s, {})) for s in (1e-3, 0.0))
    assert whole.allreduce_seconds - bytes_only.allreduce_seconds == pytest.approx(82 * 2e-3)
    a_core_each = timing(cfg, flops(cfg), memory(cfg), _costs(cfg, 2, 1e-3, cpu))
    assert a_core_each.allreduce_seconds - fast.allreduce_seconds == pytest.approx(82 * 1e-3)


def test_tensor_parallel_messages_cross_the_same_shared_link():
    # TP2 on 1 core: 84 all-reduces per update (counted on a real run), 2 messages each over 2 ranks
    cfg = RunConfig(seq=64, micro_batch=4, accum=4, tp=2)
    cpu = {"message": 2.5e-4, "byte": 0.0}
    slow, fast = (timing(cfg, flops(cfg), memory(cfg), _costs(cfg, 1, s, cpu)) for s in (1e-3, 0.0))
    assert slow.tp_comm_seconds - fast.tp_comm_seconds == pytest.approx(84 * 2 * 1.25e-3)


def test_gloo_runs_a_reduce_scatter_as_an_all_reduce_of_its_whole_input():
    # ProcessGroupGloo::reduce_scatter_tensor_coalesced: clone, all-reduce the clone, copy the rank's chunk out: 1 MB
    # over 2 ranks moves 2(n-1)/n x 1 MB = 1 MB in 2 messages, not the ring reduce-scatter's 0.5 MB in 1
    from batchlab.formula.links import Link, local_link
    from batchlab.formula.timing import nominal_costs

    cfg = RunConfig(dp=2)
    gloo = local_link(cfg, dataclasses.replace(nominal_costs(cfg), link_bytes_per_s=1e9, link_latency_s=1e-4))
    assert gloo.collective_seconds("reduce_scatter", 1e6, 2) == pytest.approx(1e-3 + 2e-4)
    assert gloo.time_shared(2.0).collective_seconds("reduce_scatter", 1e6, 2) > 2e-3  # stretched, still an all-reduce
    nvlink = Link(1e9, 1e-4, "a device's link")
    assert nvlink.collective_seconds("reduce_scatter", 1e6, 2) == pytest.approx(0.5e-3 + 1e-4)


def test_a_message_soon_after_the_last_meets_the_back_to_back_cost():
    # calibrated: 1 ms a message after 15 ms of compute (COLD_GAP_S), 0.2 ms back to back; 3 ms after the last
    # message: 0.2 + 0.8 x 3/15 = 0.36 ms; 15 ms or more: 1 ms; no back-to-back figure: as calibrated
    from batchlab.formula.links import COLD_GAP_S, Link

    cold = Link(1e9, 1e-3, "gloo")
    assert cold.after_gap(2e-4, 0.0).latency_s == pytest.approx(2e-4)
    assert cold.after_gap(2e-4, 3e-3).latency_s == pytest.approx(3.6e-4)
    assert cold.after_gap(2e-4, COLD_GAP_S * 2).latency_s == pytest.approx(1e-3)
    assert cold.after_gap(0.0, 0.0) is cold and cold.after_gap(2e-4, 0.0).bytes_per_s == 1e9


def test_a_back_to_back_link_figure_beyond_the_after_compute_one_is_refused():
    # a cache edited (or a stalled timing) to a back-to-back cost above the after-compute one, negative or not a
    # number: the calibration is refused where calibrations are read, as its other rates are
    from batchlab.formula.plausible import problems
    from hosts import stub_calibration

    cal = dataclasses.replace(stub_calibration(), loopback_bytes_per_s=1e9, loopback_latency_s=1e-3)
    assert not [p for p in problems(dataclasses.replace(cal, loopback_warm_latency_s=2e-4)) if "back-to-back" in p]
    for wild in (5e-3, -1.0, "x"):
        assert any("back-to-back" in p for p in problems(dataclasses.replace(cal, loopback_warm_latency_s=wild)))
