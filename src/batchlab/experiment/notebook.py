"""The lab notebook: every experiment in one embedded SQLite file (stdlib sqlite3).

A row is inserted as ``incomplete`` with the variable, the predictions and the formula estimate before
anything runs, and completed in a second transaction at the end; an interrupted run leaves its row
``incomplete`` and every earlier row untouched.  Each write is one transaction (``with connection``).
Default file: platformdirs.user_data_dir("batchlab")/notebook.sqlite; BATCHLAB_NOTEBOOK or --notebook
changes it.  Torch-free.
"""
from __future__ import annotations

import json
import os
import sqlite3
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

from batchlab.config import ConfigError, to_jsonable
from batchlab.experiment.observed import ObservedRecord
from batchlab.experiment.record import Record, Status, now

Stored = Record | ObservedRecord  # what a notebook row holds: a compare experiment or an observed run

SCHEMA = """
CREATE TABLE IF NOT EXISTS experiments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at TEXT NOT NULL,
    finished_at TEXT,
    status TEXT NOT NULL CHECK (status IN ('incomplete', 'complete')),
    kind TEXT NOT NULL CHECK (kind IN ('measured', 'formula-only', 'observed')),
    variable TEXT NOT NULL,          -- the single variable (and derived changes)
    keep_mode TEXT NOT NULL,
    prediction TEXT NOT NULL,        -- JSON: the person's prior prediction and where it came from
    formula TEXT NOT NULL,           -- JSON: the formula's estimate of both sides and its prediction
    observation TEXT,                -- JSON: metrics (or, formula-only, the paper derivation, labelled)
    factors TEXT,                    -- JSON: uncontrolled factors (load, busy processes, noise, CPU MHz)
    note TEXT NOT NULL DEFAULT '',
    verdict TEXT,
    interrupted TEXT,                -- why an incomplete row stopped, when known
    record TEXT NOT NULL             -- JSON: the whole record, as `compare --json` prints it
);
"""


def default_path() -> Path:
    env = os.environ.get("BATCHLAB_NOTEBOOK")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_data_dir("batchlab")) / "notebook.sqlite"


def open_notebook(notebook: "Notebook | str | Path") -> "Notebook":
    """A Notebook as given, or the one at that path."""
    return notebook if isinstance(notebook, Notebook) else Notebook(notebook)


class Notebook:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else default_path()

    # -- writes
    def _connect(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=30)
            conn.row_factory = sqlite3.Row
            conn.executescript(SCHEMA)
            _allow_observed(conn)
        except (OSError, sqlite3.DatabaseError) as e:
            raise ConfigError("notebook", f"cannot open {self.path} as a batchlab notebook: {e}") from None
        return conn

    def begin(self, record: Record) -> int:
        """Insert the experiment as ``incomplete`` (predictions and formula already known); returns its id."""
        d = record.to_dict()
        with closing(self._connect()) as conn, conn:
            cur = conn.execute(
                "INSERT INTO experiments (created_at, status, kind, variable, keep_mode, prediction, formula, note, "
                "record) VALUES (?, 'incomplete', ?, ?, ?, ?, ?, ?, ?)",
                (record.created_at or now(), d["kind"], d["change"]["variable"], d["keep_mode"],
                 _j(d["predictions"]), _j(d["formula"]), record.note, _j(d)))
            return int(cur.lastrowid)

    def add(self, record: ObservedRecord) -> int:
        """Insert an observed run (experiment/observed.py) as one complete row; returns its id."""
        d = record.to_dict()
        with closing(self._connect()) as conn, conn:
            cur = conn.execute(
                "INSERT INTO experiments (created_at, finished_at, status, kind, variable, keep_mode, prediction, "
                "formula, observation, factors, note, verdict, record) "
                "VALUES (?, ?, 'complete', 'observed', ?, '-', '{}', '{}', ?, ?, ?, ?, ?)",
                (record.created_at or now(), now(), f"observed ({d['source']})",
                 _j({"label": "observed (allocator / wall-clock), nothing controlled", "figures": d["figures"]}),
                 _j(record.factors), record.note, record.short(), _j(d)))
            return int(cur.lastrowid)

    def complete(self, exp_id: int, record: Record) -> None:
        d = record.to_dict()
        with closing(self._connect()) as conn, conn:
            conn.execute(
                "UPDATE experiments SET status='complete', finished_at=?, observation=?, factors=?, verdict=?, "
                "record=? WHERE id=?",
                (record.finished_at or now(), _j(observation(d)), _j(d.get("factors")), record.verdict, _j(d),
                 exp_id))

    def interrupt(self, exp_id: int, reason: str) -> None:
        """Keep the row ``incomplete`` and say why it stopped."""
        with closing(self._connect()) as conn, conn:
            conn.execute("UPDATE experiments SET interrupted=? WHERE id=? AND status='incomplete'", (reason, exp_id))

    def discard(self, exp_id: int) -> None:
        """Remove a row begun for input that turned out invalid (bad input leaves nothing behind)."""
        with closing(self._connect()) as conn, conn:
            conn.execute("DELETE FROM experiments WHERE id=? AND status='incomplete'", (exp_id,))

    # -- reads (a missing file is an empty notebook; nothing is created)
    def _rows(self, where: str = "", args: tuple = ()) -> Iterator[sqlite3.Row]:
        if not self.path.exists():
            return iter(())
        try:
            with closing(sqlite3.connect(self.path.resolve().as_uri() + "?mode=ro", uri=True,
                                           timeout=30)) as conn:
                conn.row_factory = sqlite3.Row
                return iter(conn.execute(f"SELECT * FROM experiments {where} ORDER BY id", args).fetchall())
        except sqlite3.OperationalError as e:
            raise ConfigError("notebook", f"{self.path} is not a batchlab notebook ({e})") from None
        except sqlite3.DatabaseError as e:
            raise ConfigError("notebook", f"{self.path} is not an SQLite database ({e})") from None

    def list(self) -> list[dict[str, Any]]:
        return [_summary(r) for r in self._rows()]

    def get(self, exp_id: int) -> Stored:
        """The whole record of one experiment, with its notebook id and status."""
        rows = list(self._rows("WHERE id=?", (exp_id,)))
        if not rows:
            raise ConfigError("id", f"no experiment {exp_id} in {self.path}")
        return _record(rows[0])

    def records(self) -> list[Stored]:
        return [_record(r) for r in self._rows()]


def _allow_observed(conn: sqlite3.Connection) -> None:
    """Notebooks written before observed runs existed restrict ``kind``; rebuild the table once, rows kept."""
    sql = conn.execute("SELECT sql FROM sqlite_master WHERE name='experiments'").fetchone()[0]
    if "'observed'" in sql:
        return
    with conn:
        conn.execute("ALTER TABLE experiments RENAME TO experiments_old")
        conn.execute(SCHEMA)
        conn.execute("INSERT INTO experiments SELECT * FROM experiments_old")
        conn.execute("DROP TABLE experiments_old")

def _j(value: Any) -> str:
    return json.dumps(to_jsonable(value))


def observation(record: dict[str, Any]) -> dict[str, Any]:
    """What was seen (measured) or, formula-only, the paper derivation — labelled as such."""
    if record["kind"] == "formula-only":
        return {"label": "paper derivation (formula), not an observation", "metrics": record["metrics"]}
    return {"label": "measured (allocator / wall-clock)", "metrics": record["metrics"]}


def _record(row: sqlite3.Row) -> Stored:
    """The stored record (any schema this batchlab reads), with the row's id, status and interruption."""
    d = json.loads(row["record"])
    if row["kind"] == "observed":
        try:
            return replace(ObservedRecord.from_dict(d), notebook_id=row["id"])
        except ValueError as e:
            raise ConfigError("id", f"#{row['id']}: {e}") from None
    record = Record.from_dict(d)
    return record.with_(notebook_id=row["id"], status=Status(row["status"]), interrupted=row["interrupted"])


def short_verdict(record: Stored) -> str:
    """``memory ↑1.38 time ↓0.91 ...``: observed (or, formula only, the formula's) direction and ratio."""
    if isinstance(record, ObservedRecord):
        return record.short()
    parts = []
    for metric, m in record.metrics.items():
        d = m.predicted_by_formula if record.formula_only else m.observed
        ratio = m.formula.ratio if record.formula_only else m.ratio
        if d is not None:
            parts.append(f"{metric.short} {d.symbol}" + (f"{ratio:.3g}" if ratio is not None else ""))
    return " ".join(parts)


def _summary(row: sqlite3.Row) -> dict[str, Any]:
    return {"id": row["id"], "created_at": row["created_at"], "status": row["status"], "kind": row["kind"],
            "variable": row["variable"], "keep_mode": row["keep_mode"], "verdict": row["verdict"] or "",
            "short": _short(row), "note": row["note"], "interrupted": row["interrupted"]}


def _short(row: sqlite3.Row) -> str:
    try:
        return short_verdict(_record(row))
    except (KeyError, TypeError, ValueError) as e:  # a damaged or foreign row: listed, marked, not fatal
        return f"(record unreadable: {type(e).__name__} {e})"
