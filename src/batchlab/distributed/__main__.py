"""Entry point of one rank, started by torchrun: ``python -m batchlab.distributed --spec S --out DIR``, or
forked from the pre-imported process (``forked``, distributed/forked.py).

Writes ``DIR/rank<k>.pid`` at start, then ``DIR/rank<k>.json`` (its result) or ``DIR/rank<k>.error.json``
(exception); local rank 0 also writes ``DIR/world.json``, every rank's result gathered over the process
group (so each node of a multi-node run has them all).  A rank killed by a signal writes nothing more;
the launcher reads that silence.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank if torchrun dies, so no rank outlives its launcher."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
        parent = os.getppid()
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
    except (OSError, AttributeError):
        pass


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)  # atomic: the launcher never reads half a file


def error_record(rank: int, exc: BaseException) -> dict:
    from batchlab.config import ConfigError
    from batchlab.measure.oom_classify import classify_oom

    kind = classify_oom(exc)
    lines = str(exc).strip().splitlines()
    return dict(rank=rank, time=time.time(), type=type(exc).__name__, message=lines[0][:300] if lines else "",
                field=exc.field if isinstance(exc, ConfigError) else None,
                field_message=exc.message if isinstance(exc, ConfigError) else None, oom=kind.value if kind is not None else None,
                traceback="".join(traceback.format_exception(exc))[-4000:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchlab.distributed")
    ap.add_argument("--spec", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    _die_with_parent()
    run(args.spec, args.out)


def forked(out: Path, request: dict, parent: int) -> int:
    """One rank forked from the pre-imported process (distributed/forked.py): ``request`` names the spec; the
    lifeline watches that process (batchlab's death ends it, and then this rank, which removes ``out``'s folder)."""
    run(Path(request["spec"]), out.parent)


def run(spec: Path, out: Path) -> None:
    """The rank: its result and every rank's (local rank 0) into ``out``; never returns (``os._exit``)."""
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    try:
        from batchlab.distributed.worker import RankSpec, gather, run_rank

        result = run_rank(RankSpec(**json.loads(spec.read_text())))
        write_json(out / f"rank{rank}.json", result)
        everyone = gather(result)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher as a record
        write_json(out / f"rank{rank}.error.json", error_record(rank, exc))
        sys.stderr.write(f"rank {rank}: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        os._exit(1)  # skip process-group teardown: a dead peer would make it hang
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # every node's launcher gets all ranks' results
        write_json(out / "world.json", everyone)
    import torch.distributed as dist

    # Every rank has its results on disk; leave together and skip C++ teardown: tearing down gloo and
    # DDP's reducer at interpreter exit can abort a rank ("terminate called without an active exception",
    # SIGABRT; docs/cpu.md).
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
