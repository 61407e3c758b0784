"""A Hugging Face model's own dispatch per op (calibrate/family.py): measured against batchlab's GPT on this
CPU, cached with the calibration, and priced by the time model for that model's code only."""
from __future__ import annotations

import statistics
import time

import pytest
import torch

from batchlab.calibrate import family, load_cached, save
from batchlab.calibrate import run as run_mod
from batchlab.config import RunConfig, preset
from batchlab.formula.opcost import OpCosts
from batchlab.config.phase import Phase
from batchlab.formula.timing import costs_for, dispatch_family

from hosts import stub_calibration

pytestmark = pytest.mark.usefixtures("private_cache")  # its stub calibrations stay its own

GPT2 = RunConfig(model=preset("gpt2", layers=2, hidden=64, heads=4, vocab=256, max_positions=64),
                 model_source="hf:gpt2", seq=32, micro_batch=1)
DISPATCH = {"forward": 5e-6, "backward": 4e-6, "plain": 3e-6, "forward-sac": 4e-5, "recompute-sac": 3e-5}
AUTOCAST = {"forward": 9e-6, "backward": 7e-6, "plain": 3e-6}


def costs(**kw) -> OpCosts:
    return OpCosts(matmul={"fp32": ((1e3, 5e10), (1e12, 5e10))}, memory=((1.0, 6e9), (1e9, 6e9)),
                   strided_bytes_per_s=3e9, element_seconds={}, dispatch=DISPATCH, dispatch_autocast=AUTOCAST, **kw)


def test_a_models_own_ratios_price_its_ops_and_no_other_models():
    own = {dispatch_family(GPT2): {"forward": 2.0, "backward": 0.5}}
    priced = costs_for(GPT2, costs(family_dispatch=own))
    # by hand: forward 5 us x 2; backward 4 us x 0.5; the difference on every kind its forward code runs in
    assert priced.dispatch_seconds(Phase.FORWARD) == pytest.approx(10e-6)
    assert priced.dispatch_seconds(Phase.RECOMPUTE) == pytest.approx(10e-6)
    assert priced.dispatch_seconds(Phase.BACKWARD) == pytest.approx(2e-6)
    assert priced.dispatch_seconds(Phase.OPTIMIZER) == pytest.approx(3e-6)  # the harness's and torch's ops
    assert priced.dispatch_seconds(Phase.FORWARD, sac_dispatched=True) == pytest.approx(45e-6)
    assert "hf:gpt2's own dispatch per op (backward x0.50, forward x2.00" in priced.source
    mixed = costs_for(GPT2.replace(precision="bf16-mixed"), costs(family_dispatch=own))
    assert mixed.dispatch_seconds(Phase.FORWARD) == pytest.approx(9e-6 + 5e-6)  # autocast's own + the model's
    for other in (RunConfig(seq=32, micro_batch=1), GPT2.replace(model_source="hf:llama-2-7b")):
        assert costs_for(other, costs(family_dispatch=own)).dispatch_seconds(Phase.FORWARD) == pytest.approx(5e-6)


def test_the_family_key_names_the_code_and_its_version():
    from importlib import metadata

    assert dispatch_family(RunConfig()) is None  # batchlab's GPT: the calibration's own trainer
    assert dispatch_family(GPT2.replace(model_source="batchlab.models.gpt:make")) is None  # a factory's model
    key = dispatch_family(GPT2)
    assert key.startswith("hf:gpt2 attention=") and metadata.version("transformers") in key


def test_the_model_is_shrunk_to_dispatch_bound_sizes_with_its_code_kept():
    llama = RunConfig(model=preset("llama-2-7b", layers=2, hidden=128, heads=4, kv_heads=2, ffn=352, vocab=1024,
                                   max_positions=512), model_source="hf:llama-2-7b", seq=128, micro_batch=4)
    small = family.dispatch_bound(llama)
    m = small.model
    assert (m.layers, m.hidden, m.vocab, small.seq, small.micro_batch) == (2, 16, 32, 8, 1)
    assert m.kv_heads < m.heads and m.mlp is llama.model.mlp and m.norm is llama.model.norm  # grouped, SwiGLU, RMS
    assert small.model_source == "hf:llama-2-7b" and dispatch_family(small) == dispatch_family(llama)


@pytest.mark.slow
def test_hf_gpt2s_forward_costs_more_per_op_than_batchlabs_gpt_as_a_direct_timing_says():
    """family.measure (phase clock, work priced out, medians of per-op figures) against a direct timing of
    the two dispatch-bound models' forward calls, alternated, by CPU time: HF GPT-2's forward per op over
    batchlab's GPT's (measured 1.8-2.0 here; its backward 0.8-1.1)."""
    from batchlab.calibrate.dispatch import DISPATCH_GPT, counted, per_kind
    from batchlab.formula.timing import nominal_costs

    torch.set_num_threads(1)
    ratios = family.measure(GPT2, nominal_costs(GPT2), seconds=0.6)
    assert 1.2 < ratios["forward"] < 4 and 0.4 < ratios["backward"] < 2.5
    runs = [counted(cfg, torch.device("cpu")) for cfg in (DISPATCH_GPT, family.dispatch_bound(GPT2))]
    inputs = [trainer.batches()[0] for trainer, _ in runs]
    times: list[list[float]] = [[], []]
    with torch.no_grad():  # the forward's own code; autograd's recording is the same per op in both
        for _ in range(60):
            for i, (trainer, _) in enumerate(runs):
                t = time.thread_time()
                trainer.workload.loss_sum(trainer.model, *inputs[i])
                times[i].append(time.thread_time() - t)
    per_op = [statistics.median(times[i]) / per_kind(ops)["forward"] for i, (_, ops) in enumerate(runs)]
    assert ratios["forward"] == pytest.approx(per_op[1] / per_op[0], rel=0.4)


def test_ensure_measures_once_caches_with_the_calibration_and_says_so(monkeypatch):
    calls = []
    monkeypatch.setattr(family, "measure", lambda cfg, costs, seconds=family.SECONDS: calls.append(cfg) or
                        {"forward": 1.8, "backward": 1.1})
    assert family.ensure(GPT2, threads=1) is None  # no calibration cached: nothing to scale
    save(stub_calibration())
    line = family.ensure(GPT2, threads=1)
    assert "hf:gpt2's own dispatch per op" in line and "forward x1.80, backward x1.10" in line
    assert load_cached("cpu", 1).family_dispatch == {dispatch_family(GPT2): {"forward": 1.8, "backward": 1.1}}
    assert family.ensure(GPT2, threads=1) is None and len(calls) == 1  # cached: measured once
    assert family.ensure(RunConfig(), threads=1) is None and len(calls) == 1  # batchlab's GPT: nothing to measure


@pytest.mark.parametrize("measured", [{"forward": 1e7, "backward": 1.1}, {"forward": 1.8, "backward": 0.001}])
def test_an_implausible_fresh_ratio_is_flagged_and_not_cached(monkeypatch, measured):
    """A ratio no model code has (x0.05..x50) is what a stalled run measures: the plausibility check names it
    and nothing is cached (a clamped x50 would have been cached and priced, the check never firing)."""
    monkeypatch.setattr(family, "measure", lambda cfg, costs, seconds=family.SECONDS: measured)
    save(stub_calibration())
    line = family.ensure(GPT2, threads=1)
    kind = "forward" if measured["forward"] > 50 else "backward"
    assert "measured implausible" in line and f"own dispatch {kind} x{measured[kind]!r} outside x0.05..x50" in line
    assert "batchlab's GPT's serves" in line and load_cached("cpu", 1).family_dispatch == {}


def test_a_model_whose_code_refuses_the_small_shape_is_priced_with_batchlabs_gpt_and_said(monkeypatch):
    def refuse(cfg, costs, seconds=family.SECONDS):
        raise ValueError("head_dim must be even")

    monkeypatch.setattr(family, "measure", refuse)
    save(stub_calibration())
    line = family.ensure(GPT2, threads=1)
    assert "not measured (head_dim must be even); batchlab's GPT's serves" in line
    assert load_cached("cpu", 1).family_dispatch == {}


def test_auto_measures_the_compared_models_own_dispatch(monkeypatch):
    seen = []
    monkeypatch.setattr(run_mod, "ensure", lambda device, threads=None, scope=(): (None, False))
    monkeypatch.setattr(family, "ensure", lambda cfg, threads=None: seen.append((cfg, threads)) or "measured")
    assert run_mod.auto("cpu", threads=1, cfgs=(GPT2, GPT2, GPT2.replace(seq=64))) == "measured\nmeasured"
    assert [t for _, t in seen] == [1, 1]
