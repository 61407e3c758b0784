"""One function run in a fork of the pre-imported process (host/warm.py), its JSON result read back.

What a measurement gains from the fork (torch and torch._dynamo imported once per batchlab process, not once per
process: docs/cpu.md) other untimed torch work of a command gains too: compare's gradient check runs this way
instead of in a fresh interpreter or in batchlab's own process, which then never imports torch.  Nothing timed
per kernel runs here: a fork's first write to a heap page it shares with its parent copies the page (the
calibration runs in a fresh process for that reason: calibrate/run.py).
``call`` returns None where no fork can be had (no ``os.fork``, or the pre-imported process refused): the
caller runs the function another way.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from batchlab.host import warm
from batchlab.util.lifeline import kill_group

OUTPUT_TAIL = 2000  # characters of the fork's output kept for an error message


def call(entry: str, request: dict, env: dict[str, str]) -> dict | None:
    """``entry`` (``"module:function"``, called as ``function(out, request, parent_pid) -> exit status``; it
    writes its result to ``out`` as JSON) in a fork of the pre-imported process started with ``env``.
    Raises RuntimeError with the fork's output when it fails; Ctrl-C here kills it."""
    server = warm.pre_imported(env)
    if server is None:
        return None
    with tempfile.TemporaryDirectory(prefix="batchlab-call-") as tmp:
        out = Path(tmp) / "result.json"
        proc = warm.fork(server, out, request, env, entry)
        if proc is None:
            return None
        try:
            output = proc.stdout.read()  # EOF once the fork (and what it started) has exited
            rc = proc.wait()
        except BaseException:  # Ctrl-C: the fork leads its own session and would not see it
            kill_group(proc.pid)
            raise
        finally:
            proc.stdout.close()
        if rc != 0 or not out.exists():
            raise RuntimeError(f"{entry} failed in a forked process (exit {rc}): {output[-OUTPUT_TAIL:]}")
        return json.loads(out.read_text())
