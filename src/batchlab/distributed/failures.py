"""Why a data-parallel measurement failed: the one rank that caused it, from what the ranks left behind.

Torch-free.  Each rank writes ``rank<k>.pid`` when it starts and ``rank<k>.error.json`` when it raises;
a rank killed by a signal (SIGKILL from the kernel's OOM killer, a user, a test) writes nothing more, and
torchrun's failure summary gives its exit code.  When one rank dies the others fail too (their collective
loses its peer, or torchrun terminates them), so the cause is chosen in this order: a rank killed by a
signal other than the SIGTERM torchrun sends while closing; then the earliest error that is not a
communication error; then the earliest error; then torchrun's own report.
"""
from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from batchlab.measure.result import Outcome

# Exceptions a rank raises because a peer vanished (gloo / NCCL / TCPStore), not because of its own work.
_COMM_TYPES = {"DistBackendError", "DistNetworkError", "DistStoreError", "DistError"}
_COMM_TEXT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL error",
              "Socket Timeout", "Timed out")


@dataclass(frozen=True)
class Failure:
    outcome: Outcome
    rank: int | None
    reason: str
    config_field: str | None = None  # the rank raised ConfigError: a user error, raised again by the launcher
    config_message: str = ""

    @property
    def detail(self) -> str:
        """E.g. ``rank 1 (killed by SIGKILL ...)``; shown after the outcome: ``failed: rank 1 (...)``."""
        return f"rank {self.rank} ({self.reason})" if self.rank is not None else self.reason


def _ranks(out: Path, suffix: str) -> set[int]:
    return {int(m.group(1)) for p in out.glob(f"rank*{suffix}")
            if (m := re.fullmatch(rf"rank(\d+){re.escape(suffix)}", p.name))}


def torchrun_exitcodes(log: str) -> dict[int, int]:
    """Per global rank, the exit code in torchrun's failure summary (negative: killed by that signal)."""
    pat = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
    return {int(r): int(c) for r, c in pat.findall(log)}


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _killed_reason(code: int | None) -> str:
    if code is None:
        return "ended without a result or an error (killed?)"
    if code < 0:
        extra = "; the kernel's OOM killer sends SIGKILL too" if code == -signal.SIGKILL else ""
        return f"killed by {_signal_name(code)}{extra}"
    return f"exited with code {code} without a result or an error"


def _is_comm(err: dict) -> bool:
    return err.get("type") in _COMM_TYPES or any(t in err.get("message", "") for t in _COMM_TEXT)


def _from_error(err: dict) -> Failure:
    message = f"{err.get('type', 'Error')}: {err.get('message', '')}".rstrip(": ")
    if err.get("oom"):
        outcome = Outcome.OOM_BUDGET if err["oom"] == "memory budget" else Outcome.OOM
        return Failure(outcome, err["rank"], f"out of memory, {err['oom']}: {message}")
    if err.get("field"):
        return Failure(Outcome.FAILED, err["rank"], message, err["field"], err.get("field_message") or "")
    return Failure(Outcome.FAILED, err["rank"], message)


def diagnose(out: Path, returncode: int | None, log: str, timeout_s: float | None = None,
             codes: dict[int, int | None] | None = None) -> Failure:
    """The failure of a run whose ranks wrote into ``out``; ``returncode`` None means it timed out.  ``codes``:
    each rank's exit status where the launcher saw it (forked ranks), else read from torchrun's summary."""
    started, done = _ranks(out, ".pid"), _ranks(out, ".json")
    errors = {r: json.loads((out / f"rank{r}.error.json").read_text()) for r in _ranks(out, ".error.json")}
    if returncode is None:
        missing = ", ".join(map(str, sorted(started - done))) or "any"
        return Failure(Outcome.FAILED, None, f"timeout after {timeout_s:g} s (no result from rank(s) {missing}); "
                                             "every process was killed")
    if returncode < 0:  # torchrun itself was killed (by a user, the OOM killer): its ranks died with it
        return Failure(Outcome.FAILED, None, f"torchrun was {_killed_reason(returncode)}; its ranks were stopped "
                                             "with it, nothing was measured")
    codes = torchrun_exitcodes(log) if codes is None else codes
    silent = sorted(started - done - set(errors))
    killed = [r for r in silent if codes.get(r, -signal.SIGKILL) != -signal.SIGTERM]
    if killed:
        return Failure(Outcome.FAILED, killed[0], _killed_reason(codes.get(killed[0])))
    if errors:
        first = min(errors.values(), key=lambda e: (_is_comm(e), e.get("time", 0.0)))
        return _from_error(first)
    if silent:
        return Failure(Outcome.FAILED, silent[0], _killed_reason(codes.get(silent[0])))
    last = [line for line in log.strip().splitlines() if line.strip()][-1:] or ["no output"]
    return Failure(Outcome.FAILED, None, f"torchrun exited with code {returncode}: {last[0].strip()[:300]}")
