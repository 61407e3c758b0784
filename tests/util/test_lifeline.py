"""No process left behind, nothing from the working directory run.

A batchlab parent killed with SIGKILL (no handler runs) or SIGTERM (handled like Ctrl-C, exit 143): every
process it started — the isolated worker (the pre-imported process and the fork of it that measures), the
ranks forked from it, or torchrun and its ranks — is gone within 5 s and the temporary folder is removed.  The descendants' pids are
read from /proc (ppid links and the ranks' pid files), then watched in /proc until they vanish.  A
`statistics.py` / `json.py` in the working directory never runs."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")
TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64", "--seq", "16", "--micro-batch", "2"]
# after the fork appears: it imports nothing, so it is in its updates well within this (each second waited is a
# CPU-second of updates)
FORK_MEASURING_S = 0.5
linux = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _children(parent: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _workers(parent: int) -> list[int]:
    """The isolated workers under ``parent``: a fresh worker, or the pre-imported process and its forks."""
    out, todo = [], _children(parent)
    while todo:
        pid = todo.pop()
        if "batchlab.measure.worker" in _cmdline(pid):
            out.append(pid)
            todo.extend(_children(pid))
    return out


def _measuring(tmp: Path):
    """The worker's temporary folder (the parent's TMPDIR is ``tmp``), once it has one."""
    return next(iter(tmp.glob("batchlab-measure-*")), None)


def _wait_for(predicate, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = predicate()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _start(*argv: str, cwd: Path) -> subprocess.Popen:
    (cwd / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(cwd / "tmp")}
    # -P: like the installed `batchlab` script, which does not put the working directory on sys.path
    return subprocess.Popen([sys.executable, "-P", "-m", "batchlab", *argv], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _assert_all_gone(pids: list[int], folders: list[Path], within: float = 5.0) -> None:
    end = time.monotonic() + within
    while time.monotonic() < end and (any(map(_alive, pids)) or any(f.exists() for f in folders)):
        time.sleep(0.1)
    left = [f"{p}: {_cmdline(p)[:120]}" for p in pids if _alive(p)]
    assert not left, f"still running {within} s after the parent died: {left}"
    assert not [f for f in folders if f.exists()], "temporary folder left behind"


@pytest.mark.slow
@linux
@pytest.mark.skipif(sys.version_info < (3, 11), reason="the parent runs with -P")
def test_an_isolated_worker_dies_with_its_parent_killed_by_sigkill(tmp_path, plant_shadows):
    """Started in a folder of modules named like the stdlib's, which no process (the parent, the pre-imported
    process, its fork) imports.  (SIGTERM and SIGINT of a parent with an isolated worker:
    test_ctrl_c_and_sigterm_of_compare_name_the_incomplete_row; DDP ranks: distributed/test_ddp_on_gloo.py.)"""
    marker = plant_shadows(tmp_path)
    parent = _start("measure", "--isolate", "--steps", "100000", "--timeout", "300", *TINY, cwd=tmp_path)
    try:
        folder = _wait_for(lambda: _measuring(tmp_path / "tmp"), 60, "the worker's folder")
        _wait_for(lambda: len(_workers(parent.pid)) >= 2 or None, 60, "the pre-imported process and its fork")
        time.sleep(FORK_MEASURING_S)
        workers = _workers(parent.pid)
        assert workers and all(map(_alive, workers)) and folder.exists()
        parent.send_signal(signal.SIGKILL)
        rc = parent.wait(30)
        _assert_all_gone(workers, [folder])
    finally:
        parent.kill()
    assert rc == -signal.SIGKILL
    assert not marker.exists(), marker.read_text()


@linux
@pytest.mark.slow
@pytest.mark.skipif(sys.version_info < (3, 11), reason="the parent runs with -P")
# SIGKILL of a parent whose pre-imported process has forks is test_an_isolated_worker_dies_with_its_parent's case
@pytest.mark.parametrize("sig, launcher", [(signal.SIGKILL, "torchrun"), (signal.SIGTERM, "fork")])
def test_dp_ranks_and_their_launcher_die_with_their_parent(tmp_path, sig, launcher):
    """torchrun (under batchlab.util.lifeline) and its ranks, or the pre-imported process and the ranks forked from it."""
    parent = _start("measure", "--nproc", "2", "--dp", "2", "--steps", "100000", "--timeout", "300",
                    "--launcher", launcher, "--no-calibrate", *TINY, cwd=tmp_path)
    try:
        folder = _wait_for(lambda: next(iter((tmp_path / "tmp").glob("batchlab-ddp-*")), None), 60, "the folder")
        ranks = _wait_for(lambda: [int(f.read_text()) for f in folder.glob("rank*.pid") if f.read_text().strip()]
                          if len(list(folder.glob("rank*.pid"))) == 2 else None, 120, "both ranks")
        module = "batchlab.util.lifeline" if launcher == "torchrun" else "batchlab.measure.worker"
        starter = [p for p in _children(parent.pid) if module in _cmdline(p)]
        time.sleep(FORK_MEASURING_S)
        assert len(starter) == 1 and all(map(_alive, [*starter, *ranks]))
        parent.send_signal(sig)
        rc = parent.wait(30)
        _assert_all_gone([*starter, *ranks], [folder])
    finally:
        parent.kill()
    assert rc == (-signal.SIGKILL if sig == signal.SIGKILL else 143)


@linux
@pytest.mark.skipif(sys.version_info < (3, 11), reason="the parent runs with -P")
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_of_compare_name_the_incomplete_row(tmp_path, sig, code):
    import sqlite3

    book = tmp_path / "nb.sqlite"
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(tmp_path / "tmp")}
    # SIGINT restored to its default: a process started from a non-interactive shell may inherit it ignored;
    # --no-calibrate: calibrating (or finding the cache: it imports torch here) comes before any measurement
    parent = subprocess.Popen([sys.executable, "-P", "-m", "batchlab", "compare", "--predict", "none", "--no-verify",
                               "--no-calibrate", "--steps", "100000", "--timeout", "300", "--notebook", str(book),
                               *TINY[:-2]],
                              cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for(lambda: len(_workers(parent.pid)) >= 2 or None, 60, "the pre-imported process and its fork")
        folder = _wait_for(lambda: _measuring(tmp_path / "tmp"), 60, "the worker's folder")
        time.sleep(FORK_MEASURING_S)
        workers = _workers(parent.pid)
        parent.send_signal(sig)
        _, err = parent.communicate(timeout=30)
        _assert_all_gone(workers, [folder])
    finally:
        parent.kill()
    assert parent.returncode == code, err
    assert "interrupted: experiment #1 left incomplete in" in err and "Traceback" not in err, err
    with sqlite3.connect(book) as conn:
        status, why = conn.execute("SELECT status, interrupted FROM experiments").fetchone()
    assert status == "incomplete" and why.startswith(("KeyboardInterrupt", "Terminated")), why


def test_the_python_3_10_form_of_dash_p_drops_the_working_directory_too(tmp_path, plant_shadows):
    """module_command() on 3.10 has no -P: the -c form removes sys.path[0] before anything is imported."""
    from batchlab.util import lifeline

    marker = plant_shadows(tmp_path)
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "probe_main.py").write_text("import json, statistics, sys\nprint(statistics.__file__, sys.argv[1:])\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(mods)])}
    safe = subprocess.run([sys.executable, "-c", lifeline._SAFE_MAIN, "probe_main", "x"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert not marker.exists() and safe.returncode == 0, safe.stderr
    assert str(tmp_path) not in safe.stdout.split()[0] and safe.stdout.split()[1:] == ["['x']"]
    unsafe = subprocess.run([sys.executable, "-m", "probe_main"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert marker.exists() and unsafe.returncode != 0  # the reference: plain -m does run the planted file


def test_a_killed_torchrun_is_reported_as_that_not_as_a_silent_rank(tmp_path):
    from batchlab.distributed.failures import diagnose

    for r in (0, 1):  # both ranks started, then torchrun was killed and they died with it (no result, no error)
        (tmp_path / f"rank{r}.pid").write_text(str(1000 + r))
    failure = diagnose(tmp_path, -signal.SIGKILL, "", 600)
    assert failure.rank is None and failure.detail.startswith("torchrun was killed by SIGKILL"), failure.detail
    assert "rank 0" not in failure.detail
    failure = diagnose(tmp_path, 1, "", 600)  # torchrun exited by itself: a rank is named, as before
    assert failure.rank == 0
