"""The lab notebook: every experiment in one embedded SQLite file (stdlib sqlite3).

A row is inserted as ``incomplete`` with the variable, the predictions and the formula estimate before
anything runs, and completed in a second transaction at the end; an interrupted run leaves its row
``incomplete`` and every earlier row untouched.  Each write is one transaction (``with connection``).
Default file: platformdirs.user_data_dir("batchlab")/notebook.sqlite; BATCHLAB_NOTEBOOK or --notebook
changes it.  Torch-free.
"""
from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any, Iterator

from batchlab.config import ConfigError, _Choice

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


class ExportFormat(_Choice):
    JSON = "json"
    CSV = "csv"
    MD = "md"


def default_path() -> Path:
    env = os.environ.get("BATCHLAB_NOTEBOOK")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_data_dir("batchlab")) / "notebook.sqlite"


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec="seconds")


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

    def begin(self, record: dict[str, Any]) -> int:
        """Insert the experiment as ``incomplete`` (predictions and formula already known); returns its id."""
        with closing(self._connect()) as conn, conn:
            cur = conn.execute(
                "INSERT INTO experiments (created_at, status, kind, variable, keep_mode, prediction, formula, note, "
                "record) VALUES (?, 'incomplete', ?, ?, ?, ?, ?, ?, ?)",
                (record.get("created_at") or now(), record["kind"], record["change"]["variable"], record["keep_mode"],
                 _j(record["predictions"]), _j(record["formula"]), record.get("note") or "", _j(record)))
            return int(cur.lastrowid)

    def add(self, record: dict[str, Any]) -> int:
        """Insert an observed run (experiment/observed.py) as one complete row; returns its id."""
        with closing(self._connect()) as conn, conn:
            cur = conn.execute(
                "INSERT INTO experiments (created_at, finished_at, status, kind, variable, keep_mode, prediction, "
                "formula, observation, factors, note, verdict, record) "
                "VALUES (?, ?, 'complete', 'observed', ?, '-', '{}', '{}', ?, ?, ?, ?, ?)",
                (record.get("created_at") or now(), now(), f"observed ({record['source']})",
                 _j({"label": "observed (allocator / wall-clock), nothing controlled", "figures": record["figures"]}),
                 _j(record.get("factors")), record.get("note") or "", record.get("short") or "", _j(record)))
            return int(cur.lastrowid)

    def complete(self, exp_id: int, record: dict[str, Any]) -> None:
        with closing(self._connect()) as conn, conn:
            conn.execute(
                "UPDATE experiments SET status='complete', finished_at=?, observation=?, factors=?, verdict=?, "
                "record=? WHERE id=?",
                (record.get("finished_at") or now(), _j(observation(record)), _j(record.get("factors")),
                 record.get("verdict"), _j(record), exp_id))

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

    def get(self, exp_id: int) -> dict[str, Any]:
        """The whole record of one experiment, with its notebook id and status."""
        rows = list(self._rows("WHERE id=?", (exp_id,)))
        if not rows:
            raise ConfigError("id", f"no experiment {exp_id} in {self.path}")
        return _record(rows[0])

    def records(self) -> list[dict[str, Any]]:
        return [_record(r) for r in self._rows()]

    def export(self, fmt: ExportFormat | str) -> str:
        fmt = ExportFormat.parse("format", fmt)
        records = self.records()
        if fmt is ExportFormat.JSON:
            return json.dumps(records, indent=2) + "\n"
        if fmt is ExportFormat.CSV:
            return _csv(records)
        from batchlab.experiment.observed_report import markdown
        from batchlab.report import notebook_markdown

        compared = [r for r in records if r["kind"] != "observed"]
        observed = markdown([r for r in records if r["kind"] == "observed"])
        return (notebook_markdown(compared) if compared or not observed else "") + observed


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
    from batchlab.config import to_jsonable

    return json.dumps(to_jsonable(value))


def observation(record: dict[str, Any]) -> dict[str, Any]:
    """What was seen (measured) or, formula-only, the paper derivation — labelled as such."""
    if record["kind"] == "formula-only":
        return {"label": "paper derivation (formula), not an observation", "metrics": record["metrics"]}
    return {"label": "measured (allocator / wall-clock)", "metrics": record["metrics"]}


def _record(row: sqlite3.Row) -> dict[str, Any]:
    record = json.loads(row["record"])
    record.update(notebook_id=row["id"], status=row["status"], interrupted=row["interrupted"])
    return record


SHORT = {"peak_memory": "memory", "update_time": "time", "tokens_per_second": "tokens/s", "time_to_budget": "budget",
         "oom": "oom"}
ARROW = {"up": "↑", "down": "↓", "same": "≈"}


def short_verdict(record: dict[str, Any]) -> str:
    """``memory ↑1.38 time ↓0.91 ...``: observed (or, formula only, the formula's) direction and ratio."""
    if record.get("kind") == "observed":
        return record.get("short", "")
    parts = []
    for name, m in (record.get("metrics") or {}).items():
        formula_only = record.get("kind") == "formula-only"
        d = m.get("predicted_by_formula") if formula_only else m.get("observed")
        ratio = (m.get("formula") or {}).get("ratio") if formula_only else m.get("ratio")
        if d is not None:
            parts.append(f"{SHORT.get(name, name)} {ARROW[d]}" + (f"{ratio:.3g}" if ratio is not None else ""))
    return " ".join(parts)


def _summary(row: sqlite3.Row) -> dict[str, Any]:
    record = json.loads(row["record"])
    return {"id": row["id"], "created_at": row["created_at"], "status": row["status"], "kind": row["kind"],
            "variable": row["variable"], "keep_mode": row["keep_mode"], "verdict": row["verdict"] or "",
            "short": short_verdict(record), "note": row["note"], "interrupted": row["interrupted"]}


CSV_METRIC_FIELDS = ("observed", "ratio", "band_low", "band_high", "predicted_by_user", "predicted_by_formula",
                     "held_user", "held_formula")


def csv_row(record: dict[str, Any]) -> dict[str, Any]:
    if record["kind"] == "observed":
        row = {"id": record.get("notebook_id"), "created_at": record.get("created_at"), "kind": "observed",
               "variable": f"observed ({record['source']})", "global_batch": record["global_batch"]}
        return row | {f"{f['name']} ({f['provenance']})": f["observed"] for f in record["figures"]}
    row = {"id": record.get("notebook_id"), "created_at": record.get("created_at"), "status": record.get("status"),
           "kind": record["kind"], "variable": record["change"]["variable"], "keep_mode": record["keep_mode"],
           "global_batch_a": record["change"]["global_batch"]["a"], "global_batch_b": record["change"]["global_batch"]["b"],
           "note": record.get("note", ""), "verdict": record.get("verdict", "")}
    for name, m in (record.get("metrics") or {}).items():
        band = m.get("band") or [None, None]
        values = (m.get("observed"), m.get("ratio"), band[0], band[1], m.get("predicted_by_user"),
                  m.get("predicted_by_formula"), m["held"]["user"], m["held"]["formula"])
        row.update({f"{name}_{k}": v for k, v in zip(CSV_METRIC_FIELDS, values)})
    factors = record.get("factors") or {}
    load = (factors.get("load_average") or {}).get("before")
    row["load_average_1m"] = load[0] if load else None
    row["busy_processes"] = (factors.get("busy_processes") or {}).get("count")
    return row


def _csv(records: list[dict[str, Any]]) -> str:
    rows = [csv_row(r) for r in records]
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns or ["id"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()
