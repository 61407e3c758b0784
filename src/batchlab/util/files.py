"""Writing files so that a failure leaves nothing half-written: a temporary file in the target's directory,
then ``os.replace`` (atomic on POSIX); on any error the temporary file is removed and one ConfigError
names the file and the reason (read-only directory, full disk).  Pure Python."""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterable, Iterator

from batchlab.util.errors import ConfigError


def write_atomic(path: str | Path, data: str | bytes, field: str = "output") -> Path:
    """Write ``data`` to ``path`` all at once or not at all."""
    return write_all({Path(path): data}, field)[0]


def write_all(files: dict[Path, str | bytes], field: str = "output") -> list[Path]:
    """Every file or none: each is written to a temporary sibling first; only when all are complete are they
    renamed into place (a failure leaves the directory as it was, apart from files replaced before it)."""
    staged: list[tuple[str, Path]] = []
    target = next(iter(files), Path())
    try:
        for target, data in files.items():
            staged.append((_stage(target, data), target))
        for tmp, target in staged:
            os.replace(tmp, target)
    except OSError as e:
        _remove(tmp for tmp, _ in staged)
        # the user's path, not the temporary sibling the error happened on
        raise ConfigError(field, f"cannot write {target}: {e.strerror or e}") from None
    return [path for _, path in staged]


def _stage(path: Path, data: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide a report from the rest of the team
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())  # a full disk shows here, not after the rename
    except BaseException:
        _remove([tmp])
        raise
    return tmp


def _remove(paths: Iterable[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


# locks held, by path and thread: a nested ``held_lock`` of one in the same thread is already held (another thread
# waits, as another process does)
_HELD: dict[tuple[Path, int], int] = {}


@contextlib.contextmanager
def held_lock(path: Path, waiting: str = "") -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created) while the block runs: one process (or thread) at a time;
    reentrant within a thread.  ``waiting`` is said on stderr where another process holds it.  Where the platform has no
    ``fcntl`` (Windows) or the file system refuses the lock (a read-only folder, ENOLCK on some network homes), the
    block runs unlocked."""
    key = (Path(path).resolve(), threading.get_ident())
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a")
    except (ImportError, OSError):
        yield
        return
    with f:
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if waiting:
                    print(waiting, file=sys.stderr, flush=True)
                fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        except OSError:
            yield
            return
        _HELD[key] = 1
        try:
            yield
        finally:
            del _HELD[key]
