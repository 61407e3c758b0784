"""Subprocess isolation: the one place a measurement runs in a separate Python process.

The process is a fork of the pre-imported one (``host/warm.py``: torch imported once per batchlab
process), or, where there is none, a fresh ``python -m batchlab.measure.worker`` reading the request on
stdin; the Measurement comes back as JSON in a file, and its environment says which (``worker``).  A kernel
OOM-kill, a segfault, a hang past the timeout or a crash of the interpreter becomes ``Outcome.FAILED`` with
the reason, and the caller goes on.  A user error found by the worker (ConfigError) is raised again here,
with its field.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

from batchlab.config import ConfigError, ModelSource, RunConfig
from batchlab import host
from batchlab.host import warm
from batchlab.util.lifeline import kill_group, module_command, safe_env
from batchlab.measure.options import MeasureOptions
from batchlab.measure.result import TIMED_OUT_DETAIL, Measurement, Outcome, load_measurement

PROGRESS_PREFIX = "batchlab-progress\t"  # worker -> runner progress lines on stderr: done, total, label
STDERR_TAIL_LINES = 40

_SIGNAL_HINTS = {
    "SIGKILL": "most likely the kernel's OOM killer (host memory exhausted); see `dmesg` / `journalctl -k`",
    "SIGSEGV": "a segmentation fault in native code",
    "SIGABRT": "an abort in native code (failed assertion, std::terminate)",
    "SIGBUS": "a bus error (often shared memory /dev/shm too small)",
}


# what a Hugging Face model's measurement imports (its model class's own module aside: ~0.05 s)
HF_LIBRARIES = ("batchlab.models.hf", "transformers.modeling_utils", "transformers.models.auto.modeling_auto")


def preloaded(cfg: RunConfig) -> tuple[str, ...]:
    """The modules worth importing once for cfg's measurements (none for the builtin model or a factory's)."""
    return HF_LIBRARIES if cfg.model_kind is ModelSource.HF else ()


def child_env() -> dict[str, str]:
    """The caller's environment, with its sys.path, so that a factory importable here imports there too —
    except the working directory (``python -m`` and ``-c`` put it first), unless PYTHONPATH names it — and
    the steady allocator regime (batchlab.host.regime: freed memory kept, no page faults per update after warmup)."""
    env = dict(os.environ)
    cwd = os.path.abspath(os.getcwd())
    named = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    paths = [os.path.abspath(p) for p in sys.path if p and (os.path.abspath(p) != cwd or cwd in named)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return safe_env(host.measuring_env(env))


def run_isolated(cfg: RunConfig, options: MeasureOptions,
                 progress: Callable[[int, int, str], None] | None = None) -> Measurement:
    request = {"config": cfg.to_dict(), "options": dataclasses.replace(options, isolate=False).to_dict()}
    env = child_env()
    # CPU only: a GPU measurement initialises CUDA, which the pre-imported process never does, and a fresh
    # process keeps that beyond doubt (its ~2 s are small beside a GPU run's start)
    server = warm.pre_imported(env) if backend(cfg, options) == "cpu" else None
    with tempfile.TemporaryDirectory(prefix="batchlab-measure-") as tmp:
        out_path = Path(tmp) / "measurement.json"
        preload = preloaded(cfg)  # a Hugging Face model's libraries: imported once, not per fork
        proc = warm.fork(server, out_path, request, env, preload=preload) if server is not None else None
        started = warm.FORKED if proc is not None else warm.FRESH
        if proc is None:
            # own process group: a timeout kills the worker and anything it started (data-loader workers, ...)
            proc = subprocess.Popen(module_command("batchlab.measure.worker", str(out_path)),
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, env=env, start_new_session=True)
            try:
                proc.stdin.write(json.dumps(request))
                proc.stdin.close()
            except BrokenPipeError:  # the worker died before reading: its exit status says why
                pass
        watcher = _OutputWatcher(proc.stdout, progress)
        timed_out = False
        try:
            rc = proc.wait(timeout=options.timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            rc = proc.wait()
            timed_out = True
        except BaseException:  # Ctrl-C here: the worker is in its own session and would not see it
            kill_group(proc.pid)
            proc.wait()
            raise
        watcher.join()
        return _interpret(cfg, options, rc, out_path, watcher, timed_out, started)


def backend(cfg: RunConfig, options: MeasureOptions) -> str:
    """The torch backend the measurement will run on (cpu, cuda, mps), read from the config without torch."""
    return (options.torch_device or cfg.device_spec.backend.value).split(":")[0]


class _OutputWatcher(threading.Thread):
    """Reads the worker's merged stdout/stderr: progress lines go to the callback, the rest is kept (tail)."""

    def __init__(self, stream, progress):
        super().__init__(daemon=True)
        self.stream, self.progress = stream, progress
        self.tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.last_label = "starting the worker"
        self.start()

    def run(self) -> None:
        for line in self.stream:
            if line.startswith(PROGRESS_PREFIX):
                done, total, label = line[len(PROGRESS_PREFIX):].rstrip("\n").split("\t", 2)
                self.last_label = label
                if self.progress is not None:
                    self.progress(int(done), int(total), label)
            else:
                self.tail.append(line.rstrip("\n"))


def _interpret(cfg, options, rc: int | None, out_path: Path, watcher: _OutputWatcher, timed_out: bool,
               started: str) -> Measurement:
    payload = None
    if out_path.exists():
        try:
            payload = json.loads(out_path.read_text())
        except (OSError, json.JSONDecodeError):
            payload = None
    if not timed_out and rc == 0 and payload is not None and "outcome" in payload:
        m = load_measurement(payload)
        return dataclasses.replace(m, environment={**m.environment, "isolated": True, "worker": started})
    if not timed_out and payload is not None and "config_error" in payload:
        err = payload["config_error"]
        raise ConfigError(err["field"], err["message"])
    where = f"during {watcher.last_label}"
    if timed_out:
        detail = f"{TIMED_OUT_DETAIL} after {options.timeout_s:g} s {where}; the worker was killed"
    elif rc is None:
        detail = f"worker lost {where}: the pre-imported process it was forked from died"
    elif rc < 0:
        name = _signal_name(-rc)
        hint = _SIGNAL_HINTS.get(name, "")
        detail = f"worker killed by {name} {where}" + (f": {hint}" if hint else "")
    else:
        last = next((line for line in reversed(watcher.tail) if line.strip()), "no output")
        detail = f"worker exited with status {rc} {where}: {last}"
    return Measurement(config=cfg.to_dict(), outcome=Outcome.FAILED, global_batch=cfg.global_batch,
                       outcome_detail=detail,
                       environment={"isolated": True, "worker": started, "exit_status": rc,
                                    "output_tail": list(watcher.tail)})


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
