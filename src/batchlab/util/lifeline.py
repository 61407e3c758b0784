"""Child processes that run only what was named and never outlive batchlab.

``module_command(module, ...)`` starts ``python -m module`` without the working directory on sys.path
(``-P``, Python >= 3.11; on 3.10 the same done by hand), so a ``statistics.py`` or ``json.py`` lying in the
directory where batchlab was started is never imported.  ``guard(folder)``, called first thing in a child,
watches the parent: when it dies (even by SIGKILL, which no handler sees) the child kills the ranks whose
pid files are in ``folder``, removes ``folder`` and kills its own process group, within POLL_S.  Used as a
main (``python -m batchlab.util.lifeline FOLDER MODULE ARGS...``) it guards a module it does not own (torchrun).
``terminate_as_interrupt()`` makes SIGTERM unwind like Ctrl-C (rows marked interrupted, children killed).
Pure Python, Linux and macOS.
"""
from __future__ import annotations

import os
import runpy
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

POLL_S = 0.2  # how often a child checks that its parent is alive
PARENT_ENV = "BATCHLAB_PARENT_PID"
SIGTERM_EXIT = 128 + signal.SIGTERM  # 143, the shell's code for "ended by SIGTERM"
# -c form of -P for Python 3.10: drop sys.path[0] (the working directory) before anything is imported
_SAFE_MAIN = ("import sys; del sys.path[0]; import runpy; m = sys.argv.pop(1); "
              "runpy.run_module(m, run_name='__main__', alter_sys=True)")


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args`` with a safe sys.path: only the interpreter's paths and PYTHONPATH."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module, *args]
    return [sys.executable, "-c", _SAFE_MAIN, module, *args]


def safe_env(env: dict[str, str]) -> dict[str, str]:
    """The environment for children: PYTHONSAFEPATH=1 (3.11+; the -P of every Python they start in turn,
    such as torchrun's ranks)."""
    out = dict(env)
    out["PYTHONSAFEPATH"] = "1"
    out[PARENT_ENV] = str(os.getpid())  # read by guard(): a parent that died before the child looked is seen too
    return out


def guard(folder: Path | None = None, parent: int | None = None) -> Callable[[], None]:
    """Die with the parent: a daemon thread polls the parent pid (SIGKILL of the parent runs no handler here).
    ``parent``: the pid to watch when it is not the one that started this process's program (a fork's
    parent, which made the fork before it looked).  Returns ``check``, to call before exiting: a child whose
    parent died under it may end by itself first (its output pipe broke) and must still clean up."""
    started_by = int(os.environ.pop(PARENT_ENV, os.getppid()))  # popped: what this child starts has its own parent
    parent = started_by if parent is None else parent

    def check() -> None:
        if os.getppid() != parent:
            abandon(folder)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        abandon(folder)

    threading.Thread(target=watch, name="batchlab-lifeline", daemon=True).start()
    return check


def runs(pid: int, marker: str) -> bool:
    """Is ``pid`` still a process whose command line holds ``marker`` (one batchlab started, not a reused pid)?"""
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def kill_group(pgid: int) -> None:
    """SIGKILL process group ``pgid`` (a child batchlab started in a session of its own), if it is still there."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def abandon(folder: Path | None) -> None:
    """The parent is gone: kill the ranks recorded in ``folder``, remove it, then this process and its group."""
    if folder is not None:
        for pid_file in folder.glob("rank*.pid"):
            try:
                pid = int(pid_file.read_text())
            except (OSError, ValueError):
                continue
            if runs(pid, str(folder)):
                kill_group(pid)  # each rank leads its own session (torchrun starts it so)
        shutil.rmtree(folder, ignore_errors=True)
    if os.getpgrp() == os.getpid():  # a group leader: everything it started goes too
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


class Terminated(KeyboardInterrupt):
    """SIGTERM, unwinding like Ctrl-C (``finally`` blocks and ``except BaseException`` cleanups run)."""


_received: list[int] = []


def terminate_as_interrupt() -> None:
    def handler(signum, frame):
        _received.append(signum)
        raise Terminated(f"ended by {signal.Signals(signum).name}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def terminated() -> bool:
    """Did SIGTERM (rather than Ctrl-C) end this run?"""
    return bool(_received)


def main(argv: list[str]) -> None:
    folder, module, *args = argv[1:]
    guard(Path(folder))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv)
