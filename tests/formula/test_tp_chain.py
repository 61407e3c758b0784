"""Tensor-parallel collectives on local CPU ranks priced as a chain of them pays each (formula/links.py
``Link.in_chain``, formula/pipeline.py ``tp_at_gap``): a micro-batch's ~20 collectives pay gloo's mean call, its
heavy tail included, not the median of single calls the link calibration takes.  References: hand computation;
the collectives of real tensor-parallel updates (tests/formula/test_parallel_time.py counts them)."""
from __future__ import annotations

import dataclasses

import pytest

from batchlab.config import RunConfig
from batchlab.formula.links import CHAIN_BYTES, Link

CHAIN = {"0": 2e-3, "0.002": 4e-3, "0.008": 3e-3}  # seconds of one chained all-reduce, by the gap before it


def test_a_chained_collective_pays_the_chains_mean_at_its_gap():
    link = Link(1e9, 1e-3, "gloo")  # 1 ns a byte; the chain's figure holds CHAIN_BYTES = 16,384 B over it
    # 1 ms after the last: halfway from 2 to 4 ms = 3 ms, less 16,384 ns of bytes, over 2 messages
    assert link.in_chain(CHAIN, 0.0, 1e-3).latency_s == pytest.approx((3e-3 - CHAIN_BYTES * 1e-9) / 2)
    assert link.in_chain(CHAIN, 0.0, 5e-3).latency_s == pytest.approx((3.5e-3 - CHAIN_BYTES * 1e-9) / 2)
    # beyond the measured gaps: the nearest figure, never extrapolated
    assert link.in_chain(CHAIN, 0.0, 0.1).latency_s == pytest.approx((3e-3 - CHAIN_BYTES * 1e-9) / 2)
    assert link.in_chain({"0.001": 4e-3}, 0.0, 0.0).latency_s == pytest.approx((4e-3 - CHAIN_BYTES * 1e-9) / 2)
    # bandwidth and gloo's reduce-scatter kept; nothing measured: the link as it was
    chained = Link(1e9, 1e-3, "gloo", reduce_scatter_all_reduces=True).in_chain(CHAIN, 0.0, 1e-3)
    assert chained.bytes_per_s == 1e9 and chained.reduce_scatter_all_reduces
    assert link.in_chain({}, 0.0, 1e-3) is link  # after_gap with nothing warm measured: the link as calibrated
    # nothing measured: the single calls' price after the gap (2e-4 back to back, 1e-3 after 15 ms: 1 ms is 1/15
    # of the way); a chain figure below that price: that price (a mean over a tail is no less than the median)
    assert link.in_chain({}, 2e-4, 1e-3).latency_s == pytest.approx(2e-4 + 8e-4 / 15)
    assert link.in_chain({"0": 1e-4}, 2e-4, 1e-3).latency_s == pytest.approx(2e-4 + 8e-4 / 15)


def _costs(**extra):
    from batchlab.formula.opcost import OpCosts

    return OpCosts(matmul={"fp32": ((1.0, 1e10),)}, memory=((1.0, 1e10),), strided_bytes_per_s=5e9,
                   element_seconds={}, dispatch={"forward": 5e-6, "backward": 5e-6, "plain": 5e-6}, threads=1,
                   cores=2, link_bytes_per_s=1e9, link_latency_s=1e-3, link_warm_latency_s=2e-4, **extra)


def test_a_tensor_parallel_micro_batch_pays_the_chained_figure_on_a_calibrated_host():
    # the tiny GPT on 2 local ranks, each with a core: per micro-batch 18 all-reduces of b·s·h (131,072 B) and the
    # loss's 3 of 1,024 B (counted on a real update, test_parallel_time.py); a flat chain of 3 ms a call prices
    # each at (3 ms - 16,384 ns) / 2 a message, 2 messages, plus its bytes; 4 micro-batches
    from batchlab.formula import flops, memory, timing

    cfg = RunConfig(seq=64, micro_batch=4, accum=4, tp=2)
    flat = {"0": 3e-3, "0.01": 3e-3}
    t = timing(cfg, flops(cfg), memory(cfg), _costs(link_chain_seconds=flat))
    message = (3e-3 - CHAIN_BYTES * 1e-9) / 2
    assert t.tp_comm_seconds == pytest.approx(4 * (18 * (131072e-9 + 2 * message) + 3 * (1024e-9 + 2 * message)))
    assert "as a chain of them pays it" in t.model
    # without the chain: the link calibration's medians between back to back and after a step (after_gap), less
    before = timing(cfg, flops(cfg), memory(cfg), _costs())
    assert before.tp_comm_seconds < t.tp_comm_seconds and "as a chain" not in before.model


def test_the_chain_prices_tensor_parallel_collectives_only():
    # data- and pipeline-parallel messages keep the link calibration's figures: a DP or PP layout's time is the
    # same with or without the chain
    from batchlab.formula import flops, memory, timing

    for cfg in (RunConfig(seq=64, micro_batch=4, accum=4, dp=2),
                RunConfig(seq=64, micro_batch=4, accum=4, pp=2, dp=2)):
        with_chain = timing(cfg, flops(cfg), memory(cfg), _costs(link_chain_seconds=CHAIN))
        assert with_chain.update_seconds == timing(cfg, flops(cfg), memory(cfg), _costs()).update_seconds
