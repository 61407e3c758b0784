"""Progress on long work: shown on a terminal, never when piped or with --json; fit's header comes before
its trials (issue 11, item 15)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import batchlab.advise as advise
from batchlab.advise import Trial
from batchlab.advise.search import TrialOutcome
from batchlab.cli import app
from batchlab.cli.progress import progress, shown

TERMINAL = {"FORCE_COLOR": "1"}  # rich treats both streams as terminals (what a person at a shell has)
FIT = ["fit", "--seq", "64", "--layers", "2", "--global-batch", "8", "--memory-budget", "64MiB", "--search"]


@pytest.fixture
def fake_measure(monkeypatch):
    """Isolated trials replaced by a deterministic answer: micro-batches up to 2 fit."""
    def isolated(capacity, timeout=None):
        def measure(cfg):
            fits = cfg.micro_batch <= 2
            return Trial(cfg.micro_batch, cfg.accum, fits, TrialOutcome.OK if fits else TrialOutcome.OOM_BUDGET,
                         2**20 * cfg.micro_batch if fits else None)
        return measure
    monkeypatch.setattr(advise, "isolated_measure", isolated)


def test_fit_on_a_terminal_shows_trial_k_of_n_after_the_header(fake_measure):
    r = CliRunner().invoke(app, FIT, env=TERMINAL)
    assert r.exit_code == 0, r.output
    # each finished trial stays as a line above the display: k of the budget ceil(log2 8) + 2
    assert "trial 1/5: micro-batch" in r.stderr and "trial 3 of at most 5" in r.stderr
    out = r.output  # stdout and stderr in the order written
    assert out.index("batchlab fit") < out.index("trial 1") < out.index("chosen")


@pytest.mark.parametrize("env, extra", [({}, []), (TERMINAL, ["--json"])])
def test_fit_piped_or_json_is_quiet(fake_measure, env, extra):
    r = CliRunner().invoke(app, FIT + extra, env=env)
    assert r.exit_code == 0, r.output
    assert "trial" not in r.stderr
    if extra:
        json.loads(r.stdout)  # nothing but the JSON


def test_progress_yields_nothing_when_quiet_or_piped():
    with progress("x", quiet=True) as bar:
        assert bar is None
    code = "from batchlab.cli.progress import shown; print(shown())"
    piped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert piped.stdout.strip() == "False"


def test_progress_on_a_terminal_counts(monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert shown() and not shown(quiet=True)
    with progress("compare", "side A", total=6) as bar:
        bar(3, 6, "round 2 of 3")
        assert bar._bar.tasks[0].completed == 3 and bar._bar.tasks[0].description == "round 2 of 3"


def test_fit_over_layouts_counts_trials_of_the_layout_measured(fake_measure, monkeypatch):
    """fit --world-size measures the pick's layout: its bar's 'at most N' is the search's own budget for that layout
    (sequences per rank over the pick's DP degree), not the base config's (DP 1)."""
    reports = []
    real = advise.fit
    monkeypatch.setattr(advise, "fit", lambda *a, **k: reports.append(real(*a, **k)) or reports[-1])
    r = CliRunner().invoke(app, ["fit", "--model", "llama-2-7b", "--seq", "4096", "--global-batch", "64", "--device",
                                 "a100-80gb", "--precision", "bf16-mixed", "--world-size", "8", "--search"],
                           env=TERMINAL)
    assert r.exit_code == 0, r.output
    report = reports[0]
    assert report.final.dp > 1  # a layout whose DP differs from the base's
    budget = report.search.budget
    assert f"trial 1/{budget}: micro-batch" in r.stderr and f"of at most {budget}" in r.stderr
    # the base's budget, by hand: 64 sequences on its one rank, ceil(log2 64) + 2
    assert budget != 8 and "of at most 8" not in r.stderr
