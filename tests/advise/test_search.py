"""The measured search: same answer as an exhaustive sweep, within ceil(log2(max)) + 2 trials, OOMs as data."""
from __future__ import annotations

import math
import os
import signal

import pytest

from batchlab.advise import Goal, Trial, fit, isolated_measure, max_trials, search_largest, trial_from_measurement
from batchlab.advise.plan import divisors
from batchlab.advise.search import TrialOutcome
from batchlab.config.phase import Phase
from batchlab.config import RunConfig, preset
from batchlab.measure.result import MeasuredMemory, Measurement, Outcome


def base(per_rank: int, **kw) -> RunConfig:
    values = dict(model=preset("tiny", layers=2), seq=16, micro_batch=1, accum=per_rank)
    values.update(kw)
    return RunConfig(**values)


class Fake:
    """Deterministic stand-in for an isolated run: micro-batches up to ``limit`` fit; counts calls."""

    def __init__(self, limit: int, per_sample: int = 1000):
        self.limit, self.per_sample, self.calls = limit, per_sample, []

    def __call__(self, cfg: RunConfig) -> Trial:
        self.calls.append(cfg.micro_batch)
        assert cfg.micro_batch * cfg.accum * cfg.dp == cfg.global_batch  # the global batch never drifts
        fits = cfg.micro_batch <= self.limit
        return Trial(cfg.micro_batch, cfg.accum, fits, TrialOutcome.OK if fits else TrialOutcome.OOM_BUDGET,
                     cfg.micro_batch * self.per_sample if fits else None)


@pytest.mark.parametrize("per_rank", [1, 6, 12, 36, 64, 96, 100])
def test_search_matches_exhaustive_within_the_trial_budget(per_rank):
    cands = divisors(per_rank)
    for limit in [0] + cands:  # 0: nothing fits
        reference = max((d for d in cands if d <= limit), default=None)  # what a sweep of every divisor finds
        for seed in [None] + cands:
            fake = Fake(limit)
            r = search_largest(base(per_rank), fake, seed)
            assert r.limit == reference
            assert len(fake.calls) == len(set(fake.calls)) == r.trial_count
            assert r.trial_count <= math.ceil(math.log2(per_rank)) + 2 == max_trials(per_rank)


def test_a_right_seed_takes_two_trials():
    fake = Fake(limit=8)
    r = search_largest(base(64), fake, seed=8)
    assert fake.calls == [8, 16] and r.limit == 8


def test_known_verification_counts_and_is_not_repeated():
    fake = Fake(limit=4)
    known = Trial(16, 4, False, TrialOutcome.OOM_BUDGET)
    r = search_largest(base(64), fake, seed=16, known=[known])
    assert 16 not in fake.calls and r.limit == 4
    assert r.trial_count == len(fake.calls) + 1 <= max_trials(64)


def _measurement(outcome: Outcome, detail: str = "", peak: int | None = None) -> Measurement:
    mem = MeasuredMemory(peak, 0, Phase.BACKWARD) if peak is not None else None
    return Measurement(config={}, outcome=outcome, global_batch=8, outcome_detail=detail, memory=mem)


def test_trial_from_measurement_reads_every_kind_of_out_of_memory():
    cfg = base(8)
    killed = trial_from_measurement(cfg, _measurement(Outcome.FAILED, "worker killed by SIGKILL during memory"), 100)
    assert (killed.fits, killed.outcome, killed.out_of_memory) == (False, TrialOutcome.OOM_KILLED, True)
    budget = trial_from_measurement(cfg, _measurement(Outcome.OOM_BUDGET, "over"), 100)
    assert not budget.fits and budget.out_of_memory
    over = trial_from_measurement(cfg, _measurement(Outcome.OK, peak=101), 100)
    assert (over.fits, over.outcome) == (False, TrialOutcome.OVER_CAPACITY)
    ok = trial_from_measurement(cfg, _measurement(Outcome.OK, peak=100), 100)
    assert ok.fits and ok.peak_bytes == 100
    crash = trial_from_measurement(cfg, _measurement(Outcome.FAILED, "ValueError in forward"), 100)
    assert not crash.fits and not crash.out_of_memory


def test_fit_searches_when_the_recommendation_runs_out_of_memory():
    cfg = base(64, seq=64, memory_budget=400 * 2**20)  # the formula lets micro-batch 64 fit in 400 MiB
    goal = Goal(cfg, min_micro_tokens=64 * 64)
    fake = Fake(limit=16, per_sample=2**20)  # reality: only up to 16, each sample 1 MiB
    report = fit(goal, verify=True, measure=fake)
    rec = report.plan.recommended.config
    assert report.verification.micro_batch == rec.micro_batch == 64 and not report.verification.fits
    assert report.search.limit == 16 and report.final.micro_batch == 16  # 16 MiB is well within the margin
    assert report.final.global_batch == 64 and report.final.ac == rec.ac
    assert report.search.trial_count == len(fake.calls) <= max_trials(64)
    assert report.advice and report.advice[0].change.startswith("halve the micro-batch")
    lim = report.limits()
    assert lim["predicted_limit"] == 64 and lim["measured_limit"] == 16


def test_fit_steps_below_a_measured_limit_that_leaves_no_margin():
    cfg = base(64, seq=64, memory_budget=400 * 2**20)
    fake = Fake(limit=16, per_sample=int(400 * 2**20 * 0.95 / 16))  # micro-batch 16 uses 95% of the budget
    report = fit(Goal(cfg, min_micro_tokens=64 * 64), verify=True, measure=fake)
    assert report.search.limit == 16 and report.final.micro_batch == 8 and report.final.accum == 8


def test_fit_confirms_without_searching_when_the_recommendation_fits():
    fake = Fake(limit=64, per_sample=1)
    report = fit(Goal(base(64, seq=64), min_micro_tokens=64 * 64), verify=True, measure=fake)
    assert fake.calls == [report.plan.recommended.config.micro_batch] and report.search is None
    assert report.source == "formula, confirmed by measurement"


# ------------------------------------------------------------------------------- real isolated runs

def kill_above_two(cfg):
    """A factory whose batches kill their own process above micro-batch 2: the kernel OOM killer's SIGKILL."""
    from batchlab.models.gpt import GPT
    from batchlab.models import synthetic_tokens

    model = GPT(cfg.model)
    make = synthetic_tokens(cfg.model.vocab, cfg.data)

    def make_batch(gen, micro_batch, seq, device):
        if micro_batch > 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return make(gen, micro_batch, seq, device)

    return model, make_batch, lambda m, tokens, targets: m(tokens, targets, loss_sum=True)


@pytest.mark.slow
def test_kernel_oom_kill_is_a_data_point_not_a_crash():
    cfg = base(8, model_source=f"{__name__}:kill_above_two")
    r = search_largest(cfg, isolated_measure(cfg.memory_capacity), seed=4)
    assert [t.micro_batch for t in r.trials] == [4, 2]
    assert r.trials[0].outcome is TrialOutcome.OOM_KILLED and r.trials[1].fits
    assert r.limit == 2
