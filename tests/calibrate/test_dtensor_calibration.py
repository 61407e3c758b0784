"""DTensor's host cost per op (calibrate/dtensor.py): measured on this CPU against the plain GPT, cached with the
calibration the first time a tensor-parallel config is met, and what the time model prices DTensor ops with."""
from __future__ import annotations

import math

import pytest

from batchlab.calibrate import dtensor, dtensor_collective, fsdp_host, load_cached, save
from batchlab.calibrate import run as run_mod
from batchlab.config import RunConfig
from batchlab.formula.dtensor import NOMINAL, seconds_per_op
from batchlab.formula.opcost import OpCosts

from hosts import stub_calibration

pytestmark = pytest.mark.usefixtures("private_cache")  # its stub calibrations stay its own

TP2 = RunConfig(seq=16, micro_batch=1, tp=2)


def test_the_sharded_dispatch_gpt_runs_dtensor_ops_in_every_phase_and_the_measure_prices_each():
    from batchlab.calibrate.dispatch import DISPATCH_GPT

    with dtensor.one_rank_mesh() as mesh:
        trainer = dtensor.sharded_trainer(DISPATCH_GPT, mesh)
        trainer.update()
        calls = dtensor.dtensor_calls(trainer)
    # 2 blocks x 4 sharded linears with biases: forward 4 ops each; backward 10 each + 16 parameters' accumulation;
    # AdamW's 8 per-element ops on each of the 16 (formula/dtensor.py, counted by hand)
    assert calls == {"forward": 32, "backward": 96, "plain": 128}
    figures = dtensor.measure(seconds=0.3)
    # each figure is a difference of two timings: a stall can make one <= 0 (ensure refuses it, tested below)
    assert set(figures) == {"forward", "backward", "plain"} and all(math.isfinite(v) for v in figures.values())


def test_ensure_measures_once_for_a_tp_config_and_the_time_model_prices_with_it(monkeypatch):
    calls = []
    monkeypatch.setattr(dtensor, "measure", lambda seconds=dtensor.SECONDS: calls.append(1) or
                        {"forward": 9e-5, "backward": 4e-5, "plain": 3e-5})
    monkeypatch.setattr(dtensor_collective, "measure", lambda samples=0: calls.append(2) or 4e-4)
    assert dtensor.ensure((TP2,), threads=1) is None  # no calibration cached
    save(stub_calibration())
    assert dtensor.ensure((RunConfig(),), threads=1) is None and not calls  # no tensor parallelism: nothing
    assert "DTensor's host cost per op once (forward 90 us" in dtensor.ensure((RunConfig(), TP2), threads=1)
    assert dtensor.ensure((TP2,), threads=1) is None and calls == [1, 2]  # cached
    cached = load_cached("cpu", 1)
    assert cached.dtensor_seconds == {"forward": 9e-5, "backward": 4e-5, "plain": 3e-5, "collective": 4e-4}
    costs = OpCosts(matmul={"fp32": ((1.0, 1e10),)}, memory=((1.0, 1e9),), strided_bytes_per_s=1e9,
                    element_seconds={}, dispatch={}, dtensor_seconds=cached.dtensor_seconds)
    # what was not measured (FSDP2's figures: no FSDP2 config met yet) stays nominal
    assert seconds_per_op(costs) == ({**NOMINAL, "forward": 9e-5, "backward": 4e-5, "plain": 3e-5,
                                      "collective": 4e-4}, "calibrated")
    assert seconds_per_op(None)[0] == NOMINAL and seconds_per_op(None)[1].startswith("nominal: one server CPU")


def test_a_failed_two_rank_step_keeps_the_per_op_figures_it_measured_before(monkeypatch):
    """Two ranks that cannot run here (a caller's own process group, a timeout) lose none of the per-op figures
    measured before them: those are cached and not measured again; the redistribution's stays nominal, said so."""
    def no_ranks(samples=0):
        raise RuntimeError("two local ranks gave no DTensor collective timing")

    monkeypatch.setattr(dtensor, "measure", lambda seconds=dtensor.SECONDS: {"forward": 9e-5, "backward": 4e-5,
                                                                              "plain": 3e-5})
    monkeypatch.setattr(dtensor_collective, "measure", no_ranks)
    save(stub_calibration())
    said = dtensor.ensure((TP2,), threads=1)
    assert "(collective) not measured (two local ranks" in said and "measured and cached: forward 90 us" in said
    assert load_cached("cpu", 1).dtensor_seconds == {"forward": 9e-5, "backward": 4e-5, "plain": 3e-5}
    # remembered: the next measure of a TP config does not fork the two ranks again until the next calibration
    assert dtensor.ensure((TP2,), threads=1) is None
    save(stub_calibration())
    assert "not measured" in dtensor.ensure((TP2,), threads=1)


def test_a_cache_with_per_op_figures_only_gets_the_collectives_measured(monkeypatch):
    """A calibration cached before the per-collective figure existed: only that one is measured, the rest kept."""
    import dataclasses

    monkeypatch.setattr(dtensor, "measure", lambda seconds=dtensor.SECONDS: pytest.fail("per-op measured again"))
    monkeypatch.setattr(dtensor_collective, "measure", lambda samples=0: 5e-4)
    save(dataclasses.replace(stub_calibration(), dtensor_seconds={"forward": 9e-5, "backward": 4e-5, "plain": 3e-5}))
    assert "collective 500 us" in dtensor.ensure((TP2,), threads=1)
    assert load_cached("cpu", 1).dtensor_seconds == {"forward": 9e-5, "backward": 4e-5, "plain": 3e-5,
                                                     "collective": 5e-4}


def test_an_fsdp2_config_gets_fsdp2s_host_work_measured_and_a_plain_one_nothing(monkeypatch):
    monkeypatch.setattr(dtensor, "measure", lambda seconds=dtensor.SECONDS: {"forward": 9e-5, "backward": 4e-5,
                                                                             "plain": 3e-5})
    monkeypatch.setattr(dtensor_collective, "measure", lambda samples=0: pytest.fail("no TP: no redistribution"))
    monkeypatch.setattr(fsdp_host, "measure", lambda updates=0: {"fsdp-hooks": 1.2e-3, "fsdp-tp-hooks": 1e-3})
    save(stub_calibration())
    assert dtensor.ensure((RunConfig(dp=2),), threads=1) is None  # DDP: nothing to measure
    assert "fsdp-hooks 1200 us" in dtensor.ensure((RunConfig(dp=2, zero=3),), threads=1)
    assert load_cached("cpu", 1).dtensor_seconds == {"forward": 9e-5, "backward": 4e-5, "plain": 3e-5,
                                                     "fsdp-hooks": 1.2e-3, "fsdp-tp-hooks": 1e-3}


def test_auto_asks_for_dtensor_figures(monkeypatch):
    seen = []
    monkeypatch.setattr(run_mod, "ensure", lambda device, threads=None, scope=(): (None, False))
    monkeypatch.setattr(dtensor, "ensure", lambda cfgs, threads=None: seen.append(cfgs) or "measured")
    assert run_mod.auto("cpu", threads=1, cfgs=(RunConfig(), TP2)) == "measured"
    assert seen == [(RunConfig(), TP2)]


@pytest.mark.parametrize("reading", [{"forward": -2e-6, "backward": 4e-5, "plain": 3e-5}, {}])
def test_a_reading_at_or_below_zero_or_none_is_not_cached(monkeypatch, reading):
    """A stall of the plain side (the sharded update's extra time negative) or a plan that dispatched nothing:
    said, not cached (every later estimate would price DTensor with it), and measured again next time."""
    monkeypatch.setattr(dtensor, "measure", lambda seconds=dtensor.SECONDS: dict(reading))
    monkeypatch.setattr(dtensor_collective, "measure", lambda samples=0: 4e-4)
    save(stub_calibration())
    said = dtensor.ensure((TP2,), threads=1)
    assert "implausible" in said and "not cached" in said
    assert not load_cached("cpu", 1).dtensor_seconds


def test_fsdp2s_host_work_is_timed_without_the_optimizer_step():
    # the step's ops on DTensor parameters are priced per op (formula/dtensor.py "plain"): the per-collective figure
    # leaves the step's CPU time out, else FSDP2 beside TP or PP paid them twice
    import types

    import torch

    model = torch.nn.Linear(64, 64)
    trainer = types.SimpleNamespace(optimizer=torch.optim.AdamW(model.parameters(), foreach=False))
    spent = fsdp_host._timed_step(trainer)
    before = model.weight.detach().clone()
    model(torch.randn(8, 64)).sum().backward()
    assert spent == [0.0]
    trainer.optimizer.step()
    assert spent[0] > 0 and not torch.equal(model.weight, before)  # timed, and the step still ran
