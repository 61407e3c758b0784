"""How close the per-op time model comes to measured update times on this machine.

For a grid of one-variable changes A -> B on the built-in GPT and Hugging Face GPT-2 / Llama configs, the
predicted update-time ratio t(B)/t(A) (formula: the op list derived from the model's terms; trace: the ops
the real code ran on fake tensors, both priced by the same calibrated per-op model) beside the measured
paired ratio, and predicted beside measured absolute update times.

Measured: two live trainers in one process, 1 intra-op thread (compare's default), 3 warm-up updates each
(the heap reaches its high-water mark), then adjacent updates A B, B A, A B, ... (order alternated so drift
in machine load hits both sides of a pair alike); the ratio is the median of the per-pair ratios, the absolute time the median of each side's
updates (wall-clock; beside it the update's CPU time, which other processes' load does not inflate).
DP 1 -> 2: one plain process and two DDP ranks over gloo (batchlab's ZeRO-0 engine), all alive at once and
taking turns at a barrier, in the same alternated order (``dp_pairs.py``).  The calibration (`batchlab calibrate` at 1 thread) is measured once, cached,
and stated with its cost.

    .venv/bin/python benchmarks/time_accuracy.py             # the grid, ~3-5 min on 2 cores
    .venv/bin/python benchmarks/time_accuracy.py --quick     # smoke run (a few rows, 3 pairs)
    .venv/bin/python benchmarks/time_accuracy.py --only seq  # rows whose label contains "seq"
    .venv/bin/python benchmarks/time_accuracy.py --parts fp32  # calibrated as the default compare is (fp32
                                                               # parts only): the rows that need no more
Prints Markdown on stdout (progress on stderr).  Check `uptime` first: a loaded machine inflates absolute
times (ratios are robust to slow drift, not to bursts).
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time

import torch

from batchlab import calibrate
from batchlab.host import regime
from batchlab.calibrate import family
from batchlab.formula import calibration
from batchlab.config import RunConfig, preset
from batchlab.formula import estimate as formula_estimate
from batchlab.host import cpu_hardware
from batchlab.measure.harness import Trainer
from dp_pairs import paired_dp

THREADS = 1
TOLERANCE = 0.15  # the target: predicted ratio within 15% of the measured one
ABS_TOLERANCE = 0.25

MODELS = {
    "tiny": lambda: (preset("tiny"), "builtin"),
    "hf gpt2": lambda: (preset("gpt2", layers=2, hidden=128, heads=4, vocab=1024, max_positions=512), "hf:gpt2"),
    "hf llama": lambda: (preset("llama-2-7b", layers=2, hidden=128, heads=4, kv_heads=2, ffn=352, vocab=1024,
                                max_positions=512), "hf:llama-2-7b"),
}


def _grid() -> list[tuple[str, str, dict, dict, dict]]:
    """(model, change label, base, A changes, B changes)."""
    base = dict(seq=128, micro_batch=8)
    rows = [("tiny", "AC none -> full", base, dict(ac="none"), dict(ac="full")),
            ("tiny", "AC none -> selective", base, dict(ac="none"), dict(ac="selective")),
            ("tiny", "AC none -> every:2", base, dict(ac="none"), dict(ac="every:2"))]
    for a, b in ((1, 2), (2, 4), (4, 8)):  # fixed global batch 8
        rows.append(("tiny", f"micro-batch {a} -> {b} (global 8)", base, dict(micro_batch=a, accum=8 // a),
                     dict(micro_batch=b, accum=8 // b)))
    rows += [("tiny", "accum 1 -> 2 (micro-batch 4)", base, dict(micro_batch=4, accum=1), dict(micro_batch=4, accum=2)),
             ("tiny", "accum 2 -> 4 (micro-batch 4)", base, dict(micro_batch=4, accum=2), dict(micro_batch=4, accum=4)),
             ("tiny", "seq 64 -> 128", base, dict(seq=64), dict(seq=128)),
             ("tiny", "seq 128 -> 256", base, dict(seq=128), dict(seq=256)),
             ("tiny", "hidden 128 -> 256", base, dict(hidden=128), dict(hidden=256)),
             ("tiny", "layers 2 -> 4", base, dict(layers=2), dict(layers=4)),
             ("tiny", "fp32 -> bf16-mixed", base, dict(precision="fp32"), dict(precision="bf16-mixed")),
             ("tiny", "DP 1 -> 2 (micro-batch 8 per rank)", base, dict(dp=1), dict(dp=2))]
    for model in ("hf gpt2", "hf llama"):
        hb = dict(seq=128, micro_batch=4)
        rows += [(model, "AC none -> full", hb, dict(ac="none"), dict(ac="full")),
                 (model, "micro-batch 1 -> 4 (global 4)", hb, dict(micro_batch=1, accum=4), dict(micro_batch=4, accum=1)),
                 (model, "seq 64 -> 128", hb, dict(seq=64), dict(seq=128)),
                 (model, "fp32 -> bf16-mixed", hb, dict(precision="fp32"), dict(precision="bf16-mixed"))]
    return rows


def _unlisted() -> list[tuple[str, str, dict, dict, dict]]:
    """Changes and shapes the issue does not list (the model must hold beyond the grid it was checked on)."""
    return [("tiny", "AC none -> full at seq 256, micro-batch 2", dict(seq=256, micro_batch=2), dict(ac="none"),
             dict(ac="full")),
            ("tiny", "micro-batch 2 -> 8 at seq 64 (global 16)", dict(seq=64), dict(micro_batch=2, accum=8),
             dict(micro_batch=8, accum=2)),
            ("tiny", "fp32 -> bf16-mixed with AC full", dict(seq=128, micro_batch=4, ac="full"),
             dict(precision="fp32"), dict(precision="bf16-mixed")),
            ("tiny", "DP 1 -> 2 at seq 256, micro-batch 2", dict(seq=256, micro_batch=2), dict(dp=1), dict(dp=2)),
            ("hf gpt2", "seq 128 -> 256 (bf16-mixed)", dict(micro_batch=2, precision="bf16-mixed"), dict(seq=128),
             dict(seq=256)),
            ("hf gpt2", "layers 2 -> 4", dict(seq=128, micro_batch=4), dict(layers=2), dict(layers=4)),
            ("hf llama", "hidden 128 -> 256", dict(seq=128, micro_batch=4), dict(hidden=128), dict(hidden=256)),
            ("hf llama", "AC none -> full (bf16-mixed)", dict(seq=128, micro_batch=4, precision="bf16-mixed"),
             dict(ac="none"), dict(ac="full")),
            # added after the time model's last change, never used to shape it
            ("tiny", "optimizer AdamW -> SGD", dict(seq=128, micro_batch=4), dict(optimizer="adamw"),
             dict(optimizer="sgd")),
            ("tiny", "seq 32 -> 256 (micro-batch 1)", dict(micro_batch=1), dict(seq=32), dict(seq=256)),
            ("hf gpt2", "vocab 1024 -> 8192", dict(seq=128, micro_batch=4), dict(vocab=1024), dict(vocab=8192)),
            ("hf llama", "heads 4 -> 8 (kv heads 2)", dict(seq=128, micro_batch=4), dict(heads=4), dict(heads=8))]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def config(model: str, base: dict, changes: dict) -> RunConfig:
    spec, source = MODELS[model]()
    return RunConfig(model=spec, model_source=source).replace(**{**base, **changes})


class HostProbe:
    """How fast this host runs right now against while it was calibrated: batchlab's speed probe
    (host/speed.py: a ~6 ms bundle of calibrated kernel classes), the one ``batchlab compare`` reads before
    each timed update, over the calibration's own read of it (``Calibration.probe_seconds``).  The formula's
    absolute time at that speed is a column beside the measurement."""

    def __init__(self, reference: float):
        from batchlab.host.speed import SpeedProbe

        self.probe, self.reference = SpeedProbe(), reference

    def __call__(self) -> float:
        """The bundle's time now over its time in the calibration (1: the same speed; 1.5: 50% slower)."""
        return self.probe.read() / self.reference


_PROBE: list[HostProbe] = []


def _seconds(trainer: Trainer) -> tuple[float, float, float, float]:
    """(wall, CPU) seconds, minor page faults and the host probe (read just before) of one update: on a shared
    machine the wall clock also counts the time other processes held the core; the thread's CPU time does not
    (one intra-op thread)."""
    speed = _PROBE[0]() if _PROBE else float("nan")
    f, c, t = regime.minor_faults(), time.thread_time(), time.perf_counter()
    trainer.update()
    return time.perf_counter() - t, time.thread_time() - c, regime.minor_faults() - f, speed


def alternate(run_a, run_b, n: int) -> tuple[list[float], list[tuple[float, float]], list[tuple[float, float]]]:
    """n pairs A B, B A, A B, ...: per-pair wall-clock ratios t(B)/t(A) and each side's (wall, CPU) seconds
    (drift in machine load hits both sides of a pair alike)."""
    ratios, sa_all, sb_all = [], [], []
    for i in range(n):
        if i % 2 == 0:
            sa, sb = run_a(), run_b()
        else:
            sb, sa = run_b(), run_a()
        ratios.append(sb[0] / sa[0])
        sa_all.append(sa)
        sb_all.append(sb)
    return ratios, sa_all, sb_all


# The least wall time a row's timed pairs span, as torch.utils.benchmark's blocked_autorange(min_run_time=)
# does: this host's speed swings at sub-second scale (dispatch-bound work 4.7-10 us per op between one-second
# windows), so 8 pairs of a 14 ms and a 56 ms update (0.6 s) measured whichever swing they met.
MIN_SECONDS = 1.5


def paired(a: RunConfig, b: RunConfig, pairs: int, warmup: int = 3) -> tuple[list[float], list[float], list[float]]:
    """Adjacent updates of two live trainers in this process, after ``warmup`` updates each: ``pairs`` pairs,
    or as many more as span ``MIN_SECONDS`` at the last warm-up pair's time."""
    ta, tb = Trainer(a, "cpu"), Trainer(b, "cpu")
    for _ in range(warmup):
        t = time.perf_counter()
        ta.update()
        tb.update()
        pair = time.perf_counter() - t
    regime.pretouch()  # as a measuring process does after warmup
    n = max(pairs, min(8 * pairs, math.ceil(MIN_SECONDS / pair))) if pairs > 3 else pairs  # --quick: as asked
    return alternate(lambda: _seconds(ta), lambda: _seconds(tb), n)


_TRACES: dict[RunConfig, float] = {}


def trace_seconds(cfg: RunConfig, cals) -> float:
    from batchlab.trace import estimate

    if cfg not in _TRACES:
        _TRACES[cfg] = estimate(cfg, calibrations=cals).time.seconds
    return _TRACES[cfg]


def measure_row(model: str, label: str, base: dict, ca: dict, cb: dict, pairs: int, cals, with_trace: bool) -> dict:
    a, b = config(model, base, ca), config(model, base, cb)
    log(f"{model}: {label}")
    if a.dp > 1 or b.dp > 1:
        ratios, sa, sb = paired_dp(a, b, pairs, reference=_PROBE[0].reference if _PROBE else float("nan"))
    else:
        ratios, sa, sb = paired(a, b, pairs)
    fa, fb = formula_estimate(a, cals).time.update_seconds, formula_estimate(b, cals).time.update_seconds
    row = dict(model=model, label=label, measured=statistics.median(ratios), ratios=ratios,
               formula=fb / fa, ma=statistics.median(s[0] for s in sa), mb=statistics.median(s[0] for s in sb),
               ca=statistics.median(s[1] for s in sa), cb=statistics.median(s[1] for s in sb), fa=fa, fb=fb,
               faults=[statistics.median(s[2] for s in side) for side in (sa, sb)],
               pa=statistics.median(s[3] for s in sa), pb=statistics.median(s[3] for s in sb),
               trace=None, load=os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan"))
    if with_trace and a.dp == 1 and b.dp == 1:
        row["trace"] = trace_seconds(b, cals) / trace_seconds(a, cals)
    return row


def _own(cal) -> str:
    """The Hugging Face models' own dispatch per op over batchlab's GPT's, as the calibration keeps them."""
    from batchlab.formula.timing import ratios_text

    said = "; ".join(f"{key.split()[0]} {ratios_text(v)}" for key, v in sorted(cal.family_dispatch.items()))
    return f"models' own dispatch per op over batchlab's GPT's: {said}; " if said else ""


def _err(pred: float | None, meas: float) -> str:
    return "-" if pred is None else f"{pred / meas - 1:+.0%}"


def _probed(r: dict, side: str) -> float | None:
    """The formula's absolute time at the host speed the probe read beside that side's updates."""
    speed = r["p" + side]
    return None if speed != speed else r["f" + side] * speed  # NaN: not probed


def _speed(r: dict) -> str:
    return "-" if r["pa"] != r["pa"] else f"x{r['pa']:.2f} / x{r['pb']:.2f}"


def _ok(pred: float | None, meas: float, tol: float) -> bool:
    return pred is not None and abs(pred / meas - 1) <= tol


def print_table(rows: list[dict]) -> None:
    print("| model | change A -> B | measured ratio (median, IQR) | formula ratio | error | trace ratio | error | "
          "measured A / B | formula A / B | abs. error A / B | CPU A / B | error vs CPU A / B | CPU ratio | error | "
          "load | host speed A / B (probe) | abs. error at probed speed A / B | page faults per update A / B |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        q = statistics.quantiles(r["ratios"], n=4, method="inclusive") if len(r["ratios"]) > 1 else [r["measured"]] * 3
        trace = "-" if r["trace"] is None else f"{r['trace']:.2f}"
        print(f"| {r['model']} | {r['label']} | {r['measured']:.2f} ({q[0]:.2f}-{q[2]:.2f}) | {r['formula']:.2f} | "
              f"{_err(r['formula'], r['measured'])} | {trace} | {_err(r['trace'], r['measured'])} | "
              f"{r['ma'] * 1e3:.0f} / {r['mb'] * 1e3:.0f} ms | {r['fa'] * 1e3:.0f} / {r['fb'] * 1e3:.0f} ms | "
              f"{_err(r['fa'], r['ma'])} / {_err(r['fb'], r['mb'])} | {r['ca'] * 1e3:.0f} / {r['cb'] * 1e3:.0f} ms | "
              f"{_err(r['fa'], r['ca'])} / {_err(r['fb'], r['cb'])} | {r['cb'] / r['ca']:.2f} | "
              f"{_err(r['formula'], r['cb'] / r['ca'])} | {r['load']:.1f} | {_speed(r)} | "
              f"{_err(_probed(r, 'a'), r['ma'])} / {_err(_probed(r, 'b'), r['mb'])} | "
              f"{r['faults'][0]:,.0f} / {r['faults'][1]:,.0f} |")
    print()
    within = sum(_ok(r["formula"], r["measured"], TOLERANCE) for r in rows)
    traced = [r for r in rows if r["trace"] is not None]
    abs_ok = sum(_ok(r["fa"], r["ma"], ABS_TOLERANCE) + _ok(r["fb"], r["mb"], ABS_TOLERANCE) for r in rows)
    print(f"- formula ratio within {TOLERANCE:.0%} of the measured paired ratio: {within} of {len(rows)} rows")
    if traced:
        t_ok = sum(_ok(r["trace"], r["measured"], TOLERANCE) for r in traced)
        print(f"- trace ratio within {TOLERANCE:.0%}: {t_ok} of {len(traced)} rows")
    cpu_ratio_ok = sum(_ok(r["formula"], r["cb"] / r["ca"], TOLERANCE) for r in rows)
    print(f"- formula ratio within {TOLERANCE:.0%} of the ratio of the sides' median CPU times (not paired; robust "
          f"to other processes holding the cores): {cpu_ratio_ok} of {len(rows)} rows")
    cpu_ok = sum(_ok(r["fa"], r["ca"], ABS_TOLERANCE) + _ok(r["fb"], r["cb"], ABS_TOLERANCE) for r in rows)
    print(f"- formula absolute update time within {ABS_TOLERANCE:.0%} of the measured median: {abs_ok} of "
          f"{2 * len(rows)} sides (of the measured CPU time: {cpu_ok}; wall and CPU agree on an idle machine)")
    probed = [r for r in rows if _probed(r, "a") is not None]
    probed_ok = sum(_ok(_probed(r, "a"), r["ma"], ABS_TOLERANCE) + _ok(_probed(r, "b"), r["mb"], ABS_TOLERANCE)
                    for r in probed)
    print(f"- formula absolute update time x the host speed probed before each update (the speed around the "
          f"calibration = 1) within {ABS_TOLERANCE:.0%}: {probed_ok} of {2 * len(probed)} sides")
    faults = sorted(f for r in rows for f in r["faults"] if f == f)
    print(f"- minor page faults per update after warmup (median per side): {faults[len(faults) // 2]:,.0f} on the "
          f"median side, {faults[-1]:,.0f} on the worst")
    print()


def in_regime() -> None:
    """Run this script in the allocator regime batchlab's measuring processes use (batchlab.host.regime: freed
    memory kept, no page faults per update after warmup): the in-process trainers below are measured here, so
    the process starts again with the regime's environment where it lacks it (glibc reads it at start)."""
    if (note := regime.restart_in_regime()) is not None:
        log(note)


def main(argv=None) -> None:
    in_regime()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few rows, 3 pairs: a smoke run")
    p.add_argument("--pairs", type=int, default=8, help="paired updates per row")
    p.add_argument("--only", default=None, help="only rows whose model or label contains this text")
    p.add_argument("--unlisted", action="store_true",
                   help="changes and shapes the grid does not list, instead of the grid")
    p.add_argument("--cached", action="store_true", help="use the cached calibration instead of measuring one now")
    p.add_argument("--parts", default=None,
                   help="calibrate only these parts (fp32, or fp32+bf16, fp32+sac, fp32+ranks, ...: formula/calibration.py "
                        "SCOPES), as compare does for its configs, and keep the rows that need no other part")
    p.add_argument("--trace", choices=("hf", "all", "none"), default="hf",
                   help="which rows also get the trace's prediction (a fake-tensor run per config)")
    args = p.parse_args(argv)
    torch.set_num_threads(THREADS)
    start = time.perf_counter()
    grid = _unlisted() if args.unlisted else _grid()
    if args.only:
        grid = [g for g in grid if args.only in g[0] or args.only in g[1]]
    pairs = args.pairs
    if args.quick:
        grid, pairs = [g for g in grid if g[1].startswith(("AC none -> full", "seq 64"))][:3], 3
    if args.cached:
        cal, fresh = calibrate.ensure("cpu", threads=THREADS)
    else:  # calibrated in the same conditions as the measurements below (and cached for compare)
        parts = calibration.SCOPES if args.parts is None else tuple(args.parts.split("+")[1:])
        cal, fresh = calibrate.measure("cpu", threads=THREADS, scope=parts), True
        calibrate.save(cal)
        grid = [g for g in grid if cal.covers(config(g[0], g[2], g[3])) and cal.covers(config(g[0], g[2], g[4]))]
    # each Hugging Face model's own dispatch per op, as compare measures it the first time it meets the model
    # (calibrate/family.py); its ratios are kept with the calibration
    for model in sorted({g[0] for g in grid if g[0].startswith("hf")}):
        line = family.ensure(config(model, {}, {}), THREADS)
        log(line or f"{model}: its own dispatch per op cached")
    cal = calibrate.load_cached("cpu", THREADS) or cal
    cals = {cal.device: cal}
    _PROBE.append(HostProbe(cal.probe_seconds))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"Time model accuracy on {cpu_hardware()}, {THREADS} thread per process, load average {load:.1f} at "
          f"start, torch {torch.__version__}, {datetime.date.today().isoformat()}; fp32 unless stated, AdamW. "
          f"Calibration: {cal.source} ({'measured now' if fresh else 'cached'}). Measured: {pairs} alternated "
          f"pairs of updates of two live trainers (or as many as span {MIN_SECONDS} s) after 3 warm-up updates "
          "each and the heap's top touched (DP: a process and a DDP group, alive at once, taking turns), "
          f"wall-clock, {regime.describe()}; host speed probe in the calibration: {1e3 * cal.probe_seconds:.2f} ms; "
          f"{_own(cal)}error = predicted / measured - 1.")
    print()
    rows = [measure_row(m, label, base, a, b, pairs, cals,
                        args.trace == "all" or (args.trace == "hf" and m.startswith("hf")))
            for m, label, base, a, b in grid]
    print_table(rows)
    log(f"done in {time.perf_counter() - start:.0f} s (load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    import page  # benchmarks/page.py: this script's page of the docs

    page.publish(main, page.variant("time_accuracy", {"--unlisted": "unlisted"}), "Update-time accuracy: the per-op model against paired measurements")
