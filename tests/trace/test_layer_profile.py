"""A layer profile (the calculator's layer terms traced from the model's own code) against a real run's live
tensors: one family profiled once for the module, then predictions at a shape that was not profiled."""
from __future__ import annotations

import json

import pytest

from batchlab.formula import estimate as formula_estimate
from batchlab.run import measure as run
from batchlab.trace import estimate as trace_estimate
from hf_shapes import FAST, config_dir, hf_cfg, rel

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One family, profiled once (fp32) for the three AC policies the tests below take: the calculator's layer
    terms from the model's own code."""
    from batchlab.config.profile import MODES
    from batchlab.trace.profile import with_profile

    folder = config_dir(tmp_path_factory.mktemp("hf"), "falcon")
    return with_profile(hf_cfg(folder), policies=MODES)


@pytest.mark.slow  # profiling takes 10-25 s on 2 loaded cores
@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_profiled_formula_and_trace_match_a_real_run(profiled, ac):
    cfg = profiled.replace(ac=ac, seq=80, micro_batch=4)  # not a profiled shape
    m = run(cfg, FAST)
    assert m.ok, m.outcome_detail
    tr, est = trace_estimate(cfg).memory, formula_estimate(cfg)
    assert est.layer_terms.startswith("profile (trace of 1 and 2 blocks")
    assert est.to_dict()["layer_terms"] == est.layer_terms
    assert rel(tr.peak_bytes, m.memory.peak_bytes) <= 0.005
    assert rel(tr.activations_bytes, m.memory.activations_bytes) <= 0.005
    assert rel(est.memory.peak_tensor_bytes, m.memory.peak_bytes) <= 0.03
    assert rel(est.memory.activations_bytes, m.memory.activations_bytes) <= 0.03
    assert est.params.total == sum(p.numel() for p in _model(cfg).parameters())


def _model(cfg):
    from batchlab.models import build_workload

    return build_workload(cfg).model


@pytest.mark.slow
def test_profile_is_cached_and_stale_for_another_shape(profiled):
    from batchlab.cache.profiles import cached

    assert cached(profiled) == profiled.model.profile
    wider = profiled.replace(hidden=128)
    assert wider.model.matching_profile is None
    assert formula_estimate(wider).layer_terms.startswith("builtin")
    json.dumps(profiled.to_dict())  # the profile travels with the config (subprocesses, the notebook)


@pytest.mark.slow  # one policy traced, ~3 s on 2 cores
def test_a_policy_is_traced_when_first_needed_and_merges_to_the_all_at_once_profile(profiled, tmp_path, monkeypatch):
    """A profile that holds AC none's terms only (the fixture's, the other policies taken out), then a --vary ac=...
    table that needs AC full's too: only that policy is traced, into the same cache entry, every row has profile
    terms, and they are those of the fixture's profile, traced with all three policies at once."""
    from dataclasses import replace

    from typer.testing import CliRunner

    from batchlab.cli import app
    from batchlab.cache.profiles import cached, save
    from batchlab.trace import profile as tracing

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # not the fixture's cache entry
    reference = profiled.model.profile
    only_none = {f: None for f in _fields() if f.endswith(("_selective", "_checkpointed"))}
    save(replace(reference, terms=(replace(reference.terms[0], **only_none),), seconds="fp32 full: 1 s"))
    traced, measure = [], tracing._measure
    monkeypatch.setattr(tracing, "_measure", lambda cfg, layers, precision, mode, *a, **k:
                        traced.append(mode) or measure(cfg, layers, precision, mode, *a, **k))

    r = CliRunner().invoke(app, ["estimate", "--model", profiled.model_source, "--seq", "64", "--micro-batch", "2",
                                 "--vary", "ac=none,full,every:2", "--json"])
    assert r.exit_code == 0, r.output
    assert traced == ["full", "full"]  # P and 2P layers, the whole block recomputed: AC full's, every:2's first layer
    assert [row["layer_terms"].startswith("profile (") for row in json.loads(r.stdout)] == [True] * 3
    merged = cached(profiled).terms[0]
    assert merged.policies == {"full", "checkpointed"} and cached(profiled).seconds.startswith("fp32 full: 1 s; fp32 checkpointed: ")
    assert {f: getattr(merged, f) for f in _fields() if "selective" not in f} == \
        {f: getattr(reference.terms[0], f) for f in _fields() if "selective" not in f}


def _fields() -> list[str]:
    from dataclasses import fields

    from batchlab.config.profile import Terms

    return [f.name for f in fields(Terms)]
