"""How close batchlab's predictions come to measured runs on this machine.

Memory: over a grid (built-in tiny and small; Hugging Face GPT-2 and Llama configs at tiny sizes) x
micro-batch x sequence x activation-checkpointing policy, the error of the formula and of the trace against
the measured peak tensor bytes and activation bytes (CPU: live storage tracker, provenance allocator).
error = (predicted - measured) / measured.

Time: paired ratios.  For each pair A -> B, two live trainers take adjacent updates, order alternated
(A B, B A, ...); the measured ratios t(B)/t(A) are set beside the formula's predicted ratio and the
trace's hardware-FLOPs ratio (what a purely compute-bound update would give).  Absolute milliseconds are
too noisy on shared machines to be worth a table.

    .venv/bin/python benchmarks/accuracy.py            # full grid, a few minutes on 2 idle cores
    .venv/bin/python benchmarks/accuracy.py --quick    # smoke run
    .venv/bin/python benchmarks/accuracy.py --part time --pairs 20   # only the paired time ratios
Prints Markdown on stdout (progress on stderr).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

from batchlab.calibrate import load_all
from batchlab.config import RunConfig, preset
from batchlab.measure import MeasureOptions
from batchlab.run import measure as run
from batchlab.measure.harness import Trainer
from batchlab.formula import estimate as formula_estimate
from batchlab.host import cpu_hardware
from batchlab.trace import estimate as trace_estimate
from batchlab.units import relative_to

MODELS = {
    "tiny": lambda: (preset("tiny"), "builtin"),
    "small": lambda: (preset("small"), "builtin"),
    "hf gpt2": lambda: (preset("gpt2", layers=2, hidden=128, heads=4, vocab=1024, max_positions=256), "hf:gpt2"),
    "hf llama": lambda: (preset("llama-2-7b", layers=2, hidden=128, heads=4, kv_heads=2, ffn=352, vocab=1024,
                                max_positions=256), "hf:llama-2-7b"),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def error(predicted, measured) -> float | None:
    return relative_to(predicted, measured)


def pct(e: float | None) -> str:
    return "-" if e is None else f"{e:+.1%}"


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def memory_rows(models, micro_batches, seqs, policies):
    rows = []
    for name in models:
        spec, source = MODELS[name]()
        for mb in micro_batches:
            for seq in seqs:
                for ac in policies:
                    cfg = RunConfig(model=spec, model_source=source, micro_batch=mb, seq=seq, ac=ac)
                    log(f"memory: {name} mb={mb} seq={seq} ac={ac}")
                    m = run(cfg, MeasureOptions(warmup=1, steps=1, memory=True, timing=False))
                    if not m.ok:
                        log(f"  measurement {m.outcome.value}: {m.outcome_detail}")
                        continue
                    tr = trace_estimate(cfg)
                    est = formula_estimate(cfg).memory
                    peak, act = m.memory.peak_bytes, m.memory.activations_bytes
                    rows.append(dict(model=name, mb=mb, seq=seq, ac=ac, peak=peak, act=act,
                                     f_peak=error(est.peak_tensor_bytes, peak),  # tensor bytes, no margin
                                     t_peak=error(tr.memory.peak_bytes, peak),
                                     f_act=error(est.activations_bytes, act),
                                     t_act=error(tr.memory.activations_bytes, act)))
    return rows


def print_memory(rows) -> None:
    print("| model | micro-batch | seq | AC | measured peak MiB | formula | trace | measured activations MiB "
          "| formula | trace |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['mb']} | {r['seq']} | {r['ac']} | {mib(r['peak'])} | {pct(r['f_peak'])} | "
              f"{pct(r['t_peak'])} | {mib(r['act'])} | {pct(r['f_act'])} | {pct(r['t_act'])} |")
    print()
    for key, what in (("f_peak", "formula peak"), ("t_peak", "trace peak"), ("f_act", "formula activations"),
                      ("t_act", "trace activations")):
        errs = [abs(r[key]) for r in rows if r[key] is not None]
        if errs:
            print(f"- {what}: median |error| {statistics.median(errs):.1%}, max {max(errs):.1%} "
                  f"over {len(errs)} configs")
        else:
            print(f"- {what}: not available")
    print()


PAIRS = [
    ("tiny, AC none -> full", dict(ac="none"), dict(ac="full")),
    ("tiny, micro-batch 8 x accum 1 -> 1 x 8", dict(micro_batch=8, accum=1), dict(micro_batch=1, accum=8)),
    ("tiny, AC none -> selective", dict(ac="none"), dict(ac="selective")),
]


def _update_seconds(trainer) -> float:
    t = time.perf_counter()
    trainer.update()
    return time.perf_counter() - t


def paired_ratios(a: RunConfig, b: RunConfig, pairs: int, warmup: int = 2) -> list[float]:
    """t(B)/t(A) of adjacent updates of two live trainers, order alternated (A B, B A, ...), so that
    drift in machine load hits both sides of each pair alike."""
    ta, tb = Trainer(a, "cpu"), Trainer(b, "cpu")
    for _ in range(warmup):
        ta.update()
        tb.update()
    ratios = []
    for i in range(pairs):
        if i % 2 == 0:
            sa, sb = _update_seconds(ta), _update_seconds(tb)
        else:
            sb, sa = _update_seconds(tb), _update_seconds(ta)
        ratios.append(sb / sa)
    return ratios


def time_rows(pairs: int):
    base = RunConfig(model=preset("tiny"), seq=128, micro_batch=8)
    rows = []
    for label, a_changes, b_changes in PAIRS:
        a, b = base.replace(**a_changes), base.replace(**b_changes)
        log(f"time: {label}, {pairs} pairs")
        ratios = paired_ratios(a, b, pairs)
        cals = load_all()
        fa_t, fb_t = formula_estimate(a, cals).time.update_seconds, formula_estimate(b, cals).time.update_seconds
        flops_ratio = trace_estimate(b).flops.hardware_flops_per_update / trace_estimate(a).flops.hardware_flops_per_update
        rows.append(dict(label=label, ratios=ratios, formula=(fb_t / fa_t) if fa_t and fb_t else None,
                         flops=flops_ratio))
    return rows


def print_time(rows, pairs: int) -> None:
    print(f"Paired update-time ratios t(B)/t(A): {pairs} adjacent pairs of updates of two live trainers, order "
          "alternated, after 2 warm-up updates each (wall-clock); quartiles of the per-pair ratios.")
    print()
    print("| pair A -> B | measured ratio (median) | measured IQR | formula predicted | trace FLOPs ratio |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        lo, _, hi = statistics.quantiles(r["ratios"], n=4, method="inclusive")
        formula = "-" if r["formula"] is None else f"{r['formula']:.2f}"
        print(f"| {r['label']} | {statistics.median(r['ratios']):.2f} | {lo:.2f}-{hi:.2f} | {formula} | "
              f"{r['flops']:.2f} |")
    print()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny grid, one round: a smoke run")
    p.add_argument("--part", choices=("all", "memory", "time"), default="all")
    p.add_argument("--pairs", type=int, default=12, help="paired updates per time comparison")
    args = p.parse_args(argv)
    start = time.perf_counter()
    if args.quick:
        grid = (["tiny", "hf llama"], [2], [64], ["none", "full"])
        pairs = 4
    else:
        grid = (list(MODELS), [1, 4], [64, 128], ["none", "full", "selective"])
        pairs = args.pairs
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"Accuracy on {cpu_hardware()} ({torch.get_num_threads()} threads, load average {load:.1f} at start), "
          f"torch {torch.__version__}, {datetime.date.today().isoformat()}; fp32, AdamW, accum 1. "
          "error = (predicted - measured) / measured; measured = live tensor-storage tracker (allocator).")
    print()
    if args.part in ("all", "memory"):
        print_memory(memory_rows(*grid))
    if args.part in ("all", "time"):
        print_time(time_rows(pairs), pairs)
    log(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
