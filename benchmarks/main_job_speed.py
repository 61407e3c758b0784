"""How long batchlab's main job takes as a user runs it: `batchlab estimate`, and the default `batchlab compare`
(built-in tiny GPT, micro-batch 1 -> 2 at a fixed global batch) the first time (a fresh home: the CPU calibration
included) and again (the calibration cached).  Each command is a whole process, timed from start to exit:
wall-clock seconds and CPU seconds (user + system of the process and every process it started and waited for:
the pre-imported measuring process and its forks), the median, min and max of ``--runs`` runs, the three kinds
interleaved so that a change of the machine's load falls on each alike.

    python benchmarks/main_job_speed.py              # 3 runs each (~3 min on 2 cores), writes docs/performance.md
    python benchmarks/main_job_speed.py --runs 1 --out /tmp/speed.md

Run it on a quiet machine (``uptime``: load below 1): the targets are stated for one, and a loaded machine
stretches the wall clock (CPU seconds less so).  Compiled modules are cached as an installed package's are
(PYTHONDONTWRITEBYTECODE is dropped for the commands).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "python benchmarks/main_job_speed.py"
# (label, batchlab arguments, fresh home each run, target wall seconds)
KINDS = (("`batchlab estimate`", ["estimate"], False, 0.3),
         ("`batchlab compare`, first run (calibration included)", ["compare", "--predict", "none"], True, 30.0),
         ("`batchlab compare`, calibration cached", ["compare", "--predict", "none"], False, 12.0))
CALIBRATED = re.compile(r"calibrated this CPU once at \d+ thread\(s\) in ([0-9.]+) s")


def machine() -> str:
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def env_for(home: Path) -> dict[str, str]:
    env = dict(os.environ, XDG_CACHE_HOME=str(home / "cache"), XDG_DATA_HOME=str(home / "data"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    return env


def timed(args: list[str], env: dict[str, str]) -> tuple[float, float, float, float | None]:
    """(wall s, CPU s of the process tree, load average at start, calibration seconds it reported or None)."""
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "batchlab", *args], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"batchlab {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    found = CALIBRATED.search(proc.stderr)
    return wall, cpu, load, float(found.group(1)) if found else None


def spread(values: list[float], unit: str = "s") -> str:
    fmt = (lambda v: f"{v:.2f}") if max(values) < 10 else (lambda v: f"{v:.1f}")
    return f"{fmt(statistics.median(values))} {unit} ({fmt(min(values))}–{fmt(max(values))})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "performance.md")
    args = p.parse_args(argv)
    results: dict[str, list[tuple]] = {label: [] for label, *_ in KINDS}
    kept = Path(tempfile.mkdtemp(prefix="batchlab-speed-"))  # the cached runs' home: calibrated once, first
    try:
        subprocess.run([sys.executable, "-m", "batchlab", "compare", "--predict", "none", "--rounds", "3"],
                       env=env_for(kept), capture_output=True, check=True, stdin=subprocess.DEVNULL)
        subprocess.run([sys.executable, "-m", "batchlab", "estimate"], env=env_for(kept), capture_output=True,
                       check=True)  # compiled modules cached, as an installed package's are
        for run in range(args.runs):
            for label, cli, fresh, _ in KINDS:
                home = Path(tempfile.mkdtemp(prefix="batchlab-speed-")) if fresh else kept
                try:
                    results[label].append(timed(cli, env_for(home)))
                finally:
                    if fresh:
                        shutil.rmtree(home, ignore_errors=True)
                print(f"run {run + 1}/{args.runs}: {label}: {results[label][-1][0]:.2f} s wall, "
                      f"{results[label][-1][1]:.2f} s CPU, load {results[label][-1][2]:.2f}", file=sys.stderr)
    finally:
        shutil.rmtree(kept, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(results, args.runs))
    print(f"wrote {args.out}", file=sys.stderr)


def render(results: dict[str, list[tuple]], runs: int) -> str:
    loads = [r[2] for rows in results.values() for r in rows]
    quiet = max(loads) < 1.0
    lines = ["# Performance of the main job", "",
             f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {machine()}, "
             f"Python {platform.python_version()}, torch {metadata.version('torch')}, batchlab "
             f"{metadata.version('batchlab') if _installed() else '(source tree)'}; load average (1 min) at the "
             f"runs' starts {min(loads):.2f}–{max(loads):.2f}.  Reproduce: `{COMMAND}`.", ""]
    if not quiet:
        lines += ["**The machine was loaded** (load average at or above 1 at some runs' start): other processes "
                  "held the cores, so the wall-clock figures are above a quiet machine's; the CPU seconds are "
                  "less affected.  The targets are stated for a quiet machine.", ""]
    lines += [f"Each command is a whole process, median (min–max) of {runs} runs, the kinds interleaved; CPU: user "
              "+ system seconds of the process and the processes it started (the pre-imported measuring process "
              "and its forks).", "",
              "| command | wall | CPU | target (wall, quiet machine) | held |", "|---|---:|---:|---:|---|"]
    for label, _, _, target in KINDS:
        rows = results[label]
        walls, cpus = [r[0] for r in rows], [r[1] for r in rows]
        held = statistics.median(walls) <= target
        lines.append(f"| {label} | {spread(walls)} | {spread(cpus)} | ≤ {target:g} s | "
                     f"{'yes' if held else 'no'}{'' if quiet else ' (loaded)'} |")
    cal = [r[3] for r in results[KINDS[1][0]] if r[3] is not None]
    if cal:
        lines += ["", f"The first run's calibration (the fp32 kernels and per-op dispatch the default compare's "
                      f"configs are priced with): {spread(cal)} as the command reported it."]
    lines += ["", "What the default compare does: 3 interleaved rounds A B, each side in a fork of one pre-imported "
              "process (torch imported once), 2 warm-up updates, 1 untimed memory-tracked update and 5 timed "
              "updates each, the host speed probe before each timed update, the memory update recording a memory "
              "timeline too in each side's first round; then the gradient-equivalence check at a small size, "
              "in a fork of the same process.  The first run calibrates the CPU first, in a fresh process (a fork's "
              "shared heap pages would slow the kernels it times: docs/cpu.md), and only the parts the two "
              "configurations need (fp32 kernels and dispatch; 16-bit kernels, "
              "selective checkpointing's dispatch and local ranks' contention and link are measured when a "
              "configuration needs them, or by `batchlab calibrate`).", ""]
    return "\n".join(lines)


def _installed() -> bool:
    try:
        metadata.version("batchlab")
        return True
    except metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
