"""Knobs the user fixed stay fixed through plan, measurement and search (issue 11, item 16)."""
from __future__ import annotations

import pytest

from batchlab.advise import Goal, Trial, fit
from batchlab.advise.search import TrialOutcome
from batchlab.config import ACPolicy, ConfigError, RunConfig, preset

# The case: 64 MiB, global batch 16, --ac none typed; fit planned and searched with full checkpointing.
CFG = RunConfig(model=preset("tiny", layers=2), seq=64, micro_batch=1, accum=16, memory_budget=64 * 2**20)


class Recorder:
    """Every configuration measured; micro-batches up to ``limit`` fit."""

    def __init__(self, limit: int):
        self.limit, self.seen = limit, []

    def __call__(self, cfg: RunConfig) -> Trial:
        self.seen.append(cfg)
        fits = cfg.micro_batch <= self.limit
        return Trial(cfg.micro_batch, cfg.accum, fits, TrialOutcome.OK if fits else TrialOutcome.OOM_BUDGET,
                     cfg.micro_batch * 2**20 if fits else None)


def test_search_measures_only_the_held_policy():
    m = Recorder(limit=4)
    r = fit(Goal(CFG, held=frozenset({"ac"})), verify=True, search=True, measure=m)
    assert m.seen and {str(c.ac) for c in m.seen} == {"none"}
    assert str(r.final.ac) == "none" and r.final.micro_batch == 4 and r.final.global_batch == 16


def test_search_is_free_to_pick_a_policy_when_none_is_held():
    plan_policies = {str(c.config.ac) for c in fit(Goal(CFG), verify=False).plan.candidates}
    assert {"none", "full", "selective"} <= plan_policies


def test_held_micro_batch_is_verified_not_searched():
    cfg = CFG.with_global_batch(16, 8)
    m = Recorder(limit=4)
    r = fit(Goal(cfg, held=frozenset({"micro_batch"})), verify=True, search=True, measure=m)
    assert [c.micro_batch for c in m.seen] == [8]  # one trial of the given micro-batch, no search
    assert r.final is None and r.exit_code == 1 and "held" in r.source
    ok = fit(Goal(cfg, held=frozenset({"micro_batch"})), verify=True, search=True, measure=Recorder(limit=8))
    assert ok.final.micro_batch == 8 and ok.search is None


def test_held_zero_wins_over_allow_zero_in_the_library():
    cfg = RunConfig(model=preset("tiny", layers=2), seq=64, micro_batch=1, accum=4, dp=4, zero=1)
    free = fit(Goal(cfg, allow_zero=True), verify=False).plan
    assert {c.config.zero for c in free.candidates} == {1, 2, 3}
    held = fit(Goal(cfg, allow_zero=True, held=frozenset({"zero"})), verify=False).plan
    assert {c.config.zero for c in held.candidates} == {1}


def test_unknown_knob_is_refused():
    with pytest.raises(ConfigError, match="held"):
        Goal(CFG, held=frozenset({"seq"}))


def test_held_policy_is_any_policy():
    cfg = CFG.replace(ac=ACPolicy.parse("every:2"))
    plan = fit(Goal(cfg, held=frozenset({"ac"})), verify=False).plan
    assert {str(c.config.ac) for c in plan.candidates} == {"every:2"}
