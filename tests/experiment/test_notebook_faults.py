"""Notebook faults: a save that fails after measuring keeps the record in a fallback file that `notebook import`
restores; a read-only, damaged or foreign notebook is one line (exit 2 before measuring); rows whose record is
damaged are listed and marked, never a traceback."""
from __future__ import annotations

import json
import os
import sqlite3

import pytest
from typer.testing import CliRunner

from batchlab.cli import app
from batchlab.experiment import notebook as nb_mod
from batchlab.experiment.compare import run
from batchlab.experiment.notebook import Notebook, NotebookError
from batchlab.experiment.record import Status
from fake_measure import FakeMeasure, plan_for

runner = CliRunner()


def do(book: Notebook, change="micro_batch=1:2"):
    p = plan_for(change, "memory=up", note="fan noise")
    return run(p, book, measure=FakeMeasure((p.sides.a, p.sides.b)), verify=False)


def one_line_error(res, code: int, *words: str) -> str:
    assert res.exit_code == code, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    err = res.stderr.strip()
    assert err.startswith("error: ") and "Traceback" not in res.output, res.output
    assert len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err
    return err


def test_a_failed_final_save_writes_a_fallback_that_import_restores(tmp_path, monkeypatch):
    path = tmp_path / "nb.sqlite"
    book = Notebook(path)
    real_connect = sqlite3.connect
    calls = []

    class FullDisk:  # the final UPDATE fails as a full disk does; the INSERT before measuring succeeds
        def __init__(self, conn):
            self._c = conn

        def execute(self, sql, *a):
            if sql.lstrip().startswith("UPDATE experiments SET status='complete'"):
                raise sqlite3.OperationalError("database or disk is full")
            return self._c.execute(sql, *a)

        def __getattr__(self, name):
            return getattr(self._c, name)

        def __enter__(self):
            return self._c.__enter__()

        def __exit__(self, *exc):
            return self._c.__exit__(*exc)

    def connect(*a, **k):
        calls.append(a[0])
        return FullDisk(real_connect(*a, **k))

    monkeypatch.setattr(nb_mod.sqlite3, "connect", connect)
    with pytest.raises(NotebookError) as info:
        do(book)
    monkeypatch.undo()
    err = info.value
    assert err.exit_code == 1 and err.fallback is not None and err.fallback.exists()
    assert "database or disk is full" in str(err) and str(err.fallback) in str(err) and "\n" not in str(err)
    assert [r["status"] for r in book.list()] == ["incomplete"]  # the row begun before measuring
    saved = json.loads(err.fallback.read_text())["record"]
    assert saved["metrics"] and saved["rounds"]  # the measurements themselves are in the file
    res = runner.invoke(app, ["notebook", "import", str(err.fallback), "--notebook", str(path)])
    assert res.exit_code == 0, res.output
    rows = book.list()
    assert [(r["id"], r["status"]) for r in rows] == [(1, "complete")]  # the same row, completed
    got = book.get(1)
    assert got.status is Status.COMPLETE and got.to_dict()["metrics"] == saved["metrics"]
    # importing again adds a second row rather than overwriting the completed one
    res = runner.invoke(app, ["notebook", "import", str(err.fallback), "--notebook", str(path)])
    assert res.exit_code == 0 and [r["id"] for r in book.list()] == [1, 2]


def test_compare_cli_exits_1_naming_the_fallback_when_the_save_fails(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "nb.sqlite"

    def refuse(self, exp_id, record):
        e = NotebookError("cannot save the measured experiment in nb.sqlite: database or disk is full", 1)
        raise self._fallback(e, record.to_dict(), exp_id)

    monkeypatch.setattr(Notebook, "complete", refuse)
    res = runner.invoke(app, ["compare", "--formula-only", "--change", "micro_batch=1:2", "--predict", "none",
                              "--notebook", str(path)])
    err = one_line_error(res, 1, "disk is full", "batchlab notebook import")
    fallback = err.split(" is in ")[1].split(" (")[0]
    assert os.path.exists(fallback)


def test_a_read_only_notebook_is_one_line_before_anything_runs(tmp_path, monkeypatch):
    path = tmp_path / "nb.sqlite"
    do(Notebook(path))
    real_connect = sqlite3.connect
    # read-only as SQLite sees it (root ignores file permissions, so open it mode=ro instead of chmod)
    monkeypatch.setattr(nb_mod.sqlite3, "connect",
                        lambda p, **k: real_connect(f"file:{p}?mode=ro", uri=True, **k))
    res = runner.invoke(app, ["compare", "--formula-only", "--predict", "none", "--notebook", str(path)])
    one_line_error(res, 2, "notebook", "readonly")
    monkeypatch.undo()
    assert [r["id"] for r in Notebook(path).list()] == [1]


def test_a_damaged_file_and_a_foreign_table_are_one_line(tmp_path):
    bad = tmp_path / "garbage.sqlite"
    bad.write_bytes(b"SQLite format 3\x00" + os.urandom(4096))
    for argv in (["compare", "--formula-only", "--predict", "none"], ["notebook", "list"], ["notebook", "show", "1"],
                 ["notebook", "export"]):
        one_line_error(runner.invoke(app, [*argv, "--notebook", str(bad)]), 2, "notebook")
    foreign = tmp_path / "foreign.sqlite"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE experiments (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("INSERT INTO experiments (name) VALUES ('theirs')")
    for argv in (["compare", "--formula-only", "--predict", "none"], ["notebook", "list"], ["notebook", "show", "1"]):
        one_line_error(runner.invoke(app, [*argv, "--notebook", str(foreign)]), 2, "not batchlab's")
    with sqlite3.connect(foreign) as conn:  # and their table is left exactly as it was
        assert conn.execute("SELECT name FROM experiments").fetchall() == [("theirs",)]


@pytest.mark.parametrize("damage", ["not json {", '{"kind": "measured"}', "[1, 2]", '"text"'])
def test_damaged_records_are_listed_marked_and_skipped(tmp_path, damage):
    path = tmp_path / "nb.sqlite"
    book = Notebook(path)
    do(book)
    do(book, "ac=none:full")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE experiments SET record=? WHERE id=1", (damage,))
    res = runner.invoke(app, ["notebook", "list", "--notebook", str(path)], env={"COLUMNS": "250"})
    assert res.exit_code == 0 and "record unreadable" in res.stdout and "ac none -> full" in res.stdout
    res = runner.invoke(app, ["notebook", "show", "1", "--notebook", str(path)])
    one_line_error(res, 1, "#1: record unreadable")
    assert "micro_batch" in res.stdout  # the plain columns still shown
    assert runner.invoke(app, ["notebook", "show", "2", "--notebook", str(path)]).exit_code == 0
    for fmt in ("json", "csv", "md"):
        res = runner.invoke(app, ["notebook", "export", "--format", fmt, "--notebook", str(path)])
        assert res.exit_code == 0 and "#1: record unreadable" in res.stderr, res.output
        assert "ac" in res.stdout


def test_an_id_beyond_64_bits_is_no_such_experiment(tmp_path):
    path = tmp_path / "nb.sqlite"
    do(Notebook(path))
    res = runner.invoke(app, ["notebook", "show", "9" * 30, "--notebook", str(path)])
    one_line_error(res, 2, "no experiment")


def test_import_refuses_what_is_not_a_fallback_file(tmp_path):
    f = tmp_path / "x.json"
    for text in ("{", '{"a": 1}', '{"batchlab_unsaved_record": 1, "record": {"kind": "measured"}}'):
        f.write_text(text)
        one_line_error(runner.invoke(app, ["notebook", "import", str(f), "--notebook", str(tmp_path / "n.sqlite")]),
                       2, "file")
    one_line_error(runner.invoke(app, ["notebook", "import", str(tmp_path / "none.json")]), 2, "no such file")
