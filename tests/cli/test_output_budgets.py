"""Each command's default output fits a screen at 120 columns, and --verbose shows what the default leaves out
(it is also kept in --json).  Budgets: compare <= 45 lines, estimate <= 40, measure <= 40, fit <= 45.

Counted: every line a person sees (stdout and stderr), as rich wraps them at 120 columns (``COLUMNS=120``:
``cli.common.console`` then takes the environment's width).  Cheap settings keep the file fast: compare measures
through a fake with known figures, measure runs 2 timed updates, fit verifies once in its subprocess."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from batchlab.cli import app
from fake_measure import FakeMeasure

WIDTH = 120
LLAMA_H100 = ("--model", "llama-3-8b", "--seq", "8192", "--dp", "8", "--zero", "3", "--precision", "bf16-mixed",
              "--device", "h100")
# does not fit as transformers' Llama: one more line names the --impl it fits under
LLAMA13B_A100 = ("--model", "llama-2-13b", "--seq", "4096", "--micro-batch", "2", "--dp", "64", "--zero", "3",
                 "--precision", "bf16-fsdp", "--ac", "none", "--device", "a100-80gb")


def run(*args: str) -> str:
    """Everything the command printed (stdout and stderr interleaved, as a terminal shows them)."""
    r = CliRunner().invoke(app, list(args), env={"COLUMNS": str(WIDTH)})
    assert r.exit_code == 0, r.output
    return r.output


def fits(text: str, budget: int) -> None:
    lines = text.splitlines()
    assert len(lines) <= budget, f"{len(lines)} lines > {budget}:\n{text}"
    assert max(map(len, lines)) <= WIDTH, "a line wider than the screen"


# ------------------------------------------------------------------------------------------------ estimate

@pytest.mark.parametrize("args", [(), LLAMA_H100, LLAMA13B_A100, ("--vary", "micro_batch=1,2,4,8"), ("--trace",)],
                         ids=["default", "llama-3-8b-h100", "llama-2-13b-a100-impl-hint", "vary", "trace"])
def test_estimate_fits_40_lines(args):
    fits(run("estimate", *args), 40)


def test_estimate_verbose_shows_the_assumptions_and_full_sources_the_default_leaves_out():
    short, full = run("estimate", *LLAMA_H100), run("estimate", *LLAMA_H100, "--verbose")
    # short source names by default; the citation (an issue number) and the time model's rates under --verbose
    assert "NVIDIA datasheet" in short and "PyTorch-reported" in short
    for cut in ("nanochat#443", "time model: per-op sum over", "communication: FSDP2", "cuBLAS workspace",
                "sources: batchlab docs, Sources page"):
        assert cut not in short and cut in " ".join(full.split()), cut
    # memory-bound work on a GPU is priced at the card's HBM bandwidth (3.35 TB/s on an H100 SXM), shown as a rate
    assert "memory-bound ops at 3.35 TB/s" in " ".join(full.split())
    for text in (short, full, run("estimate", *LLAMA_H100, "--json")):
        assert "e+18" not in text and "e+30" not in text
    # --json keeps every assumption, as before
    d = json.loads(run("estimate", *LLAMA_H100, "--json"))
    assert any(a.startswith("time model: per-op sum over") for a in d["assumptions"])


def test_trace_verbose_shows_the_time_models_rates():
    assert "time model: per-op sum over" not in run("estimate", "--trace", "--seq", "32")
    assert "time model: per-op sum over" in run("estimate", "--trace", "--seq", "32", "--verbose")


# ------------------------------------------------------------------------------------------------ compare

class FirstIsA(FakeMeasure):
    """The CLI builds the sides itself: the protocol measures side A first."""

    def __call__(self, cfg, options):
        if self.a is None:
            self.a = cfg
        return super().__call__(cfg, options)


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """The default compare (built-in model, micro-batch 1 -> 2 at the kept global batch), measured by a fake
    whose time ratios contradict the formula (so the diagnosis shows), then its record shown both ways."""
    from batchlab.experiment import protocol

    fake = FirstIsA((None, None), peak=(1000, 1500), times=((1.0, 1.02), (1.1, 1.0), (1.0, 1.05)))
    nb = tmp_path_factory.mktemp("budget") / "nb.sqlite"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(protocol, "default_measure", fake)
        default = run("compare", "--no-calibrate", "--notebook", str(nb))
    return default, run("notebook", "show", "1", "--notebook", str(nb), "--verbose")


def test_compare_fits_45_lines(compared):
    default, _ = compared
    assert "verdict" in default and "diagnosis" in default and "scope" in default
    fits(default, 45)


def test_compare_verbose_shows_the_protocol_time_model_checks_and_semantics_table(compared):
    default, full = compared
    for cut in ("band: range (min, max) of the per-round paired ratios", "formula A: time model: per-op sum over",
                "1. ok Is warmup inside the timed window?", "verified by the harness"):
        assert cut not in " ".join(default.split()) and cut in " ".join(full.split()), cut


# ------------------------------------------------------------------------------------------------ measure

@pytest.fixture(scope="module")
def measured():
    """One real measurement of the default config, shown by default and (the same measurement) verbose."""
    import batchlab.run

    real, kept = batchlab.run.measure, []

    def measure(cfg, opts, **kw):
        kept.append(real(cfg, opts, **kw))
        return kept[-1]

    args = ("measure", "--steps", "2", "--warmup", "1", "--no-calibrate")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batchlab.run, "measure", measure)
        default = run(*args)
        mp.setattr(batchlab.run, "measure", lambda cfg, opts, **kw: kept[0])
        return default, run(*args, "--verbose")


def test_measure_fits_40_lines(measured):
    fits(measured[0], 40)


def test_measure_verbose_shows_cpu_time_allocator_and_the_formulas_assumptions(measured):
    default, full = measured
    for cut in ("process CPU time per update", "formula assumptions", "time model: per-op sum over",
                "live storage tracker"):
        assert cut not in " ".join(default.split()) and cut in " ".join(full.split()), cut


# ------------------------------------------------------------------------------------------------ fit

def test_fit_fits_45_lines_and_verbose_prints_the_settings_and_assumptions():
    default = run("fit")  # verified once in an isolated subprocess, as by default
    assert "Measured (isolated subprocess each)" in default
    fits(default, 45)
    full = run("fit", "--no-verify", "--verbose")
    for cut in ("[config]", "per_device_train_batch_size", "ranked by predicted time to", "time model: per-op sum over"):
        assert cut not in default and cut in " ".join(full.split()), cut
