"""The lab notebook: rows begun before measuring, completed after, interrupted runs kept incomplete,
earlier experiments untouched, exports in JSON, CSV and Markdown, and the `notebook` commands."""
from __future__ import annotations

import csv
import io
import json
import sqlite3

import pytest
from typer.testing import CliRunner

from batchlab.cli import app
from batchlab.config import ConfigError
from batchlab.experiment.compare import run
from batchlab.experiment.notebook import Notebook
from batchlab.experiment.predict import Direction, Metric
from batchlab.experiment.record import Status
from batchlab.report import export
from fake_measure import FakeMeasure, plan_for


def do(book: Notebook, change="micro_batch=1:2", predict="memory=up", **fake_kw):
    p = plan_for(change, predict, note="fan noise")
    return run(p, book, measure=FakeMeasure((p.sides.a, p.sides.b), **fake_kw), verify=False)


def rows(path) -> list[tuple]:
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT id, status, kind, variable, verdict, interrupted FROM experiments ORDER BY id").fetchall()


def test_a_row_is_incomplete_while_measuring_and_complete_after(tmp_path):
    path = tmp_path / "nb.sqlite"
    book = Notebook(path)
    seen = []

    class Peek(FakeMeasure):
        def __call__(self, cfg, options):
            seen.append(rows(path))  # what another reader sees in the middle of the run
            return super().__call__(cfg, options)

    p = plan_for("ac=none:full", "memory=down,time=up", note="fan noise")
    rec = run(p, book, measure=Peek((p.sides.a, p.sides.b)), verify=False)
    assert seen[0] == [(1, "incomplete", "measured", "ac none -> full", None, None)]
    # the prediction and formula estimate were stored before the first measurement
    with sqlite3.connect(path) as conn:
        prediction, formula = conn.execute("SELECT prediction, formula FROM experiments").fetchone()
    assert json.loads(prediction)["user"] == {"peak_memory": "down", "update_time": "up"}
    assert json.loads(formula)["a"]["provenance"] == "formula"
    assert rows(path) == [(1, "complete", "measured", "ac none -> full", rec.verdict, None)]
    stored = book.get(1)
    assert stored.metrics == rec.metrics and stored.notebook_id == 1 and stored.status is Status.COMPLETE
    assert stored.factors["note"] == "fan noise" and "load_average" in stored.factors
    assert stored.to_dict() == rec.to_dict()  # the whole record comes back as it was written


def test_an_interrupted_run_stays_incomplete_and_earlier_ones_intact(tmp_path):
    book = Notebook(tmp_path / "nb.sqlite")
    first = do(book)
    before = book.get(1)
    with pytest.raises(KeyboardInterrupt):
        do(book, "ac=none:full", raise_at=3)  # Ctrl-C during round 2
    assert [(r[0], r[1]) for r in rows(book.path)] == [(1, "complete"), (2, "incomplete")]
    assert book.get(1) == before and before.verdict == first.verdict
    second = book.get(2)
    assert second.status is Status.INCOMPLETE and second.interrupted.startswith("KeyboardInterrupt")
    assert dict(second.predictions.user) == {Metric.PEAK_MEMORY: Direction.UP} and not second.metrics
    do(book)  # the notebook goes on after an interruption
    assert [r[1] for r in rows(book.path)] == ["complete", "incomplete", "complete"]


def test_a_user_error_found_while_measuring_leaves_nothing(tmp_path):
    book = Notebook(tmp_path / "nb.sqlite")
    do(book)

    def bad(*_):
        raise ConfigError("model", "no module named nowhere")

    with pytest.raises(ConfigError):
        do(book, raise_at=1, exc=lambda: bad())
    assert [r[0] for r in rows(book.path)] == [1]


def test_reading_a_missing_notebook_creates_nothing(tmp_path):
    book = Notebook(tmp_path / "none" / "nb.sqlite")
    assert book.list() == [] and export(book.records(), "json") == "[]\n"
    assert not book.path.exists() and not book.path.parent.exists()
    with pytest.raises(ConfigError) as e:
        book.get(1)
    assert e.value.field == "id"


def test_exports_hold_every_experiment(tmp_path):
    book = Notebook(tmp_path / "nb.sqlite")
    a = do(book)
    b = do(book, "ac=none:full", "memory=down", peak=(4000, 1000), times=((1.0, 1.4),) * 3)
    records = json.loads(export(book.records(), "json"))
    assert [r["notebook_id"] for r in records] == [1, 2]
    assert records[1]["metrics"]["peak_memory"]["ratio"] == 0.25
    table = list(csv.DictReader(io.StringIO(export(book.records(), "csv"))))
    assert [t["variable"] for t in table] == [a.change["variable"], b.change["variable"]]
    assert float(table[1]["update_time_ratio"]) == pytest.approx(1.4)
    assert table[1]["peak_memory_observed"] == "down" and table[1]["peak_memory_held_user"] == "True"
    assert table[0]["global_batch_a"] == table[0]["global_batch_b"] == "4"
    md = export(book.records(), "md")
    assert md.startswith("# batchlab lab notebook") and "## Experiment #2: ac none -> full" in md
    assert "| peak memory | 3.91 KiB |" in md and "global batch = micro-batch x accum x DP" in md
    with pytest.raises(ConfigError) as e:
        export(book.records(), "xml")
    assert e.value.field == "format"


def test_notebook_commands_list_show_and_export(tmp_path):
    path = tmp_path / "nb.sqlite"
    do(Notebook(path))
    runner = CliRunner()
    r = runner.invoke(app, ["notebook", "list", "--notebook", str(path), "--json"])
    assert r.exit_code == 0, r.output
    assert [row["variable"] for row in json.loads(r.stdout)] == ["micro_batch 1 -> 2 (derived: accum 4 -> 2)"]
    r = runner.invoke(app, ["notebook", "show", "1", "--notebook", str(path)])
    assert r.exit_code == 0, r.output
    assert "micro_batch 1 -> 2" in r.stdout and "global batch = micro-batch x accum x DP = 1 x 4 x 1 = 4" in r.stdout
    r = runner.invoke(app, ["notebook", "show", "1", "--notebook", str(path), "--json"])
    assert json.loads(r.stdout)["notebook_id"] == 1
    out = tmp_path / "nb.csv"
    r = runner.invoke(app, ["notebook", "export", "--format", "csv", "--notebook", str(path), "--output", str(out)])
    assert r.exit_code == 0 and out.read_text().startswith("id,")
    r = runner.invoke(app, ["notebook", "show", "7", "--notebook", str(path)])
    assert r.exit_code == 2 and r.stderr.strip() == f"error: id: no experiment 7 in {path}"
    r = runner.invoke(app, ["notebook", "export", "--format", "yaml", "--notebook", str(path)])
    assert r.exit_code == 2 and r.stderr.startswith("error: format:")
