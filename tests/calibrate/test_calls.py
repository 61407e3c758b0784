"""A compiled graph's and an eager checkpoint region's own call (calibrate/calls.py): counted once per run of a
graph or region in the op lists (formula and trace alike), priced at the kinds timed once per CPU and cached with
the calibration (the timing itself, which compiles, is stubbed here)."""
from __future__ import annotations

import pytest

from batchlab.calibrate import calls, load_cached, save
from batchlab.config import RunConfig, preset
from batchlab.config.phase import GRAPH_CALL, REGION_CALL, Phase
from batchlab.formula.opcost import OpCosts, price
from batchlab.formula.opdescribe import describe
from batchlab.formula.oplist import update_ops
from batchlab.measure.harness import Trainer
from batchlab.trace.ops import record_update

from hosts import stub_calibration

pytestmark = pytest.mark.usefixtures("private_cache")  # its stub calibrations stay its own

CFG = RunConfig(model=preset("tiny", layers=3), seq=16, micro_batch=1)
FLAT = OpCosts(matmul={"fp32": ((1.0, 1e10),)}, memory=((1.0, 1e10),), strided_bytes_per_s=5e9,
               element_seconds={}, dispatch={"forward": 1e-5, "backward": 1e-5, "plain": 1e-5}, source="toy")
OWN = {"graph-forward": 4e-5, "graph-backward": 5e-5, "checkpoint-forward": 2e-5, "checkpoint-recompute": 1e-4}


def _calls(ops, name: str) -> dict[Phase, int]:
    out: dict[Phase, int] = {}
    for op in ops:
        if op.name == name:
            out[op.phase] = out.get(op.phase, 0) + op.count
    return out


def test_each_compiled_block_is_one_graph_run_forward_and_backward():
    # by hand: --compile blocks runs one graph per block, forward and backward; --compile model one in all
    assert _calls(update_ops(CFG.replace(compile="blocks")), GRAPH_CALL) == {Phase.FORWARD: 3, Phase.BACKWARD: 3}
    assert _calls(update_ops(CFG.replace(compile="model")), GRAPH_CALL) == {Phase.FORWARD: 1, Phase.BACKWARD: 1}
    assert _calls(update_ops(CFG), GRAPH_CALL) == {}
    # priced at the timed kinds: by hand 3 graphs x (40 + 50) us = 270 us more than with none timed; no op counted
    ops = update_ops(CFG.replace(compile="blocks"))
    timed = price(ops, OpCosts(**{**FLAT.__dict__, "dispatch": {**FLAT.dispatch, **OWN}}))
    assert timed.seconds - price(ops, FLAT).seconds == pytest.approx(270e-6)
    assert timed.ops == price(ops, FLAT).ops == price([o for o in ops if o.name != GRAPH_CALL], FLAT).ops


# every policy that recomputes by plain non-reentrant checkpointing, wherever it enters checkpoint (the whole
# block, the MLP branch, the attention core): 3 layers, by hand 3 regions each way; every:2 wraps layers 0 and 2
RECOMPUTING = {"full": 3, "every:2": 2, "selective-mlp": 3, "megatron-selective": 3}


@pytest.mark.parametrize("ac", list(RECOMPUTING))
def test_each_eager_checkpointed_region_is_one_call_in_forward_and_in_recompute(ac):
    cfg = CFG.replace(ac=ac, attention="sdpa")
    k = RECOMPUTING[ac]
    assert _calls(update_ops(cfg), REGION_CALL) == {Phase.FORWARD: k, Phase.RECOMPUTE: k}
    # the real update, recorded where each policy enters its checkpoint: the same regions
    assert _calls(record_update(Trainer(cfg)), REGION_CALL) == {Phase.FORWARD: k, Phase.RECOMPUTE: k}


def test_no_region_call_without_plain_checkpointing_and_each_priced_at_its_kinds():
    # a selective policy's dispatch mode prices its regions per op (calibrate/dispatch.py); a compiled block's
    # checkpoint is part of its graph; no AC has none
    full = CFG.replace(ac="full")
    for other in (CFG.replace(ac="selective-op"), full.replace(compile="blocks"), CFG):
        assert _calls(update_ops(other), REGION_CALL) == {}
    assert _calls(record_update(Trainer(CFG.replace(ac="selective-op"))), REGION_CALL) == {}
    ops = update_ops(full)
    timed = price(ops, OpCosts(**{**FLAT.__dict__, "dispatch": {**FLAT.dispatch, **OWN}}))
    # by hand: 3 regions x (20 + 100) us = 360 us
    assert timed.seconds - price(ops, FLAT).seconds == pytest.approx(360e-6)


def test_ensure_times_what_the_config_runs_once_and_caches_it(monkeypatch):
    timed = []
    monkeypatch.setattr(calls, "measure_graph", lambda dispatch: timed.append("graph") or
                        {k: v for k, v in OWN.items() if k in calls.GRAPH})
    monkeypatch.setattr(calls, "measure_checkpoint", lambda: timed.append("checkpoint") or
                        {k: v for k, v in OWN.items() if k in calls.CHECKPOINT})
    compiled = CFG.replace(compile="blocks")
    assert calls.ensure(compiled, threads=1) is None and not timed  # no calibration: nothing to take off
    save(stub_calibration(dispatch_seconds={"forward": 6e-6, "backward": 4e-6, "plain": 5e-6}))
    assert calls.ensure(CFG, threads=1) is None and not timed  # eager, no AC: neither runs
    assert "compiled graph" in calls.ensure(compiled, threads=1) and timed == ["graph"] * calls.ROUNDS
    assert "checkpoint region" in calls.ensure(CFG.replace(ac="full"), threads=1)
    assert calls.ensure(compiled.replace(ac="full"), threads=1) is None
    assert timed == ["graph"] * calls.ROUNDS + ["checkpoint"] * calls.ROUNDS
    # who pays is the op list's answer: a compiled block's checkpoint is part of its graph, no region of its own
    assert calls.wanted(compiled.replace(ac="full")) == calls.GRAPH
    assert {k: load_cached("cpu", 1).dispatch_seconds[k] for k in OWN} == OWN


@pytest.mark.parametrize("timer", [lambda dispatch: {"graph-forward": float("nan"), "graph-backward": 1e-5},
                                   lambda dispatch: {"graph-forward": -2e-5, "graph-backward": 1e-5},
                                   lambda dispatch: (_ for _ in ()).throw(RuntimeError("InvalidCxxCompiler"))])
def test_a_failed_or_senseless_timing_is_remembered_and_prices_nothing(monkeypatch, timer):
    monkeypatch.setattr(calls, "measure_graph", timer)
    save(stub_calibration(dispatch_seconds={"forward": 6e-6, "backward": 4e-6, "plain": 5e-6}))
    assert "not timed" in calls.ensure(CFG.replace(compile="blocks"), threads=1)
    cal = load_cached("cpu", 1)
    assert set(calls.GRAPH) <= set(cal.untimed) and not set(calls.GRAPH) & set(cal.dispatch_seconds)
    monkeypatch.setattr(calls, "measure_graph", lambda dispatch: pytest.fail("timed again"))
    assert calls.ensure(CFG.replace(compile="blocks"), threads=1) is None


def test_an_own_call_without_its_timed_kind_is_said_to_be_priced_at_zero():
    ops = update_ops(CFG.replace(compile="blocks", ac="full"))
    said = describe(FLAT, price(ops, FLAT))
    assert "priced at 0" in said and "graph-forward not in the calibration" in said and "checkpoint-" not in said
    untimed = OpCosts(**{**FLAT.__dict__, "untimed": {"graph-backward": "InvalidCxxCompiler"}})
    assert "graph-backward not timed: InvalidCxxCompiler" in describe(untimed, price(ops, untimed))
    timed = OpCosts(**{**FLAT.__dict__, "dispatch": {**FLAT.dispatch, **OWN}})
    assert "priced at 0" not in describe(timed, price(ops, timed))
    assert "priced at 0" not in describe(FLAT, price(update_ops(CFG), FLAT))  # eager, no AC: nothing to price


def test_each_figure_is_the_median_of_its_rounds_a_burst_in_one_not_taken(monkeypatch):
    runs = iter([4e-5, 9e-3, 5e-5])  # the second round hit by a burst of load

    def timer(dispatch):
        v = next(runs)
        return {"graph-forward": v, "graph-backward": 2 * v}

    monkeypatch.setattr(calls, "measure_graph", timer)
    save(stub_calibration(dispatch_seconds={"forward": 6e-6, "backward": 4e-6, "plain": 5e-6}))
    assert "median of 3" in calls.ensure(CFG.replace(compile="blocks"), threads=1)
    cached = load_cached("cpu", 1).dispatch_seconds
    assert (cached["graph-forward"], cached["graph-backward"]) == (5e-5, 1e-4)
