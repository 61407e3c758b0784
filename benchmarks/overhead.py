"""Harness overhead: the timed loop of `batchlab measure` against a bare loop of Trainer.update().

Both loops run the same trainer, interleaved in rounds (A B, then B A, ...) so that drift and other load
hit both; each round gives one paired ratio timed / bare.  Target: median ratio <= 1.02.  On a loaded
machine the ratio's spread swamps a 2% effect, so the probe cost per update is also measured directly
(the timed loop's extra calls around an update that does nothing else).  Then the wall-clock time of
`batchlab measure` on the default tiny model from process start (target <= 20 s).

    .venv/bin/python benchmarks/overhead.py [--rounds 12] [--updates 4] [--cli-runs 2]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from batchlab.config import RunConfig
from batchlab.measure.clock import PhaseClock, synchronizer
from batchlab.measure.harness import Trainer
from batchlab.measure.loop import Recorder, timed_update


def bare_block(trainer: Trainer, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        trainer.update()
    return time.perf_counter() - t0


def timed_block(trainer: Trainer, n: int, sync) -> float:
    clock, rec = PhaseClock(sync, sync_marks=True), Recorder()
    t0 = time.perf_counter()
    for i in range(n):
        timed_update(trainer, clock, rec.use(f"timed {i}", clock), sync)
    return time.perf_counter() - t0


def overhead(rounds: int, updates: int) -> tuple[list[float], float]:
    cfg = RunConfig()  # the default tiny model, seq 128, micro-batch 8
    trainer = Trainer(cfg)
    sync = synchronizer(trainer.device)
    for _ in range(3):
        trainer.update()
    ratios, bare_total = [], 0.0
    for r in range(rounds):
        if r % 2 == 0:
            bare = bare_block(trainer, updates)
            timed = timed_block(trainer, updates, sync)
        else:
            timed = timed_block(trainer, updates, sync)
            bare = bare_block(trainer, updates)
        ratios.append(timed / bare)
        bare_total += bare
    return ratios, bare_total / (rounds * updates)


class _MarksOnly:
    """A stand-in trainer whose update only makes the harness's phase-listener calls (accum 1: 5 marks)."""

    def update(self, listener=None):
        for phase in ("data", "forward", "backward", "optimizer", "end"):
            listener.mark(phase)


def probe_cost_seconds(n: int = 20000) -> float:
    """Seconds per update that the timed loop adds (clock reads, syncs, probe calls), measured directly:
    insensitive to the noise that makes the paired ratio wide on a loaded machine."""
    sync = synchronizer(torch.device("cpu"))
    fake = _MarksOnly()
    clock, rec = PhaseClock(sync, sync_marks=True), Recorder()
    t0 = time.perf_counter()
    for i in range(n):
        timed_update(fake, clock, rec.use("timed", clock), sync)
    return (time.perf_counter() - t0) / n


def cli_seconds(runs: int) -> list[float]:
    exe = shutil.which("batchlab", path=str(Path(sys.executable).parent)) or shutil.which("batchlab")
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([exe, "measure"], check=True, stdout=subprocess.DEVNULL)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--updates", type=int, default=4, help="updates per block")
    ap.add_argument("--cli-runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    probe_cost = probe_cost_seconds()
    ratios, bare_update = overhead(args.rounds, args.updates)
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    console = Console()
    table = Table(title=f"timed loop / bare loop, tiny model, {args.rounds} interleaved rounds of {args.updates} "
                        f"updates (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    for col in ("figure", "value", "target"):
        table.add_column(col)
    table.add_row("paired ratio, median", f"{statistics.median(ratios):.4f}", "<= 1.02")
    table.add_row("paired ratio, IQR", f"{q[0]:.4f} .. {q[2]:.4f}", "")
    table.add_row("paired ratio, min .. max", f"{min(ratios):.4f} .. {max(ratios):.4f}", "")
    table.add_row("bare update (mean)", f"{bare_update * 1e3:.1f} ms", "")
    table.add_row("probe cost per update (direct)", f"{probe_cost * 1e6:.1f} us = "
                  f"{100 * probe_cost / bare_update:.2g}% of an update", "<= 2%")
    if args.cli_runs:
        secs = cli_seconds(args.cli_runs)
        table.add_row("`batchlab measure` from process start", ", ".join(f"{s:.1f} s" for s in secs), "<= 20 s")
    console.print(table)


if __name__ == "__main__":
    import page  # benchmarks/page.py: this script's page of the docs

    page.publish(main, "overhead", "Harness overhead", fence=True)
