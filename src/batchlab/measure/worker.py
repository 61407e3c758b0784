"""``python -m batchlab.measure.worker OUT.json``: one measurement in this process of its own.

Reads ``{"config": RunConfig.to_dict(), "options": MeasureOptions.to_dict()}`` from stdin, writes the
Measurement JSON (or ``{"config_error": {"field", "message"}}`` with exit status 2) to OUT.json, and
progress lines to stderr.  ``--warm FD``: the pre-imported process of batchlab.host.warm, each of whose
forks runs ``measure_into`` for one request.  Run by batchlab.measure.runner; not meant to be started by hand.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from batchlab.config import ConfigError, config_from_dict
from batchlab.util.lifeline import guard
from batchlab.measure.options import MeasureOptions
from batchlab.measure.runner import PROGRESS_PREFIX


def _progress(done: int, total: int, label: str) -> None:
    sys.stderr.write(f"{PROGRESS_PREFIX}{done}\t{total}\t{label}\n")
    sys.stderr.flush()


def _write(path: Path, payload: dict) -> None:
    # write then rename: the runner never reads a half-written result
    tmp = path.with_suffix(".part")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def measure_into(out: Path, request: dict | None = None, parent: int | None = None) -> int:
    """One measurement, its result written to ``out``; ``request`` None: read from stdin.  The exit status."""
    check = guard(out.parent, parent)  # batchlab killed (even by SIGKILL): this worker and its folder go too
    try:
        request = json.loads(sys.stdin.read()) if request is None else request
        cfg = config_from_dict(request["config"])
        options = MeasureOptions.from_dict(request["options"])
        from batchlab.measure.result import measurement_to_dict
        from batchlab.measure.session import run_inprocess

        m = run_inprocess(cfg, options, _progress)
    except ConfigError as e:
        _write(out, {"config_error": {"field": e.field, "message": e.message}})
        return 2
    finally:
        check()  # a run ended by batchlab's death (its progress pipe broke) leaves nothing behind either
    _write(out, measurement_to_dict(m))
    return 0


def main(argv: list[str]) -> int:
    if argv[1:2] == ["--warm"]:
        from batchlab.host.warm import serve

        os._exit(serve(int(argv[2]), measure_into))  # no interpreter teardown: batchlab waits for it at exit
    return measure_into(Path(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
