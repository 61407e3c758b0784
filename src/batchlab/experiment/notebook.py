"""The lab notebook: every experiment in one embedded SQLite file (stdlib sqlite3).

A row is inserted as ``incomplete`` with the variable, the predictions and the formula estimate before
anything runs, and completed in a second transaction at the end; an interrupted run leaves its row
``incomplete`` and every earlier row untouched.  Each write is one transaction (``with connection``).
Default file: platformdirs.user_data_dir("batchlab")/notebook.sqlite; BATCHLAB_NOTEBOOK or --notebook
changes it.

Every write turns an sqlite3 or OS error (full disk, read-only file, a damaged page, a foreign
``experiments`` table) into a NotebookError, one line.  When the final save of a measured experiment fails,
the whole record goes to a fallback JSON file named in the message; ``import_file`` loads it later.  Reads
show what they can: a row whose record is damaged is listed and marked (DamagedRecord), never a traceback.
Torch-free.
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
from batchlab.config.values import INT64_MAX
from batchlab.experiment.observed import ObservedRecord
from batchlab.experiment.record import Record, Status, now

Stored = Record | ObservedRecord  # what a notebook row holds: a compare experiment or an observed run
FALLBACK_KEY = "batchlab_unsaved_record"  # marks a fallback file written when the notebook refused a save
COLUMNS = ("id", "created_at", "finished_at", "status", "kind", "variable", "keep_mode", "prediction", "formula",
           "observation", "factors", "note", "verdict", "interrupted", "record")
_DB_ERRORS = (sqlite3.Error, OSError)


class NotebookError(ConfigError):
    """A notebook operation failed (one line); ``exit_code`` 2 before measuring, 1 when measurements exist,
    ``fallback`` the JSON file that holds the record when the save failed."""

    def __init__(self, message: str, exit_code: int = 2, fallback: Path | None = None):
        super().__init__("notebook", message)
        self.exit_code, self.fallback = exit_code, fallback


class LeftIncomplete(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during an experiment; the message names the row left ``incomplete``."""


class DamagedRecord(ConfigError):
    """A row whose stored record cannot be read; ``summary`` holds the columns that could."""

    def __init__(self, summary: dict[str, Any], reason: str):
        super().__init__("id", f"#{summary.get('id')}: record unreadable ({reason})")
        self.summary, self.reason = summary, reason

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
            _check_columns(conn, self.path)
            _allow_observed(conn)
        except _DB_ERRORS as e:
            raise NotebookError(f"cannot open {self.path} as a batchlab notebook: {_reason(e)}") from None
        return conn

    def _write(self, what: str, sql: str, args: tuple, exit_code: int = 2) -> int:
        """One statement in its own transaction; any failure is a NotebookError naming ``what``."""
        try:
            with closing(self._connect()) as conn, conn:
                cur = conn.execute(sql, args)
                if cur.rowcount == 0 and sql.lstrip().startswith("UPDATE"):
                    raise sqlite3.OperationalError("the row is gone (deleted, or a different notebook file)")
                return int(cur.lastrowid or 0)
        except NotebookError as e:
            raise NotebookError(f"cannot {what}: {e.message}", exit_code) from None
        except _DB_ERRORS as e:
            raise NotebookError(f"cannot {what} in {self.path}: {_reason(e)}", exit_code) from None

    def begin(self, record: Record) -> int:
        """Insert the experiment as ``incomplete`` (predictions and formula already known); returns its id."""
        d = record.to_dict()
        return self._write(
            "record the experiment before measuring",
            "INSERT INTO experiments (created_at, status, kind, variable, keep_mode, prediction, formula, note, "
            "record) VALUES (?, 'incomplete', ?, ?, ?, ?, ?, ?, ?)",
            (record.created_at or now(), d["kind"], d["change"]["variable"], d["keep_mode"],
             _j(d["predictions"]), _j(d["formula"]), record.note, _j(d)))

    def add(self, record: ObservedRecord) -> int:
        """Insert an observed run (experiment/observed.py) as one complete row; returns its id."""
        d = record.to_dict()
        try:
            return self._write(
                "save the observed run",
                "INSERT INTO experiments (created_at, finished_at, status, kind, variable, keep_mode, prediction, "
                "formula, observation, factors, note, verdict, record) "
                "VALUES (?, ?, 'complete', 'observed', ?, '-', '{}', '{}', ?, ?, ?, ?, ?)",
                (record.created_at or now(), now(), f"observed ({d['source']})",
                 _j({"label": "observed (allocator / wall-clock), nothing controlled", "figures": d["figures"]}),
                 _j(record.factors), record.note, record.short(), _j(d)), exit_code=1)
        except NotebookError as e:
            raise self._fallback(e, d, None) from None

    def complete(self, exp_id: int, record: Record) -> None:
        """The final save; when it fails the whole record goes to a fallback file (NotebookError, exit 1)."""
        d = record.to_dict()
        try:
            self._write("save the measured experiment",
                        "UPDATE experiments SET status='complete', finished_at=?, observation=?, factors=?, "
                        "verdict=?, record=? WHERE id=?",
                        (record.finished_at or now(), _j(observation(d)), _j(d.get("factors")), record.verdict,
                         _j(d), exp_id), exit_code=1)
        except NotebookError as e:
            raise self._fallback(e, d, exp_id) from None

    def interrupt(self, exp_id: int, reason: str) -> bool:
        """Keep the row ``incomplete`` and say why it stopped.  Best effort (called while another error or
        Ctrl-C propagates, which must not be masked): False when the notebook refused."""
        try:
            self._write("mark the experiment interrupted",
                        "UPDATE experiments SET interrupted=? WHERE id=? AND status='incomplete'", (reason, exp_id))
        except NotebookError:
            return False
        return True

    def discard(self, exp_id: int) -> bool:
        """Remove a row begun for input that turned out invalid (bad input leaves nothing behind); best effort."""
        try:
            self._write("discard the row", "DELETE FROM experiments WHERE id=? AND status='incomplete'", (exp_id,))
        except NotebookError:
            return False
        return True

    def _fallback(self, error: NotebookError, d: dict[str, Any], exp_id: int | None) -> NotebookError:
        """Write the record where it fits (beside the notebook, else the working or temporary directory)."""
        from batchlab.util.files import write_atomic

        payload = json.dumps({FALLBACK_KEY: 1, "notebook": str(self.path), "notebook_id": exp_id,
                              "record": to_jsonable(d)}, indent=1)
        name = f"batchlab-unsaved-{(d.get('created_at') or now()).replace(':', '')}-{exp_id or 'new'}.json"
        import tempfile

        for folder in (self.path.parent, Path.cwd(), Path(tempfile.gettempdir())):
            try:
                path = write_atomic(folder / name, payload, "notebook")
            except ConfigError:
                continue
            return NotebookError(f"{error.message}; the whole record is in {path} "
                                 f"(load it later: batchlab notebook import {path})", error.exit_code, path)
        return NotebookError(f"{error.message}; no fallback file could be written either: the record is lost",
                             error.exit_code)

    def import_file(self, path: str | Path) -> int:
        """Load a fallback file: complete its original row when that row is still incomplete, else add a row."""
        from batchlab.config import read_file

        data = read_file("file", path, json.loads, "JSON")
        if not isinstance(data, dict) or data.get(FALLBACK_KEY) != 1 or not isinstance(data.get("record"), dict):
            raise ConfigError("file", f"{path} is not a batchlab fallback file (written when a save failed)")
        d = data["record"]
        try:
            record = ObservedRecord.from_dict(d) if d.get("kind") == "observed" else Record.from_dict(d)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError("file", f"{path}: the record is damaged ({type(e).__name__}: {e})") from None
        if isinstance(record, ObservedRecord):
            return self.add(record)
        old = data.get("notebook_id")
        if isinstance(old, int) and self._incomplete(old, record.created_at):
            self.complete(old, record)
            return old
        exp_id = self.begin(record)
        self.complete(exp_id, record)
        return exp_id

    def _incomplete(self, exp_id: int, created_at: str | None) -> bool:
        rows = list(self._rows("WHERE id=? AND status='incomplete'", (exp_id,)))
        return bool(rows) and rows[0]["created_at"] == created_at

    # -- reads (a missing file is an empty notebook; nothing is created)
    def _rows(self, where: str = "", args: tuple = ()) -> Iterator[sqlite3.Row]:
        if not self.path.exists():
            return iter(())
        try:
            with closing(sqlite3.connect(self.path.resolve().as_uri() + "?mode=ro", uri=True,
                                           timeout=30)) as conn:
                conn.row_factory = sqlite3.Row
                _check_columns(conn, self.path)
                return iter(conn.execute(f"SELECT * FROM experiments {where} ORDER BY id", args).fetchall())
        except NotebookError:
            raise
        except sqlite3.OperationalError as e:
            raise ConfigError("notebook", f"{self.path} is not a batchlab notebook ({e})") from None
        except sqlite3.DatabaseError as e:
            raise ConfigError("notebook", f"{self.path} is not an SQLite database or is damaged ({e})") from None
        except OSError as e:
            raise ConfigError("notebook", f"cannot read {self.path}: {_reason(e)}") from None

    def list(self) -> list[dict[str, Any]]:
        return [_summary(r) for r in self._rows()]

    def get(self, exp_id: int) -> Stored:
        """The whole record of one experiment, with its notebook id and status (DamagedRecord if unreadable)."""
        rows = list(self._rows("WHERE id=?", (exp_id,))) if 0 < exp_id <= INT64_MAX else []
        if not rows:
            raise ConfigError("id", f"no experiment {exp_id} in {self.path}")
        return _record(rows[0])

    def records(self, damaged: list[DamagedRecord] | None = None) -> list[Stored]:
        """Every readable record; the unreadable ones are appended to ``damaged`` (when given) and skipped."""
        out = []
        for row in self._rows():
            try:
                out.append(_record(row))
            except DamagedRecord as e:
                if damaged is not None:
                    damaged.append(e)
        return out


def _reason(e: BaseException) -> str:
    return (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__


def _check_columns(conn: sqlite3.Connection, path: Path) -> None:
    """An ``experiments`` table some other program made: refused before anything reads or rewrites it."""
    have = [r[1] for r in conn.execute("PRAGMA table_info(experiments)")]
    missing = [c for c in COLUMNS if c not in have]
    if missing:
        raise NotebookError(f"{path} holds an 'experiments' table that is not batchlab's (no column "
                            f"{', '.join(missing[:3])}); give another --notebook")


def _allow_observed(conn: sqlite3.Connection) -> None:
    """Notebooks written before observed runs existed restrict ``kind``; rebuild the table once, rows kept."""
    sql = conn.execute("SELECT sql FROM sqlite_master WHERE name='experiments'").fetchone()[0]
    if "'observed'" in sql:
        return
    with conn:
        conn.execute("BEGIN")  # DDL too: a failure half-way must leave the old table as it was
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
    try:
        d = json.loads(row["record"])
        if row["kind"] == "observed":
            return replace(ObservedRecord.from_dict(d), notebook_id=row["id"])
        record = Record.from_dict(d)
        return record.with_(notebook_id=row["id"], status=Status(row["status"]), interrupted=row["interrupted"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:  # damaged or foreign: marked
        raise DamagedRecord(_columns(row), f"{type(e).__name__}: {str(e)[:120]}") from None


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


def _columns(row: sqlite3.Row) -> dict[str, Any]:
    """The plain columns of a row, as text (what can be shown even when the record cannot)."""
    keys = ("id", "created_at", "status", "kind", "variable", "keep_mode", "verdict", "note", "interrupted")
    return {k: row[k] if isinstance(row[k], (int, str)) or row[k] is None else str(row[k]) for k in keys}


def _summary(row: sqlite3.Row) -> dict[str, Any]:
    c = _columns(row)
    return {**c, "created_at": str(c["created_at"] or ""), "variable": str(c["variable"] or ""),
            "verdict": str(c["verdict"] or ""), "note": str(c["note"] or ""), "short": _short(row)}


def _short(row: sqlite3.Row) -> str:
    try:
        return short_verdict(_record(row))
    except DamagedRecord as e:  # a damaged or foreign row: listed, marked, not fatal
        return f"(record unreadable: {e.reason})"
