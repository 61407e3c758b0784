"""`batchlab compare` on the command line: bad input refused with nothing written, keep modes, predictions
(flag, file, prompt only on a terminal), verdicts from known measurements, and one real smoke run."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import batchlab.cli.compare as compare_cli
from batchlab.cli import app
from batchlab.experiment.notebook import Notebook
from batchlab.experiment.record import Record
from fake_measure import FakeMeasure

SMALL = ["--seq", "16", "--layers", "2", "--global-batch", "4"]
ISSUE_KEYS = {"config", "change", "keep_mode", "predictions", "metrics", "diagnosis", "semantics", "scope",
              "notebook_id"}
METRIC_KEYS = {"observed", "ratio", "band", "predicted_by_user", "predicted_by_formula", "held"}


def invoke(*args: str, input: str | None = None):
    return CliRunner().invoke(app, ["compare", *args], input=input)


@pytest.mark.parametrize("args, field", [
    (["--change", "colour=1:2"], "colour"),
    (["--change", "micro_batch=2:2"], "micro_batch"),
    (["--change", "precision=fp32:fp7"], "precision"),
    (["--change", "micro_batch=3:2"], "global_batch"),  # global batch 4 is not divisible by 3
    (["--change", "micro_batch=1:2", "--change", "ac=none:full"], "change"),  # confounded
    (["--change", "micro_batch"], "change"),
    (["--predict", "memory=sideways"], "predict"),
    (["--predict", "speed=up"], "predict"),
    (["--rounds", "2"], "rounds"),
    (["--keep", "everything"], "keep"),
    (["--steps", "0"], "steps"),
    (["--change", "ac=none:full", "--experiment", "x.toml"], "change"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, field):
    nb = tmp_path / "sub" / "nb.sqlite"
    r = invoke(*SMALL, *args, "--notebook", str(nb), "--json")
    assert r.exit_code == 2, r.output
    assert r.stdout == ""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}:"), lines
    assert not nb.exists() and not nb.parent.exists()


def formula_only(tmp_path, *args: str) -> dict:
    r = invoke(*SMALL, "--formula-only", "--notebook", str(tmp_path / "nb.sqlite"), "--json", *args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_default_change_keeps_the_global_batch_and_shows_the_derived_accum(tmp_path):
    d = formula_only(tmp_path)
    assert d["change"]["requested"] == [{"field": "micro_batch", "a": 1, "b": 2}]
    assert d["change"]["derived"] == {"accum": [4, 2]} and d["keep_mode"] == "global-batch"
    assert d["change"]["global_batch"] == {"a": 4, "b": 4}
    assert (d["sides"]["a"]["accum"], d["sides"]["b"]["accum"]) == (4, 2)
    assert d["warnings"] == []


def test_keep_accum_changes_the_global_batch_and_warns(tmp_path):
    d = formula_only(tmp_path, "--keep", "accum")
    assert d["change"]["derived"] == {} and d["change"]["global_batch"] == {"a": 4, "b": 8}
    assert any("learning rate, warmup and schedule" in w for w in d["warnings"])
    assert d["semantics"]["items"][0]["touched"]  # global batch


def test_formula_only_is_labelled_and_saved(tmp_path):
    d = formula_only(tmp_path, "--change", "ac=none:full", "--predict", "memory=down")
    assert d["kind"] == "formula-only" and d["notebook_id"] == 1
    assert all(m["observed"] is None for m in d["metrics"].values())
    assert d["metrics"]["peak_memory"]["held"] == {"user": None, "formula": None}
    # nothing was measured: every figure is the formula's, none labelled allocator or wall-clock
    assert {m["provenance"] for m in d["metrics"].values()} == {"formula"}
    stored = Notebook(tmp_path / "nb.sqlite").get(1)
    assert stored.status.value == "complete" and stored.kind.value == "formula-only"
    r = invoke(*SMALL, "--formula-only", "--change", "ac=none:full", "--notebook", str(tmp_path / "nb.sqlite"))
    assert "formula only (paper derivation, nothing measured)" in " ".join(r.stdout.split())
    assert "prediction (none)" not in r.stdout and "your prediction: none written down" in r.stdout
    assert "time model: per-op sum over" not in r.stdout  # the rates and their source: --verbose
    r = invoke(*SMALL, "--formula-only", "--change", "ac=none:full", "--notebook", str(tmp_path / "nb.sqlite"),
               "--verbose")
    text = " ".join(r.stdout.split())  # the time model's assumptions beside the prediction, each side
    assert "formula A: time model: per-op sum over" in text and "formula B: time model: per-op sum over" in text


def test_no_prompt_without_a_terminal_and_a_prompt_with_one(tmp_path, monkeypatch):
    d = formula_only(tmp_path)
    assert d["predictions"]["user"] == {} and d["predictions"]["user_source"] == "none"
    monkeypatch.setattr(compare_cli, "_interactive", lambda: True)
    r = invoke(*SMALL, "--formula-only", "--notebook", str(tmp_path / "nb.sqlite"), "--json", input="up\nsideways\ndown\n")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout[r.stdout.index("{"):])  # CliRunner echoes the typed answers to stdout
    assert d["predictions"]["user"] == {"peak_memory": "up", "update_time": "down"}
    assert "is not up, down or same" in r.stderr  # a bad answer is asked again
    assert d["predictions"]["user_source"] == "prompt"


def test_an_experiment_file_drives_the_command(tmp_path):
    f = tmp_path / "exp.toml"
    f.write_text('keep = "global-batch"\npredict = { memory = "down" }\n[config]\nseq = 16\nlayers = 2\n'
                 'global_batch = 8\n[change]\naccum = [2, 4]\n')
    d = formula_only(tmp_path, "--experiment", str(f))
    assert d["predictions"]["user"] == {"peak_memory": "down"} and d["predictions"]["user_source"] == "file"
    assert (d["sides"]["a"]["micro_batch"], d["sides"]["b"]["micro_batch"]) == (4, 2)
    assert d["change"]["derived"] == {"micro_batch": [4, 2]}


class FirstIsA(FakeMeasure):
    """FakeMeasure for the CLI, which builds the sides itself: the protocol measures side A first."""

    def __call__(self, cfg, options):
        if self.a is None:
            self.a = cfg
        return super().__call__(cfg, options)


def test_compare_verdicts_from_known_measurements(tmp_path, monkeypatch):
    from batchlab.experiment import protocol

    # per round, A and B medians: paired ratios B/A = 1.2, 1.5, 1.3 although A drifts 2x between rounds
    fake = FirstIsA((None, None), peak=(1000, 1500), times=((1.0, 1.2), (2.0, 3.0), (1.5, 1.95)))
    monkeypatch.setattr(protocol, "default_measure", fake)
    nb = tmp_path / "nb.sqlite"
    r = invoke(*SMALL, "--predict", "memory=up,time=same", "--no-verify", "--notebook", str(nb), "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert ISSUE_KEYS <= set(d) and d["schema"] == 3
    assert fake.calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert fake.timeline_asked == [("a", 0), ("b", 0)] and set(d["timelines"]) == {"a", "b"}
    t = d["metrics"]["update_time"]
    assert METRIC_KEYS <= set(t)
    assert t["paired_ratios"] == pytest.approx([1.2, 1.5, 1.3]) and t["ratio"] == pytest.approx(1.3)
    assert t["band"] == pytest.approx([1.2, 1.5]) and t["observed"] == "up"
    assert (t["a"], t["b"]) == (pytest.approx(1.5), pytest.approx(1.95))  # medians over rounds
    assert t["predicted_by_user"] == "same" and t["held"]["user"] is False
    mem = d["metrics"]["peak_memory"]
    assert (mem["ratio"], mem["band"], mem["observed"], mem["held"]["user"]) == (1.5, [1.5, 1.5], "up", True)
    # global batch kept (4 sequences of 16 tokens): tokens/s moves as 1 / update time
    tps = d["metrics"]["tokens_per_second"]
    assert tps["ratio"] == pytest.approx(1 / 1.3) and tps["a"] == pytest.approx(64 / 1.5)
    assert {"metric": "update_time", "who": "you", "predicted": "same", "observed": "up"} in d["diagnosis"]["contradictions"]
    row = Notebook(nb).get(d["notebook_id"])
    assert row.status.value == "complete" and row.to_dict()["metrics"] == d["metrics"]


@pytest.mark.slow
def test_compare_smoke_in_real_subprocesses(tmp_path):
    """The real path once: each side of each round measured in its own fresh subprocess (3 rounds x 2)."""
    nb = tmp_path / "nb.sqlite"
    r = invoke("--seq", "8", "--layers", "1", "--hidden", "32", "--heads", "2", "--global-batch", "2", "--steps", "1",
               "--warmup", "1", "--no-verify", "--notebook", str(nb), "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert ISSUE_KEYS <= set(d) and all(METRIC_KEYS <= set(m) for m in d["metrics"].values())
    assert len(d["rounds"]) == 3 and all(r["a"]["environment"]["isolated"] for r in d["rounds"])
    assert (d["sides"]["a"]["micro_batch"], d["sides"]["b"]["micro_batch"]) == (1, 2)
    assert d["metrics"]["peak_memory"]["observed"] in ("up", "down", "same")
    # the host speed probe, read before each timed update, over the calibration's read of it
    assert all(len(r[s]["time"]["probe_seconds"]) == 1 for r in d["rounds"] for s in "ab")
    speed = d["factors"]["host_speed"]
    assert 0.2 < speed["a"] < 5 and 0.2 < speed["b"] < 5 and speed["reference_seconds"] > 0
    row = Notebook(nb).get(d["notebook_id"])
    assert row.status.value == "complete" and row.to_dict()["metrics"] == d["metrics"]


def test_a_side_that_fails_to_run_exits_1_with_the_record_saved(tmp_path, monkeypatch):
    from batchlab.experiment import protocol
    from batchlab.measure.result import Measurement, Outcome

    def measure(cfg, options):
        if cfg.micro_batch == 2:
            return Measurement(cfg.to_dict(), Outcome.FAILED, cfg.global_batch, outcome_detail="killed by SIGKILL")
        return FakeMeasure((cfg, None))(cfg, options)

    monkeypatch.setattr(protocol, "default_measure", measure)
    nb = tmp_path / "nb.sqlite"
    r = invoke(*SMALL, "--no-verify", "--notebook", str(nb), "--json")
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)
    assert d["rounds"][0]["b"]["outcome"] == "failed" and d["rounds"][1]["b"] is None
    assert Notebook(nb).get(1).status.value == "complete"


BUBBLE = "the bubble falls from 33% to 20%: accumulation (micro-batches per flush, 2 -> 4) shrinks it"


def test_under_a_pipeline_the_record_names_the_bubble_in_a_field_of_its_own_labelled_formula(tmp_path):
    # p 2: (p-1)/(m+p-1) = 1/3 at 2 micro-batches per flush, 1/5 at 4
    args = ("--pp", "2", "--global-batch", "8", "--change", "micro_batch=4:2")
    d = formula_only(tmp_path, *args)
    assert d["pipeline_bubble"] == {"text": BUBBLE, "provenance": "formula"}
    assert "bubble" not in d["verdict"]  # the verdict is the metrics' alone
    shown = CliRunner().invoke(app, ["compare", *SMALL, *args, "--formula-only", "--predict", "none", "--notebook",
                                     str(tmp_path / "nb2.sqlite")], env={"COLUMNS": "300"})
    assert f"pipeline [formula]: {BUBBLE}" in shown.stdout, shown.stdout
    # a record stored with the clause inside its verdict text reads back with it in the field
    old = dict(d, verdict=d["verdict"] + "; " + BUBBLE)
    del old["pipeline_bubble"]
    back = Record.from_dict(old)
    assert back.pipeline_bubble == BUBBLE and back.verdict == d["verdict"]
