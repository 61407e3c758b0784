"""``fit --report DIR``: fit-report.md and a self-contained fit-report.html from one list of blocks.  Under
``--ac auto`` they hold the plan ``--json`` names, every frontier row, the global batch line, the provenance of
every figure, the frontier plot (the PNG ``--plot`` writes) and the verification or why there is none."""
from __future__ import annotations

import base64
import io
import json
import re

import pytest
from typer.testing import CliRunner

from batchlab.cli import app
from batchlab.config import RunConfig, preset
from batchlab.util.units import fmt_bytes

runner = CliRunner()
PNG = b"\x89PNG\r\n\x1a\n"
BUDGET = 80 * 2**20
AUTO = ["fit", "--ac", "auto", "--layers", "8", "--micro-batch", "8", "--memory-budget", "80MiB", "--margin", "0"]


def _text(md: str) -> str:
    """Markdown as read: the backslash escapes of markup characters removed."""
    return re.sub(r"\\(.)", r"\1", md)


def _rows(md: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in _text(md).splitlines()
            if line.startswith("|") and not line.startswith("|---")]


@pytest.fixture(scope="module")
def auto(tmp_path_factory):
    d = tmp_path_factory.mktemp("fit-report")
    with pytest.MonkeyPatch.context() as mp:  # the built-in rates: the plan must not hang on another test's calibration
        mp.setenv("XDG_CACHE_HOME", str(d / "empty-cache"))
        r = runner.invoke(app, AUTO + ["--no-verify", "--json", "--plan-out", str(d / "plan.json"),
                                       "--plot", str(d / "frontier.png"), "--report", str(d / "report")])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), r, d


def test_the_report_says_where_it_went_and_json_stays_clean(auto):
    d, r, folder = auto
    report = folder / "report"
    assert f"report: {report / 'fit-report.md'}" in r.stderr and f"report: {report / 'fit-report.html'}" in r.stderr
    assert sorted(p.name for p in report.iterdir()) == ["fit-report-frontier.png", "fit-report.html", "fit-report.md"]


def test_the_markdown_holds_the_plan_the_frontier_and_the_global_batch(auto):
    d, _, folder = auto
    md = (folder / "report" / "fit-report.md").read_text()
    text = _text(md)
    plan = d["plan"]
    assert f"--ac {d['final']['ac']} at micro-batch 8" in text
    # 8 sequences per update, micro-batch held at 8, DP 1: accum 1
    assert "global batch = micro-batch x accum x DP = 8 x 1 x 1 = 8 sequences" in text
    assert "memory per rank: 80.00 MiB (--memory-budget), safety margin 0%" in text
    rows = _rows(md)
    # the per-layer table, runs of one policy expanded back, is the JSON's per_layer
    layers = []
    for span, policy, count in (r for r in rows if re.fullmatch(r"\d+(-\d+)?", r[0])):
        lo, _, hi = span.partition("-")
        assert int(hi or lo) - int(lo) + 1 == int(count)
        layers += [policy] * int(count)
    assert layers == plan["per_layer"]
    # every frontier point is a row, with its peak and whether it fits 80 MiB
    frontier = [r for r in rows if len(r) == 7 and r[1] in ("plan", "preset")]
    assert len(frontier) == len(plan["frontier"])
    for p in plan["frontier"]:
        (row,) = [r for r in frontier if r[1] == p["kind"] and r[2] == p["ac"]]
        assert row[4] == fmt_bytes(p["peak_bytes"]) and row[6] == ("yes" if p["peak_bytes"] <= BUDGET else "no")
    (chosen,) = [r for r in frontier if r[0] == "*"]
    assert chosen[1:3] == ["plan", d["final"]["ac"]]
    best = plan["best_preset"]
    assert f"{best['ac']} at micro-batch 8: peak {fmt_bytes(best['peak_bytes'])}" in text
    assert f"predicted peak {fmt_bytes(plan['predicted_peak_bytes'])} [formula] within the budget 80.00 MiB" in text
    assert "peak (formula)" in text and "update (formula)" in text and "Model solved" in text
    assert plan["model_solved"] in text
    assert "Not measured: --no-verify was given." in text
    assert "![Figure 1: Activation checkpointing: memory vs update time (formula)](fit-report-frontier.png)" in text


def test_the_html_embeds_the_frontier_plot_that_plot_writes(auto):
    _, _, folder = auto
    page = (folder / "report" / "fit-report.html").read_text()
    (data,) = re.findall(r"src='data:image/png;base64,([^']+)'", page)
    png = base64.b64decode(data)
    assert png.startswith(PNG) and png == (folder / "frontier.png").read_bytes()
    import matplotlib.image

    assert matplotlib.image.imread(io.BytesIO(png)).shape[0] > 100  # a real image, not a stub
    assert "[formula]" in page and "global batch = micro-batch x accum x DP = 8 x 1 x 1 = 8" in page


def _goal():
    from batchlab.advise.plan import Goal

    base = RunConfig(model=preset("tiny", layers=8), seq=128, micro_batch=8, memory_budget=BUDGET)
    return Goal(base, margin=0.0, held=frozenset({"micro_batch"}))


@pytest.mark.parametrize("over, close", [(1.01, "yes"), (1.05, "no")])
def test_a_measured_plan_is_reported_against_its_prediction(tmp_path, uncalibrated, over, close):
    """The library call, no CLI: a (fake) allocator peak 1% or 5% above the plan's prediction."""
    from batchlab.advise.acfit import fit_auto
    from batchlab.advise.search import Trial, TrialOutcome
    from batchlab.formula import estimate
    from batchlab.cache.calibrations import load_all
    from batchlab.report.fit_document import write_fit_report

    def measure(cfg):
        return Trial(cfg.micro_batch, cfg.accum, True, TrialOutcome.OK,
                     int(estimate(cfg, load_all()).memory.peak_bytes * over))

    r = fit_auto(_goal(), verify=True, measure=measure, plan_out=str(tmp_path / "plan.json"))
    md, _ = write_fit_report(r, tmp_path / "out")
    planned, measured = r.ac_plan.chosen.allocated, r.verification.peak_bytes
    (row,) = [x for x in _rows(md.read_text()) if x[0] == "8 x 1"]
    # (planned - measured) / measured, by hand: 1/1.01 - 1 = -1.0%, 1/1.05 - 1 = -4.8%
    # "fits" against the budget the plan was made for (after a fallback: the budget re-planned below the first)
    assert row == ["8 x 1", "ok", fmt_bytes(measured), fmt_bytes(planned), f"{1 / over - 1:+.1%}", close,
                   "yes" if measured <= r.ac_plan.budget_bytes else "no"]


def test_no_plan_is_reported_without_a_figure(tmp_path):
    from batchlab.advise.acplan import ACPlan
    from batchlab.advise.fit import FitReport
    from batchlab.advise.plan import FitPlan
    from batchlab.report.fit_document import write_fit_report

    p = ACPlan(BUDGET, None, None, notes=["no plan fits 80.00 MiB at any micro-batch searched"])
    r = FitReport(FitPlan(_goal(), (), (), None, "no plan fits"), ac_plan=p, source="measured: no plan fits")
    md, page = write_fit_report(r, tmp_path, unmeasured="nothing was chosen to measure")
    text = _text(md.read_text())
    assert "No plan fits 80.00 MiB." in text and "nothing chosen: measured: no plan fits" in text
    assert "Not measured: nothing was chosen to measure." in text and "no plan fits 80.00 MiB at any" in text
    assert "data:image/png" not in page.read_text() and not list(tmp_path.glob("*.png"))


def test_plain_fit_reports_its_pick_and_after_oom_warns_it_is_ignored(tmp_path, uncalibrated):
    r = runner.invoke(app, ["fit", "--global-batch", "16", "--memory-budget", "80MiB", "--no-verify",
                            "--report", str(tmp_path)])
    assert r.exit_code == 0, r.output
    text = _text((tmp_path / "fit-report.md").read_text())
    chosen = re.search(r"chosen \(formula\): global batch = micro-batch x accum x DP = (\d+) x (\d+) x 1 = 16 "
                       "sequences", text)
    assert chosen and int(chosen[1]) * int(chosen[2]) == 16
    assert f"| -> | {chosen[1]} x {chosen[2]} x 1 |" in text and "peak (formula)" in text
    r = runner.invoke(app, ["fit", "--after-oom", "--micro-batch", "16", "--global-batch", "16", "--memory-budget",
                            "80MiB", "--report", str(tmp_path / "oom")])
    assert "warning: ignored: --report" in r.stderr and not (tmp_path / "oom").exists()


def test_a_report_path_that_is_a_file_is_a_one_line_error(tmp_path, uncalibrated):
    (tmp_path / "taken").write_text("")
    r = runner.invoke(app, AUTO + ["--no-verify", "--plan-out", str(tmp_path / "plan.json"),
                                   "--report", str(tmp_path / "taken")])
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: report:"), r.output
    assert "not a directory" in lines[0] and not (tmp_path / "plan.json").exists()  # checked before planning
