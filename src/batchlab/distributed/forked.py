"""Local ranks forked from the pre-imported process (host/warm.py) instead of started by torchrun.

A rank started by torchrun is a fresh interpreter: ~2 s of CPU importing torch and ~2 s more importing
torch._dynamo (DDP's and FSDP2's wrappers need it) before its first update, and torchrun's agent imports torch
too.  On one node, on CPU, where ``os.fork`` exists, each rank is instead a fork of the process that imported
them once per batchlab process, given the environment torchrun would give it (``rank_env``: env:// reads it;
the process group's store is served by rank 0, as under ``torchrun --standalone``).  What a rank runs is the
same function either way.  The launcher here does torchrun's part: it waits for every rank, and when one fails
it sends the others SIGTERM (as torchrun does), then SIGKILL after GRACE_S; on a timeout it kills them all.
Multi-node runs and CUDA keep torchrun (a fork never initialises CUDA after its parent: measure/runner.py).
"""
from __future__ import annotations

import os
import select
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from batchlab.host import free_port
from batchlab.host import warm
from batchlab.util.lifeline import kill_group

LAUNCHER = "forked from a pre-imported process"
GRACE_S = 5.0  # after a rank fails: how long its peers get to leave on SIGTERM before SIGKILL


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What ``torchrun --standalone`` gives local rank ``rank`` of ``world`` (init_process_group's env:// reads it)."""
    return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port))


@dataclass(frozen=True)
class Ranks:
    """How the forked ranks ended: ``codes`` per rank as Popen's returncode (negative: the signal; None: lost
    with the pre-imported process), ``timed_out``, their merged output, and their pids."""

    codes: dict[int, int | None]
    timed_out: bool
    log: str
    pids: dict[int, int]
    server_pid: int | None


def run(world: int, entry: str, request: dict, folder: Path, env: dict[str, str], timeout_s: float,
        preload: tuple[str, ...] = ()) -> Ranks | None:
    """``entry`` (``module:function``, called as ``function(folder / "rankK", request, parent)``) in ``world``
    ranks forked from the pre-imported process started with ``env`` (``preload``: modules it imports first,
    host/preload.py); None where none can be forked (the caller starts its ranks another way)."""
    server = warm.pre_imported(env)
    if server is None:
        return None
    port = free_port()
    forks: dict[int, warm.Forked] = {}
    logs: list[list[str]] = []
    readers = []
    try:
        for k in range(world):
            f = warm.fork(server, folder / f"rank{k}", request, {**env, **rank_env(k, world, port)}, entry, preload)
            if f is None:
                return None
            forks[k] = f
            logs.append([])
            readers.append(threading.Thread(target=_drain, args=(f, k, logs[-1]), daemon=True))
            readers[-1].start()
        codes, timed_out = _wait(forks, timeout_s)
    finally:
        _kill(forks)
    for r in readers:
        r.join(timeout=5)
    return Ranks(codes, timed_out, "".join(line for lines in logs for line in lines),
                 {k: f.pid for k, f in forks.items()}, warm.server_pid())


def _drain(f: warm.Forked, rank: int, into: list[str]) -> None:
    """A rank's merged stdout/stderr, read as it comes (a full pipe would block the rank)."""
    for line in f.stdout:
        into.append(f"[rank {rank}] {line}")
    f.stdout.close()


def _wait(forks: dict[int, warm.Forked], timeout_s: float) -> tuple[dict[int, int | None], bool]:
    """Every rank's exit status; after the first failure the others get SIGTERM, then SIGKILL after GRACE_S."""
    codes: dict[int, int | None] = {}
    deadline = time.monotonic() + timeout_s
    kill_at = None
    while len(codes) < len(forks):
        now = time.monotonic()
        if now >= deadline:
            return codes, True
        if kill_at is not None and now >= kill_at:
            _signal(forks, codes, signal.SIGKILL)
            kill_at = float("inf")
        pending = {f.fileno(): k for k, f in forks.items() if k not in codes}
        ready, _, _ = select.select(list(pending), [], [], min(deadline, kill_at or deadline) - now)
        for fd in ready:
            k = pending[fd]
            codes[k] = forks[k].wait(0)
            if codes[k] != 0 and kill_at is None:  # torchrun's rule: one rank failed, the job is over
                _signal(forks, codes, signal.SIGTERM)
                kill_at = time.monotonic() + GRACE_S
    return codes, False


def _signal(forks: dict[int, warm.Forked], done: dict, sig: int) -> None:
    for k, f in forks.items():
        if k not in done:
            try:
                os.killpg(f.pid, sig)  # each fork leads its own session
            except (ProcessLookupError, PermissionError):
                pass


def _kill(forks: dict[int, warm.Forked]) -> None:
    """No rank outlives the launch: SIGKILL whatever is left, and reap it."""
    for f in forks.values():
        if f.fileno() is not None:
            kill_group(f.pid)
            try:
                f.wait(10)
            except Exception:  # noqa: BLE001 - the pre-imported process is gone: nothing left to reap here
                pass
