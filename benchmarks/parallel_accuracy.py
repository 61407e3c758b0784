"""Per-rank peak memory of tensor- and pipeline-parallel layouts, measured on forked gloo ranks against the formula.

Each layout is run by ``batchlab measure ... --json`` (every rank's live-storage peak and median update time) and
``batchlab estimate ... --json`` for the same command (``memory.ranks``: one entry per pipeline stage, which every
tensor- and data-parallel rank of the stage shares).  The page lists, rank by rank, the measured peak, the formula's
peak for that rank's stage and the error; then the ratios of update times between layouts of the same run (a change
of tensor degree or of pipeline schedule), measured against the formula's.  On CPU the absolute times say nothing
about a GPU: only ratios measured within one run of this script are shown.

    python benchmarks/parallel_accuracy.py            # writes docs/accuracy/parallel.md
    python benchmarks/parallel_accuracy.py --only TP2 --no-page
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from page import publish  # noqa: E402

BASE = ["--seq", "64", "--micro-batch", "4", "--accum", "4"]
LLAMA = ["--model", "hf:llama", "--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--ffn", "256",
         "--vocab", "512"]
LAYOUTS = {  # name -> the layout's flags (the built-in tiny GPT unless a model is given)
    "one process": [],
    "TP2": ["--tp", "2"],
    "TP2 x DP2": ["--tp", "2", "--dp", "2"],
    "TP2 + SP": ["--tp", "2", "--sequence-parallel"],
    "PP2 GPipe": ["--pp", "2", "--pp-schedule", "gpipe"],
    "PP2 1F1B": ["--pp", "2", "--pp-schedule", "1f1b"],
    "PP2 interleaved (2 chunks)": ["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--pp-virtual", "2"],
    "PP2 x DP2": ["--pp", "2", "--dp", "2", "--pp-schedule", "1f1b"],
    "FSDP2 (ZeRO-3) x TP2": ["--tp", "2", "--dp", "2", "--zero", "3"],
    "PP2 x FSDP2 (ZeRO-3)": ["--pp", "2", "--dp", "2", "--zero", "3", "--pp-schedule", "1f1b"],
    "Llama one process": LLAMA,
    "Llama TP2": LLAMA + ["--tp", "2"],
}
RATIOS = [  # (from, to, what changes)
    ("one process", "TP2", "TP1 -> TP2"),
    ("TP2", "TP2 + SP", "TP2 -> TP2 + sequence parallelism"),
    ("PP2 GPipe", "PP2 1F1B", "GPipe -> 1F1B"),
    ("PP2 1F1B", "PP2 interleaved (2 chunks)", "1F1B -> interleaved (2 chunks)"),
    ("Llama one process", "Llama TP2", "Llama TP1 -> TP2"),
]
MiB = 2**20


def _cli(command: str, flags: list[str], extra: list[str]) -> dict:
    args = [sys.executable, "-m", "batchlab", command, *BASE, *flags, *extra, "--json"]
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)}: exit {out.returncode}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def _measure(flags: list[str]) -> dict:
    return _cli("measure", flags, ["--warmup", "2", "--steps", "3", "--no-calibrate", "--no-progress"])


def _slowest(measured: dict) -> float:
    """An update ends when its slowest rank's does: the run's time is the slowest rank's median."""
    ranks = measured.get("ranks") or [dict(update_seconds_median=measured["time"]["update_seconds_median"])]
    return max(r["update_seconds_median"] for r in ranks)


def run(name: str, flags: list[str]) -> dict:
    measured = _measure(flags)
    estimate = _cli("estimate", flags, [])
    stages = {r["stage"]: r for r in estimate["memory"]["ranks"]}
    ranks = measured.get("ranks") or [dict(rank=0, pp=0, tp=0, dp=0, peak_bytes=measured["memory"]["peak_bytes"],
                                           update_seconds_median=measured["time"]["update_seconds_median"])]
    rows = [dict(rank=r["rank"], dp=r["dp"], tp=r["tp"], pp=r["pp"], measured=r["peak_bytes"],
                 formula=stages[r["pp"]]["peak_bytes"], parts=stages[r["pp"]]["parts"]) for r in ranks]
    return dict(name=name, flags=flags, rows=rows, seconds=[_slowest(measured)],
                formula_seconds=estimate["time"]["update_seconds"])


def _err(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}"


def document(results: dict[str, dict]) -> None:
    print("The tiny model (4 layers, hidden 128, 4 heads, vocabulary 512, tied embeddings) and a 2-layer Llama "
          "(Hugging Face `LlamaForCausalLM`, hidden 128, 4 heads, 2 kv heads, MLP 256, vocabulary 512), micro-batch "
          "4 x sequence 64, 4 micro-batches per update, fp32, AdamW, on forked gloo ranks (CPU, live-storage "
          "tracker: every storage an op makes, a DTensor op's local work included). Formula: `batchlab estimate` "
          "for the same command, the entry of the rank's pipeline stage in `memory.ranks`. "
          "Error = (formula - measured) / measured.\n")
    print("## Peak memory per rank\n")
    print("| layout | rank | dp | tp | pp | measured (MiB) | formula (MiB) | error |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for res in results.values():
        for r in res["rows"]:
            worst = max(worst, abs(r["formula"] - r["measured"]) / r["measured"])
            print(f"| {res['name']} | {r['rank']} | {r['dp']} | {r['tp']} | {r['pp']} | {r['measured'] / MiB:.2f} "
                  f"| {r['formula'] / MiB:.2f} | {_err(r['formula'], r['measured'])} |")
    print(f"\nLargest error over every rank: {worst:.1%}.\n")
    print("Commands (with `--seq 64 --micro-batch 4 --accum 4`):\n")
    for res in results.values():
        print(f"- {res['name']}: `batchlab measure {' '.join(res['flags'])}`".replace("measure  ", "measure "))
    print()
    rows = [(a, b, what) for a, b, what in RATIOS if a in results and b in results]
    if rows:
        print("## Update-time ratios\n")
        print("The slowest rank's median update time of the second layout over the first's, against the formula's "
              "ratio. Each layout's time is the lower of two measurements in this run (3 timed updates each after 2 "
              "warmup updates; the second pass in reverse order), on CPU cores other processes share: forked gloo "
              "ranks over loopback, one thread per rank against two threads for one process.\n")
        print("| change | measured ratio | formula ratio | error |")
        print("|---|---|---|---|")
        for a, b, what in rows:
            m = min(results[b]["seconds"]) / min(results[a]["seconds"])
            f = results[b]["formula_seconds"] / results[a]["formula_seconds"]
            print(f"| {what} | {m:.2f} | {f:.2f} | {_err(f, m)} |")
        print(f"\nLoad average at the end of the run: {os.getloadavg()[0]:.1f} (2 cores).\n")


def main() -> int:
    args = sys.argv[1:]
    only = None
    if "--only" in args:
        only = args[args.index("--only") + 1].split(",")
    results = {}
    for name, flags in LAYOUTS.items():
        if only and name not in only:
            continue
        print(f"running {name}", file=sys.stderr)
        results[name] = run(name, flags)
    timed = [n for n in LAYOUTS if n in results and any(n in pair[:2] for pair in RATIOS)]
    for name in reversed(timed):  # a second pass, reversed: a slow spell of the shared machine hits both sides
        print(f"timing {name} again", file=sys.stderr)
        results[name]["seconds"].append(_slowest(_measure(LAYOUTS[name])))
    document(results)
    return 0


if __name__ == "__main__":
    publish(main, "parallel", "Accuracy: tensor and pipeline parallelism, per rank")
