"""The typed experiment record: to_dict / from_dict round trip, rows written before the schema field
existed (tests/data/notebook_row_v1.json, written by batchlab at b89eba1) still read, newer schemas refused."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from batchlab.config import ConfigError
from batchlab.experiment.compare import run
from batchlab.experiment.notebook import SCHEMA, Notebook
from batchlab.experiment.predict import Direction, Metric
from batchlab.experiment.record import SCHEMA_VERSION, Kind, Record, Status
from batchlab.measure.result import Measurement
from batchlab.config.phase import Phase
from batchlab.report import export
from batchlab.timeline.data import STORED_WIDTH
from fake_measure import FakeMeasure, fake_timeline, plan_for

OLD_ROW = Path(__file__).parents[1] / "data" / "notebook_row_v1.json"


def _old_notebook(path: Path) -> Notebook:
    row = json.loads(OLD_ROW.read_text())
    row["record"] = json.dumps(row["record"])
    with sqlite3.connect(path) as conn:
        conn.executescript(SCHEMA)
        conn.execute(f"INSERT INTO experiments ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                     tuple(row.values()))
    return Notebook(path)


def test_a_record_survives_the_round_trip_through_its_json_form():
    p = plan_for("ac=none:full", "memory=down,time=up", note="quiet")
    rec = run(p, measure=FakeMeasure((p.sides.a, p.sides.b), peak=(4000, 1000), times=((1.0, 1.5),) * 3),
              verify=False)
    d = json.loads(json.dumps(rec.to_dict()))
    back = Record.from_dict(d)
    assert back.to_dict() == d
    assert back.metrics.keys() == rec.metrics.keys() and back.metrics == rec.metrics
    # enum fields hold enums after reading, not the strings they were stored as
    assert back.kind is Kind.MEASURED and back.predictions.user[Metric.PEAK_MEMORY] is Direction.DOWN
    assert back.metrics[Metric.UPDATE_TIME].observed is Direction.UP
    assert isinstance(back.rounds[0].a, Measurement) and back.rounds[0].b.memory.peak_bytes == 1000
    assert back.rounds[0].a.memory.peak_phase is Phase.BACKWARD


def test_a_row_written_before_the_schema_field_reads_as_version_1(tmp_path):
    book = _old_notebook(tmp_path / "nb.sqlite")
    rec = book.get(1)
    assert "schema" not in json.loads(OLD_ROW.read_text())["record"]
    assert rec.status is Status.COMPLETE and rec.note == "old row" and rec.schema == SCHEMA_VERSION
    # the figures the old row holds (its fake measurement: peaks 1000 -> 1200 bytes, times 1.0 -> 1.1 s)
    mem, t = rec.metrics[Metric.PEAK_MEMORY], rec.metrics[Metric.UPDATE_TIME]
    assert (mem.ratio, mem.observed, mem.held_user) == (1.2, Direction.UP, True)
    assert t.ratio == pytest.approx(1.1) and t.held_user is False
    assert [c.name for c in rec.diagnosis.checks][:3] == ["warmup", "spread", "data_loading"]
    assert len(rec.rounds) == 3 and rec.rounds[0].a.memory.peak_bytes == 1000
    assert book.list()[0]["short"].startswith("memory ↑1.2 time ↑1.1")
    table = export(book.records(), "csv")
    assert "peak_memory_observed" in table.splitlines()[0] and ",up," in table.splitlines()[1]


def test_a_newer_schema_is_refused_naming_the_notebook():
    d = json.loads(OLD_ROW.read_text())["record"] | {"schema": SCHEMA_VERSION + 1}
    with pytest.raises(ConfigError) as e:
        Record.from_dict(d)
    assert e.value.field == "notebook" and f"schema {SCHEMA_VERSION + 1}" in str(e.value)


def test_a_record_is_frozen():
    p = plan_for("ac=none:full", formula_only=True)
    rec = run(p)
    with pytest.raises(AttributeError):
        rec.verdict = "patched"  # type: ignore[misc]
    assert rec.with_(note="n").note == "n" and rec.note == ""


def test_a_compare_keeps_each_sides_timeline_compacted_with_the_exact_peak():
    p = plan_for("ac=none:full")
    fake = FakeMeasure((p.sides.a, p.sides.b), peak=(4000, 1000), times=((1.0, 1.5),) * 3)
    rec = run(p, measure=fake, verify=False)
    # one timeline per side, asked of each side's first measurement only; none left in the rounds
    assert fake.timeline_asked == [("a", 0), ("b", 0)]
    assert all(r.a.timeline is None and r.b.timeline is None for r in rec.rounds)
    full = fake_timeline(4000)  # what side A's measurement returned: 1200 samples, peak 4000 B at op 399
    a, b = rec.timelines["a"], rec.timelines["b"]
    assert (a.peak_bytes, b.peak_bytes) == (4000, 1000)
    assert max(a.totals) == 4000 and a.peak_op == 399 and a.at_peak == full.at_peak
    assert a.at_peak == {**dict.fromkeys(full.parts, 0), "parameters": 100, "activations": 3900}
    assert len(a.ops) <= 2 * STORED_WIDTH + len(a.phases) + 3 < len(full.ops)
    assert max(b.totals) == 1000 and b.formula_phase_peaks == {"forward": 1000, "backward": 900}
    d = json.loads(json.dumps(rec.to_dict()))
    assert d["schema"] == 3 and len(json.dumps(d["timelines"])) < 60_000  # ~24 kB a side
    back = Record.from_dict(d)
    assert back.timelines == rec.timelines and back.to_dict() == d


def test_a_schema_2_row_reads_with_no_timelines():
    p = plan_for()
    rec = run(p, measure=FakeMeasure((p.sides.a, p.sides.b)), verify=False)
    d = rec.to_dict()
    d.pop("timelines")
    d["schema"] = 2
    old = Record.from_dict(d)
    assert old.timelines == {} and old.schema == SCHEMA_VERSION and old.metrics == rec.metrics
