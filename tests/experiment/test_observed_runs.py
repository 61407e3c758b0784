"""Observed records: batchlab.observe(notebook=), the notebook's kind column, `notebook diff`, old notebook files."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest

from batchlab.report import export
import torch
from typer.testing import CliRunner

import batchlab
from batchlab.cli import app
from batchlab.config import ConfigError, RunConfig
from batchlab.experiment.notebook import Notebook
from batchlab.experiment.observed import ObservedRecord, Settings, Source, build, save
from batchlab.experiment.observed_diff import observed_diff
from batchlab.measure.result import MeasuredMemory, MeasuredTime, Measurement, Outcome


def _loop(obs_kwargs, updates=5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    with batchlab.observe(model, opt, **obs_kwargs) as obs:
        for _ in range(updates):
            with obs.update(tokens=8):
                obs.mark("forward")
                loss = torch.nn.functional.mse_loss(model(x), y)
                obs.mark("backward")
                loss.backward()
                obs.mark("optimizer")
                opt.step()
                opt.zero_grad()
    return obs


def test_observe_writes_an_observed_record(tmp_path):
    path = tmp_path / "lab.sqlite"
    bare = _loop({"notebook": path})
    cfg = RunConfig(micro_batch=4, accum=2, seq=16)
    described = _loop({"notebook": path, "config": cfg})
    rows = Notebook(path).list()
    assert [r["kind"] for r in rows] == ["observed", "observed"]
    assert [r["id"] for r in rows] == [bare.notebook_id, described.notebook_id]
    # no config: the split is unknown, and the record says so instead of guessing
    assert bare.record.global_batch is None and "no config given" in bare.record.unmapped[0]
    r = Notebook(path).get(described.notebook_id)
    assert r.global_batch == 8 and "4 x 2 x 1 = 8" in r.settings.global_batch_text()
    assert r.notebook_id == described.notebook_id
    assert ObservedRecord.from_dict(r.to_dict()).to_dict() == r.to_dict()  # round trip
    # 5 updates: 1 warmup, 1 memory, 1 more warmup, 2 timed
    assert len(described.record.measurement.time.samples) == 2
    # provenance: the memory figure is update 2's alone; the uncontrolled factors were sampled between updates
    assert described.record.measurement.memory.method.endswith("; update 2 only, untimed")
    assert "between updates" in described.record.factors["busy_processes"]["rule"]


def _record(micro, accum, peak, seconds, precision="fp32") -> ObservedRecord:
    t = MeasuredTime(samples=list(seconds), warmup=2)
    m = Measurement(config={}, outcome=Outcome.OK, global_batch=micro * accum,
                    memory=MeasuredMemory(peak_bytes=peak, activations_bytes=0, peak_phase="backward"),
                    time=t, useful_tokens_per_update=micro * accum * 16,
                    tokens_per_second=micro * accum * 16 / t.update_seconds_median)
    s = Settings(micro_batch=micro, accum=accum, world_size=1, precision=precision, seq=16, model="MLP")
    return build(Source.LOOP, s, m, None, [], {}, predict=False)


def test_diff_one_variable_uses_compares_verdict(tmp_path):
    book = Notebook(tmp_path / "lab.sqlite")
    a = save(_record(2, 4, 1000, [1.0, 1.2, 0.8]), book)
    b = save(_record(8, 1, 1500, [2.0, 2.2, 2.0]), book)
    d = observed_diff(book, a, b, "memory=up,time=down").to_dict()
    assert d["variable"].startswith("micro_batch") and tuple(d["global_batch"]) == (8, 8)
    mem, t = d["metrics"]["peak_memory"], d["metrics"]["update_time"]
    assert mem["ratio"] == pytest.approx(1.5) and mem["observed"] == "up" and mem["held"]["user"] is True
    # update i of B over update i of A: 2.0, 1.833, 2.5 -> median 2.0, band (1.833, 2.5)
    assert t["ratio"] == pytest.approx(2.0) and t["band"] == pytest.approx([2.2 / 1.2, 2.5])
    assert t["observed"] == "up" and t["held"]["user"] is False
    assert {"metric": "update_time", "who": "you", "predicted": "down", "observed": "up"} in d["contradictions"]


def test_diff_refuses_two_variables_with_the_list(tmp_path):
    path = tmp_path / "lab.sqlite"
    book = Notebook(path)
    a = save(_record(2, 4, 1000, [1.0, 1.0]), book)
    b = save(_record(4, 4, 1000, [1.0, 1.0], precision="bf16-mixed"), book)
    with pytest.raises(ConfigError, match=r"differ in 2 fields .*micro_batch: 2 -> 4; precision: 'fp32' -> 'bf16-mixed'"):
        observed_diff(book, a, b)
    r = CliRunner().invoke(app, ["notebook", "diff", str(a), str(b), "--notebook", str(path)])
    assert r.exit_code == 2 and "micro_batch" in r.output and "Traceback" not in r.output


def test_list_show_and_diff_on_the_command_line(tmp_path):
    path = tmp_path / "lab.sqlite"
    book = Notebook(path)
    a, b = save(_record(2, 1, 1000, [1.0, 1.0]), book), save(_record(4, 1, 2000, [1.5, 1.5]), book)
    runner = CliRunner()
    rows = json.loads(runner.invoke(app, ["notebook", "list", "--notebook", str(path), "--json"]).output)
    assert [r["kind"] for r in rows] == ["observed", "observed"] and "global batch 2" in rows[0]["short"]
    shown = runner.invoke(app, ["notebook", "show", str(a), "--notebook", str(path)], env={"COLUMNS": "160"})
    assert shown.exit_code == 0 and "2 x 1 x 1 = 2" in shown.output and "allocator" in shown.output
    d = json.loads(runner.invoke(app, ["notebook", "diff", str(a), str(b), "--notebook", str(path), "--json"]).output)
    assert d["variable"] == "micro_batch" and d["metrics"]["peak_memory"]["ratio"] == pytest.approx(2.0)


def test_old_notebook_file_takes_observed_records(tmp_path):
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as conn:  # the schema before observed runs: kind restricted to two values
        conn.execute("CREATE TABLE experiments (id INTEGER PRIMARY KEY AUTOINCREMENT, created_at TEXT NOT NULL, "
                     "finished_at TEXT, status TEXT NOT NULL, kind TEXT NOT NULL CHECK (kind IN ('measured', "
                     "'formula-only')), variable TEXT NOT NULL, keep_mode TEXT NOT NULL, prediction TEXT NOT NULL, "
                     "formula TEXT NOT NULL, observation TEXT, factors TEXT, note TEXT NOT NULL DEFAULT '', "
                     "verdict TEXT, interrupted TEXT, record TEXT NOT NULL)")
        conn.execute("INSERT INTO experiments (created_at, status, kind, variable, keep_mode, prediction, formula, "
                     "record) VALUES ('2026', 'incomplete', 'measured', 'ac', 'global-batch', '{}', '{}', "
                     "'{\"kind\": \"measured\"}')")
    new = save(_record(2, 1, 1000, [1.0]), Notebook(path))
    assert [(r["id"], r["kind"]) for r in Notebook(path).list()] == [(1, "measured"), (new, "observed")]


def _module_level(tree):
    """Every node outside function bodies (class bodies, if/try blocks at module level included)."""
    import ast

    todo = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def _external_imports(module: str, seen: set[str] | None = None) -> set[str]:
    """Top-level packages outside batchlab that importing ``module`` loads, through batchlab's own modules
    (static): imports at module level only — one inside a function runs when that function is called, which is
    how a framework is imported lazily."""
    import ast
    import importlib.util

    seen = set() if seen is None else seen
    seen.add(module)
    tree = ast.parse(open(importlib.util.find_spec(module).origin).read())
    out: set[str] = set()
    for node in _module_level(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        for name in names:
            if not name.startswith("batchlab"):
                out.add(name.split(".")[0])
                continue
            while importlib.util.find_spec(name) is None:
                name = name.rsplit(".", 1)[0]
            if name not in seen:
                out |= _external_imports(name, seen)
    return out


def test_each_integration_imports_only_its_framework():
    hf, pl = _external_imports("batchlab.integrations.transformers"), _external_imports("batchlab.integrations.lightning")
    assert "transformers" in hf and not {"lightning", "pytorch_lightning"} & hf
    assert "lightning" in pl and "transformers" not in pl


@pytest.mark.slow  # a fresh interpreter importing torch and transformers
def test_transformers_integration_does_not_load_lightning():
    pytest.importorskip("transformers")
    # the collector off: it changes nothing that is imported, and torch's and transformers' imports free nothing
    code = ("import gc; gc.disable(); import sys, batchlab.integrations.transformers; "
            "print(any(m.split('.')[0] == 'lightning' for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_export_takes_observed_rows(tmp_path):
    book = Notebook(tmp_path / "lab.sqlite")
    save(_record(2, 3, 4 * 2**20, [1.0]), book)
    md = export(book.records(), "md")
    assert "| 1 | loop | MLP | global batch = micro-batch x accum x DP = 2 x 3 x 1 = 6" in md and "4.00 MiB" in md
    rows = export(book.records(), "csv").splitlines()
    assert rows[0].startswith("id,created_at,kind,variable,global_batch") and ",observed," in rows[1]


def test_memory_every_takes_the_highest_peak_of_its_updates_and_names_them():
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference = None
    with batchlab.observe(model, opt, warmup=2, memory_every=3) as obs:
        for i in range(8):  # memory updates: 2, 5, 8; update 5 has a 16x larger batch
            x = torch.randn(512 if i == 4 else 32, 64)
            tracker = MemTracker() if i == 4 else None
            if tracker is not None:
                tracker.track_external(model, opt)
                tracker.__enter__()  # outer mode: sees the same update independently
            with obs.update():
                obs.mark("forward")
                loss = model(x).square().mean()
                obs.mark("backward")
                loss.backward()
                obs.mark("optimizer")
                opt.step()
                opt.zero_grad()
            if tracker is not None:
                tracker.__exit__(None, None, None)
                reference = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    m = obs.measurement
    assert m.memory.method.endswith("; peak of updates 2, 5, 8, untimed")
    assert abs(m.memory.peak_bytes - reference) / reference <= 0.005  # AdamW's step counters: MemTracker's alone
    assert len(m.time.samples) == 8 - 3 - 2  # warmup 1, 2 (memory), 3; memory updates 5 and 8 untimed
    with pytest.raises(ValueError, match="memory_every"):
        batchlab.observe(model, opt, memory_every=1).__enter__()
