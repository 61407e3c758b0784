"""The warm worker: torch and the measurement stack imported once per batchlab process, and each isolated
measurement a fork of that pre-imported, pristine process (what a fresh Python pays to import torch is saved
per measurement: docs/cpu.md).

The pre-imported process is started as the fresh worker is (``python -P -m batchlab.measure.worker --warm FD``,
``child_env()``: glibc reads the allocator regime's MALLOC_* at process start, so it must start with them), lazily
on the first isolated run, once per start-up environment (``STARTUP``: a changed regime or thread count, or a
PYTHONPATH without one of its entries, starts a new one).  It imports,
then runs no torch op and starts no thread: after ``import torch`` its one extra native thread is numpy's
OpenBLAS ``blas_thread_server`` (gdb), which OpenBLAS's own ``pthread_atfork`` handler
(``openblas_fork_handler``) joins before each fork and restarts lazily, so a fork holds no lock of it.  CUDA
is never initialised here (each fork initialises its own; a process that initialised CUDA cannot fork
children that use it): ``torch.cuda.is_initialized()`` or more threads than after the imports make it
refuse, and the caller starts a fresh process.  Nothing of the caller is inherited (it is not a fork of
batchlab), so a caller that uses CUDA itself is no concern.

Not the stdlib's forkserver: it is one per process, shared with the user's own multiprocessing, started with
os.environ as it is then (no place for the regime without changing the caller's environment); its children
get the caller's sys.path (the working directory included) and re-import the caller's ``__main__``; and they
write to the server's stdout, not to one pipe per measurement.

Protocol: one SOCK_SEQPACKET socket pair.  batchlab sends a request (JSON: out, cwd, request) with two fds,
the measurement's output pipe and its status pipe; the fork leads its own session, writes its output there,
and the pre-imported process writes the fork's pid, then its exit status (as Popen's returncode), to the
status pipe.  Batchlab closing its end (exit, even SIGKILL) ends the pre-imported process, and each fork's
lifeline (``lifeline.guard``, watching that process) ends the forks.  Linux and macOS' fork only where
``os.fork`` exists; elsewhere None, and the caller starts a fresh process.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable

from batchlab.util.lifeline import PARENT_ENV, guard, module_command
from batchlab.host import preload

# what every measurement imports: torch (~2 s of CPU here), torch._dynamo (imported by the first optimizer an
# update builds: ~1-1.7 s more), batchlab's measuring stack (~0.1 s) with what a compare's forks import next (the
# formula, the built-in GPT, the timeline recorder), so that no fork imports them again
PRELOAD = ("torch", "torch._dynamo", "batchlab.measure.session", "batchlab.measure.harness",
           "batchlab.measure.result", "batchlab.formula", "batchlab.models.gpt", "batchlab.measure.timeline_update")
READY = b"ready"
START_TIMEOUT_S = 120.0  # the imports: ~2 s here, more on a loaded machine or a cold disk
MAX_REQUEST = 1 << 20
FORKED, FRESH = "forked from a pre-imported process", "fresh process"
ENABLED = hasattr(os, "fork") and hasattr(socket, "send_fds")  # tests switch it off to compare with FRESH
# What a process reads once, as it starts or imports PRELOAD: the interpreter (PYTHON*: PYTHONPATH is sys.path),
# glibc's allocator and loader (MALLOC_*, GLIBC_TUNABLES, LD_*), the OpenMP / BLAS runtimes torch loads (OMP_*,
# KMP_*, GOMP_*, MKL_*, OPENBLAS_*) and torch (TORCH*, PYTORCH_*, CUDA_*).  A pre-imported process is started for
# these; every other variable is read later, in the fork, whose os.environ is exactly its run's.
STARTUP = ("PYTHON", "MALLOC_", "GLIBC_TUNABLES", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH",
           "PYTORCH_", "CUDA_")


def _started_for(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP)}


def _paths(env: dict[str, str]) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _serves(started: dict[str, str], env: dict[str, str]) -> bool:
    """Can a process started in ``started`` run a measurement of ``env``?  The same start-up variables, and a
    PYTHONPATH that keeps every entry the process started with (a fork puts the run's own first on sys.path:
    a factory in a folder added since imports there)."""
    had, want = _started_for(started), _started_for(env)
    had.pop("PYTHONPATH", None)
    want.pop("PYTHONPATH", None)
    return had == want and set(_paths(started)) <= set(_paths(env))


class Forked:
    """One measurement forked from the pre-imported process, as the runner uses a Popen: pid (its session and
    process group), stdout (its merged output), wait(timeout) -> returncode, or None if the pre-imported
    process died first (the fork's lifeline then ends it)."""

    def __init__(self, pid: int, stdout: io.TextIOBase, status: int):
        self.pid, self.stdout, self._status = pid, stdout, status
        self.returncode: int | None = None

    def fileno(self) -> int | None:
        """The status pipe, readable once the fork has ended (for select() over several forks); None after."""
        return self._status

    def wait(self, timeout: float | None = None) -> int | None:
        if self._status is not None:
            ready, _, _ = select.select([self._status], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired("forked worker", timeout)
            line = _line(self._status)
            os.close(self._status)
            self._status = None
            self.returncode = int(line) if line.lstrip("-").isdigit() else None
        return self.returncode


def _line(fd: int) -> str:
    """One line from a pipe, read unbuffered (a buffer could hide the next line from select()); "" at EOF."""
    out = b""
    while not out.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            break
        out += byte
    return out.decode().strip()


class _Server:
    """The pre-imported process, started with ``env``: ``fork(...)`` asks it for one measurement."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(module_command("batchlab.measure.worker", "--warm", str(theirs.fileno())),
                                         env=env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        self.sock = ours
        try:
            ready, _, _ = select.select([ours], [], [], START_TIMEOUT_S)
            if not ready or ours.recv(16) != READY:  # an empty read: it exited (its imports failed)
                raise OSError("the pre-imported process did not start")
        except BaseException:
            self.close()
            raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, out: Path, request: dict, env: dict[str, str], entry: str | None = None,
             preload: tuple[str, ...] = ()) -> Forked | None:
        out_r, out_w = os.pipe()
        status_r, status_w = os.pipe()
        try:
            cwd = os.getcwd()
        except OSError:  # removed under us: the fork stays where the pre-imported process is
            cwd = None
        msg = json.dumps({"out": str(out), "cwd": cwd, "env": env, "request": request, "entry": entry,
                          "preload": list(preload)}).encode()
        try:
            socket.send_fds(self.sock, [msg], [out_w, status_w])
        except OSError:
            for fd in (out_r, status_r):
                os.close(fd)
            return None
        finally:
            os.close(out_w)
            os.close(status_w)
        first = _line(status_r)  # the pid once the fork leads its session; "refused ..." or EOF: no fork
        if not first.isdigit():
            os.close(status_r)
            os.close(out_r)
            return None
        return Forked(int(first), io.open(out_r, "r", errors="replace"), status_r)

    def close(self) -> None:
        self.sock.close()  # its end reads EOF: it exits
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_lock = threading.Lock()
_server: _Server | None = None
_failed_env: dict[str, str] | None = None  # an environment it would not start in: not tried again
_not_preloaded: set[str] = set()  # asked for when a fork was refused: left to the forks


def pre_imported(env: dict[str, str]) -> _Server | None:
    """The pre-imported process started with ``env`` (started, or started again, as needed); None where there
    can be none (no fork here, or it would not start): the caller starts a fresh process."""
    global _server, _failed_env
    if not ENABLED:
        return None
    with _lock:
        if _server is not None and (not _serves(_server.env, env) or not _server.alive()):
            _server.close()
            _server = None
        if _server is None and _started_for(env) != _failed_env:
            try:
                _server = _Server(env)
            except OSError:
                _failed_env = _started_for(env)
        return _server


def fork(server: _Server, out: Path, request: dict, env: dict[str, str], entry: str | None = None,
         preload: tuple[str, ...] = ()) -> Forked | None:
    """``request`` measured in ``env`` by a fork of ``server``; None if it refused or died (the next run starts a
    new one).  ``entry``: ``"module:function"`` run in the fork instead of a measurement (a DP rank:
    distributed/forked.py), called as the measurement is: ``function(out, request, parent_pid) -> exit status``,
    with the lifeline already watching the pre-imported process (``out``'s folder goes when it dies).
    ``preload``: modules ``server`` imports first, once, for this and later forks (host/preload.py); after
    a refusal they are not asked for again."""
    global _server
    with _lock:
        preload = tuple(n for n in preload if n not in _not_preloaded)
        forked = server.fork(out, request, env, entry, preload)
        if forked is None:
            _not_preloaded.update(preload)
            server.close()
            if _server is server:
                _server = None
        return forked


@atexit.register
def _close() -> None:
    """At batchlab's exit: the pre-imported process ends and is waited for (its CPU time counts as this
    process's children's, as a fresh worker's does)."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


def server_pid() -> int | None:
    """The pre-imported process's pid, if one is running (tests; the gradient check forks only from a running one)."""
    return _server.proc.pid if _server is not None and _server.alive() else None


# ------------------------------------------------------------------------- the pre-imported process

_STARTED_PATHS: list[str] = []  # the pre-imported process's PYTHONPATH entries (its forks replace them)


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def serve(fd: int, measure: Callable[[Path, dict, int], int]) -> int:
    """The pre-imported process's loop: ``measure(out, request, parent_pid)`` runs in each fork."""
    os.environ.pop(PARENT_ENV, None)  # its forks watch this process, not batchlab (it watches batchlab's end)
    _STARTED_PATHS[:] = _paths(dict(os.environ))
    sock = socket.socket(fileno=fd)
    # no collection while importing: the imports create about a million objects and free almost none, so the
    # collections they would trigger find nothing (~15% of the imports' CPU here, ~0.7 s); frozen before
    # collecting again, none of that work is deferred to the forks either
    gc.disable()
    for name in PRELOAD:
        importlib.import_module(name)
    import torch

    gc.freeze()  # the imports' objects out of the forks' collections: a collection there copies none of their pages
    gc.enable()
    baseline = _threads()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select() when a fork exits
    sock.send(READY)
    children: dict[int, tuple[int, Path]] = {}  # pid -> its status pipe, its folder
    libs = preload.Loaded()
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 512)
        _reap(children)
        if sock not in ready:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, 2)
        if not msg:  # batchlab closed its end or died: what it left running goes, with its folders
            _abandon(children)
            return 0
        out_w, status_w = fds
        req = json.loads(msg)
        libs.load(req.get("preload", ()), os.environ, req["env"])
        why = ("CUDA initialised" if torch.cuda.is_initialized() else
               f"{_threads()} threads, {baseline} after the imports" if _threads() > baseline else
               libs.refusal(os.environ, req["env"], [p for p in _paths(req["env"]) if p not in _STARTED_PATHS]))
        if why is not None:
            os.write(status_w, f"refused: {why}\n".encode())
            os.close(out_w)
            os.close(status_w)
            return 1
        keep = (sock.fileno(), wake_r, wake_w, *(fd for fd, _ in children.values()))
        pid = _fork(req, out_w, status_w, keep, measure)
        os.close(out_w)
        children[pid] = (status_w, Path(req["out"]).parent)
        _tell(status_w, str(pid), children[pid][1])


def _tell(status_w: int, line: str, folder: Path) -> None:
    """A line to the runner; none is listening if batchlab died (a fork whose output pipe broke may end before
    its lifeline sees that): its folder then goes here."""
    try:
        os.write(status_w, f"{line}\n".encode())
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)


def _reap(children: dict[int, tuple[int, Path]]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            fd, folder = children.pop(pid)
            _tell(fd, str(os.waitstatus_to_exitcode(status)), folder)
            os.close(fd)


def _abandon(children: dict[int, tuple[int, Path]]) -> None:
    for pid, (fd, folder) in children.items():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # each fork leads its own group
        os.waitpid(pid, 0)
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)


def _fork(req: dict, out_w: int, status_w: int, keep: tuple[int, ...], measure) -> int:
    """Fork one measurement; returns once the fork leads its own session (the runner kills its group)."""
    parent = os.getpid()
    ack_r, ack_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            os.write(ack_w, b"s")
            code = _child(req, out_w, (status_w, ack_r, ack_w, *keep), parent, measure)
        except BaseException:  # noqa: BLE001 — reported on its output, the runner shows the tail
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(ack_w)
    os.read(ack_r, 1)  # "s", or EOF if it died first
    os.close(ack_r)
    return pid


def _child(req: dict, out_w: int, inherited: tuple[int, ...], parent: int, measure) -> int:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_w, 1)
    os.dup2(out_w, 2)
    for fd in (null, out_w, *inherited):
        os.close(fd)
    os.environ.clear()  # exactly the run's environment, as a fresh worker's (only STARTUP is ours for certain)
    os.environ.update(req["env"])
    ours = set(_STARTED_PATHS)
    sys.path[:] = _paths(req["env"]) + [p for p in sys.path if p not in ours]  # as the run's interpreter orders it
    importlib.invalidate_caches()  # a folder's listing as it is now (a factory written since this process started)
    if req["cwd"] is not None:
        os.chdir(req["cwd"])
    sys.argv = [sys.argv[0], req["out"]]
    if req.get("entry"):  # a rank: it dies with this process (batchlab's death ends it), removing its job's folder
        module, name = req["entry"].split(":")
        measure = getattr(importlib.import_module(module), name)
        guard(Path(req["out"]).parent, parent)
    code = measure(Path(req["out"]), req["request"], parent)
    atexit._run_exitfuncs()  # as a fresh worker's interpreter would at exit
    sys.stdout.flush()
    sys.stderr.flush()
    return code
