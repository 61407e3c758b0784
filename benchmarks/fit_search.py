"""`batchlab fit`: the formula plan's speed, and the measured search against an exhaustive sweep.

1. llama-2-7b, seq 4096, global batch 512, 8 x H100 80 GB, bf16-mixed + AdamW, ZeRO-1: CLI wall time of
   `batchlab fit` (fresh process each) and whether the recommendation fits by the formula.
2. Built-in tiny model on this CPU with --memory-budget: every micro-batch measured once (isolated, no
   budget: its peak tracked tensor bytes), then for budgets placed between and on those peaks the search
   (isolated trials under the budget) seeded by the formula, and seeded at the wrong end.  Its answer must
   equal the sweep's (largest micro-batch whose peak <= budget) within ceil(log2(max)) + 2 trials.  One
   search is repeated to show it is reproducible.
3. Induced out-of-memory: isolated runs under budgets below the peak (and a factory whose batches SIGKILL
   their own process, as the kernel's OOM killer would) until N OOMs have been data points; the orchestrator
   must carry on through all of them.

    .venv/bin/python benchmarks/fit_search.py              # a few minutes on 2 cores
    .venv/bin/python benchmarks/fit_search.py --ooms 5     # shorter
Prints Markdown on stdout (progress on stderr).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

from batchlab.advise import Goal, Trial, exhaustive, isolated_measure, max_trials, plan, search_largest
from batchlab.config import RunConfig, config_from_dict, preset
from batchlab.formula import estimate

LLAMA_ARGS = ["--model", "llama-2-7b", "--seq", "4096", "--global-batch", "512", "--dp", "8", "--device",
              "h100-sxm", "--precision", "bf16-mixed", "--optimizer", "adamw", "--zero", "1", "--json"]
CPU_BASE = RunConfig(model=preset("tiny"), seq=64, micro_batch=1, accum=16)  # global batch 16


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def kill_above_two(cfg):
    """Factory (package.module:factory) whose batches SIGKILL their process above micro-batch 2."""
    from batchlab.models import synthetic_tokens
    from batchlab.models.gpt import GPT

    make = synthetic_tokens(cfg.model.vocab, cfg.data)

    def make_batch(gen, micro_batch, seq, device):
        if micro_batch > 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return make(gen, micro_batch, seq, device)

    return GPT(cfg.model), make_batch, lambda m, x, y: m(x, y, loss_sum=True)


# ------------------------------------------------------------------------------------------ 1. target

def llama_target(runs: int) -> dict:
    walls, out = [], None
    for _ in range(runs):
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "batchlab", "fit", *LLAMA_ARGS], capture_output=True, text=True)
        walls.append(time.perf_counter() - t)
        out = json.loads(proc.stdout)
    final = config_from_dict(out["final"]) if out["final"] else None
    peak = estimate(final).memory.peak_bytes if final else None
    return {"wall_s": walls, "final": out["final"], "peak_bytes": peak, "usable_bytes": out["usable_bytes"],
            "fits": peak is not None and peak <= out["usable_bytes"]}


# ------------------------------------------------------------------------------------------ 2. search

def sweep() -> dict[int, Trial]:
    measure = isolated_measure(CPU_BASE.memory_capacity)
    r = exhaustive(CPU_BASE, _logged(measure, "sweep"))
    return {t.micro_batch: t for t in r.trials}


def _logged(measure, label: str):
    def run(cfg):
        t = measure(cfg)
        log(f"  {label}: micro-batch {cfg.micro_batch} -> {t.outcome} peak {t.peak_bytes}")
        return t
    return run


def budgets_from(peaks: dict[int, int]) -> list[tuple[int, bool]]:
    """(budget, also seed at the wrong end): between the two smallest and the two largest peaks, exactly on
    the middle one, and below the smallest (nothing fits)."""
    v = sorted(peaks.values())
    return [((v[0] + v[1]) // 2, True), ((v[-2] + v[-1]) // 2, True), (v[len(v) // 2], False), (v[0] - 1, False)]


def searched(budget: int, seed_mode: str):
    cfg = CPU_BASE.replace(memory_budget=budget)
    predicted = plan(Goal(cfg, margin=0.0)).predicted_limit(cfg.ac, cfg.zero)
    seed = {"formula": predicted, "wrong": 16 if (predicted or 0) < 8 else 1}[seed_mode]
    r = search_largest(cfg, _logged(isolated_measure(budget), f"search {budget} ({seed_mode})"), seed)
    return r, predicted


def _row(budget: int, mode: str, peaks: dict[int, int]) -> dict:
    reference = max((mb for mb, p in peaks.items() if p <= budget), default=None)
    r, predicted = searched(budget, mode)
    return {"budget": budget, "seed": mode, "predicted_limit": predicted, "reference": reference,
            "found": r.limit, "trials": r.trial_count, "trial_budget": max_trials(16),
            "ooms": sum(t.out_of_memory for t in r.trials),
            "trial_log": [(t.micro_batch, t.outcome, t.peak_bytes) for t in r.trials]}


def search_rows(peaks: dict[int, int]) -> list[dict]:
    rows = []
    for budget, wrong_too in budgets_from(peaks):
        rows.append(_row(budget, "formula", peaks))
        if wrong_too:
            rows.append(_row(budget, "wrong", peaks))
    return rows


def reproducible(rows: list[dict], peaks: dict[int, int]) -> bool:
    """The first search again, in fresh processes: same trials, same outcomes, same bytes."""
    again = _row(rows[0]["budget"], rows[0]["seed"], peaks)
    return again["trial_log"] == rows[0]["trial_log"]


# ------------------------------------------------------------------------------------------ 3. OOMs

def induced_ooms(peaks: dict[int, int], wanted: int, already: int) -> dict:
    outcomes, crashed = [], 0
    plans = [(CPU_BASE.with_global_batch(16, mb).replace(memory_budget=int(peaks[mb] * f)), None)
             for f in (0.5, 0.8, 0.95, 0.999) for mb in sorted(peaks)]
    killer = CPU_BASE.replace(model_source="fit_search:kill_above_two").with_global_batch(16, 4)
    plans = [(killer, "kill")] + plans
    i = 0
    while already + len(outcomes) < wanted:
        cfg, _ = plans[i % len(plans)]
        i += 1
        try:
            t = _logged(isolated_measure(cfg.memory_capacity), "oom")(cfg)
            outcomes.append(t.outcome)
        except Exception as e:  # noqa: BLE001 — the point: count orchestrator crashes instead of dying
            crashed += 1
            log(f"  orchestrator raised {type(e).__name__}: {e}")
    return {"runs": len(outcomes) + crashed, "outcomes": outcomes, "orchestrator_crashes": crashed,
            "all_oom": all(o.startswith("oom") for o in outcomes)}


# ------------------------------------------------------------------------------------------ report

def report(target: dict, peaks: dict[int, int], rows: list[dict], repro: bool, ooms: dict, seconds: float) -> None:
    w = target["wall_s"]
    f = target["final"]
    print("## batchlab fit: plan speed and measured search\n")
    print(f"llama-2-7b, seq 4096, global batch 512, 8 x h100-sxm, bf16-mixed + AdamW, ZeRO-1: CLI wall "
          f"median {statistics.median(w):.2f} s (min {min(w):.2f}, max {max(w):.2f}, {len(w)} fresh processes); "
          f"chosen micro-batch {f['micro_batch']} x accum {f['accum']} x DP {f['dp']}, {f['ac']}; predicted peak "
          f"{target['peak_bytes'] / 2**30:.2f} GiB <= {target['usable_bytes'] / 2**30:.2f} GiB usable: "
          f"{'fits' if target['fits'] else 'DOES NOT FIT'} (formula)\n")
    print("Tiny model, seq 64, global batch 16, fp32 AdamW on this CPU; peak tracked tensor bytes per micro-batch "
          "(allocator, isolated, no budget): " + ", ".join(f"{mb}: {p:,}" for mb, p in sorted(peaks.items())) + "\n")
    print("| budget (bytes) | seed | formula limit | exhaustive | search | trials (budget) | OOM trials |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        ok = "" if r["found"] == r["reference"] else " MISMATCH"
        print(f"| {r['budget']:,} | {r['seed']} | {r['predicted_limit']} | {r['reference']} | {r['found']}{ok} | "
              f"{r['trials']} ({r['trial_budget']}) | {r['ooms']} |")
    agree = all(r["found"] == r["reference"] for r in rows)
    within = all(r["trials"] <= r["trial_budget"] for r in rows)
    print(f"\nsearch == exhaustive in {sum(r['found'] == r['reference'] for r in rows)}/{len(rows)}; "
          f"within the trial budget: {within}; repeated search identical: {repro}")
    print(f"induced OOMs: {ooms['already'] + len(ooms['outcomes'])} OOM data points ({ooms['already']} in the searches, "
          f"{len(ooms['outcomes'])} more: {', '.join(sorted(set(ooms['outcomes'])))}); orchestrator crashes: "
          f"{ooms['orchestrator_crashes']}")
    print(f"\ntotal {seconds / 60:.1f} min on {os.cpu_count()} cores")
    if not (target["fits"] and agree and within and repro and ooms["orchestrator_crashes"] == 0):
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="fresh CLI processes for the llama target")
    ap.add_argument("--ooms", type=int, default=20, help="out-of-memory data points to induce in total")
    args = ap.parse_args()
    start = time.perf_counter()
    log("1. llama target")
    target = llama_target(args.runs)
    log("2. exhaustive sweep")
    peaks = {mb: t.peak_bytes for mb, t in sweep().items()}
    rows = search_rows(peaks)
    repro = reproducible(rows, peaks)
    already = sum(r["ooms"] for r in rows)
    log("3. induced OOMs")
    ooms = induced_ooms(peaks, args.ooms, already)
    ooms["already"] = already
    report(target, peaks, rows, repro, ooms, time.perf_counter() - start)


if __name__ == "__main__":
    import page  # benchmarks/page.py: this script's page of the docs

    page.publish(main, "fit_search", "batchlab fit: plan speed and measured search")
