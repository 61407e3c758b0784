"""Per-rank peak memory of tensor- and pipeline-parallel layouts, measured on forked gloo ranks against the formula.

Each layout is run by ``batchlab measure ... --json`` (every rank's live-storage peak and median update time) and
``batchlab estimate ... --json`` for the same command (``memory.ranks``: one entry per pipeline stage, which every
tensor- and data-parallel rank of the stage shares).  The page lists, rank by rank, the measured peak, the formula's
peak for that rank's stage and the error; then the ratios of update times between layouts of the same run (a change
of tensor degree or of pipeline schedule), measured against the formula's.  On CPU the absolute times say nothing
about a GPU: only ratios measured within one run of this script are shown.

    python benchmarks/parallel_accuracy.py            # writes docs/accuracy/parallel.md
    python benchmarks/parallel_accuracy.py --only TP2 --no-page
    python benchmarks/parallel_accuracy.py --group unlisted   # the unlisted rows again, the listed ones kept

The unlisted rows are layouts and shapes the listed ones do not use, each at its own shape (4 ranks at most);
``--group listed`` or ``--group unlisted`` reruns one table and keeps the other from the page as it stands.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from page import publish  # noqa: E402

BASE = ["--seq", "64", "--micro-batch", "4", "--accum", "4"]
LLAMA = ["--model", "hf:llama", "--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--ffn", "256",
         "--vocab", "512"]
LLAMA_4 = [("4" if prev == "--layers" else a) for prev, a in zip([""] + LLAMA, LLAMA)]
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
    "Llama PP2 GPipe": LLAMA + ["--pp", "2", "--pp-schedule", "gpipe"],
    "Llama PP2 1F1B": LLAMA + ["--pp", "2", "--pp-schedule", "1f1b"],
    # 4 layers: 2 stages per rank of 1 layer each
    "Llama PP2 interleaved (2 chunks)": LLAMA_4 + ["--pp", "2", "--pp-schedule", "interleaved-1f1b",
                                                   "--pp-virtual", "2"],
    "Llama PP2 x DP2": LLAMA + ["--pp", "2", "--dp", "2", "--pp-schedule", "1f1b"],
}
UNLISTED = {  # name -> (shape, the layout's flags): layouts, models and shapes no listed row uses
    "PP2 x FSDP2 (ZeRO-3), small": (["--seq", "32", "--micro-batch", "2", "--accum", "2"],
                                    LAYOUTS["PP2 x FSDP2 (ZeRO-3)"]),
    "PP2 x FSDP2 (ZeRO-3), large": (["--seq", "96", "--micro-batch", "3", "--accum", "3"],
                                    LAYOUTS["PP2 x FSDP2 (ZeRO-3)"]),
    "TP2 x PP2 1F1B": (["--seq", "48", "--micro-batch", "2", "--accum", "4"],
                       ["--tp", "2", "--pp", "2", "--pp-schedule", "1f1b"]),
    "PP4 1F1B": (["--seq", "32", "--micro-batch", "2", "--accum", "4"], ["--pp", "4", "--pp-schedule", "1f1b"]),
    "PP2 interleaved (3 chunks), 6 layers": (["--seq", "32", "--micro-batch", "2", "--accum", "4"],
                                             ["--layers", "6", "--pp", "2", "--pp-schedule", "interleaved-1f1b",
                                              "--pp-virtual", "3"]),
    "TP2, full AC": (["--seq", "96", "--micro-batch", "2", "--accum", "2"], ["--tp", "2", "--ac", "full"]),
    "TP2, selective-op AC": (["--seq", "96", "--micro-batch", "2", "--accum", "2"],
                             ["--tp", "2", "--ac", "selective-op"]),
    "TP2 + SP, bf16-mixed": (["--seq", "48", "--micro-batch", "3", "--accum", "2"],
                             ["--tp", "2", "--sequence-parallel", "--precision", "bf16-mixed"]),
    "Llama TP2, seq 48": (["--seq", "48", "--micro-batch", "2", "--accum", "2"], LLAMA + ["--tp", "2"]),
    "Llama PP2 x FSDP2 (ZeRO-3)": (["--seq", "32", "--micro-batch", "2", "--accum", "2"],
                                   LLAMA + ["--pp", "2", "--dp", "2", "--zero", "3", "--pp-schedule", "1f1b"]),
    "PP2 GPipe x DP2": (["--seq", "32", "--micro-batch", "3", "--accum", "3"],
                        ["--pp", "2", "--dp", "2", "--pp-schedule", "gpipe"]),
    "PP2 interleaved (2 chunks) x FSDP2 (ZeRO-3)": (["--seq", "32", "--micro-batch", "2", "--accum", "4"],
                                                    ["--pp", "2", "--dp", "2", "--zero", "3", "--pp-schedule",
                                                     "interleaved-1f1b", "--pp-virtual", "2"]),
    "PP2 interleaved (2 chunks) x FSDP2 (ZeRO-2)": (["--seq", "32", "--micro-batch", "2", "--accum", "4"],
                                                    ["--pp", "2", "--dp", "2", "--zero", "2", "--pp-schedule",
                                                     "interleaved-1f1b", "--pp-virtual", "2"]),
    "PP4 interleaved (2 chunks), 8 layers": (["--seq", "32", "--micro-batch", "2", "--accum", "4"],
                                             ["--layers", "8", "--pp", "4", "--pp-schedule", "interleaved-1f1b",
                                              "--pp-virtual", "2"]),
    "Llama PP2 interleaved (2 chunks) x FSDP2 (ZeRO-3)": (["--seq", "32", "--micro-batch", "2", "--accum", "4"],
                                                          LLAMA_4 + ["--pp", "2", "--dp", "2", "--zero", "3",
                                                                     "--pp-schedule", "interleaved-1f1b",
                                                                     "--pp-virtual", "2"]),
    "Llama PP2 interleaved (3 chunks), 6 layers": (["--seq", "32", "--micro-batch", "2", "--accum", "4"],
                                                   [("6" if prev == "--layers" else a)
                                                    for prev, a in zip([""] + LLAMA, LLAMA)]
                                                   + ["--pp", "2", "--pp-schedule", "interleaved-1f1b",
                                                      "--pp-virtual", "3"]),
}
UNLISTED_HEADING = "## Unlisted layouts and shapes"
RATIOS = [  # (from, to, what changes)
    ("one process", "TP2", "TP1 -> TP2"),
    ("TP2", "TP2 + SP", "TP2 -> TP2 + sequence parallelism"),
    ("PP2 GPipe", "PP2 1F1B", "GPipe -> 1F1B"),
    ("PP2 1F1B", "PP2 interleaved (2 chunks)", "1F1B -> interleaved (2 chunks)"),
    ("Llama one process", "Llama TP2", "Llama TP1 -> TP2"),
    ("Llama PP2 GPipe", "Llama PP2 1F1B", "Llama GPipe -> 1F1B"),
]
MiB = 2**20


# The estimates read no cached calibration: every layout is priced by the same nominal per-op costs.  A cached one
# may lack the local ranks' part ("ranks": contention and the gloo link) that a layout of several ranks needs, and
# is then set aside for that layout alone, so one process and its layouts would be priced by different costs; and
# another process may write one in the middle of a run.
NO_CALIBRATION = tempfile.mkdtemp(prefix="batchlab-no-calibration-")


def _cli(command: str, flags: list[str], extra: list[str], base: list[str] = BASE) -> dict:
    args = [sys.executable, "-m", "batchlab", command, *base, *flags, *extra, "--json"]
    env = dict(os.environ, XDG_CACHE_HOME=NO_CALIBRATION) if command == "estimate" else None
    out = subprocess.run(args, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)}: exit {out.returncode}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def _measure(flags: list[str], base: list[str] = BASE) -> dict:
    return _cli("measure", flags, ["--warmup", "2", "--steps", "3", "--no-calibrate", "--no-progress"], base)


def _slowest(measured: dict) -> float:
    """An update ends when its slowest rank's does: the run's time is the slowest rank's median."""
    ranks = measured.get("ranks") or [dict(update_seconds_median=measured["time"]["update_seconds_median"])]
    return max(r["update_seconds_median"] for r in ranks)


def traced(flags: list[str], base: list[str] = BASE) -> dict[int, int]:
    """{pipeline stage: the traced peak of its first rank}: ``estimate --trace``'s build of that rank on a fake
    process group (trace/run.py rank_estimate), the command's config parsed by the CLI's own option parsing."""
    from batchlab.cli.common import config_from_command
    from batchlab.trace.run import rank_estimate
    from batchlab.trace.sharded import traced_ranks

    cfg = config_from_command(["estimate", *base, *flags])
    return {i: rank_estimate(cfg, r).memory.peak_bytes for i, r in enumerate(traced_ranks(cfg))}


def run(name: str, flags: list[str], base: list[str] = BASE) -> dict:
    measured = _measure(flags, base)
    estimate = _cli("estimate", flags, [], base)
    trace = traced(flags, base)
    stages = {r["stage"]: r for r in estimate["memory"]["ranks"]}
    ranks = measured.get("ranks") or [dict(rank=0, pp=0, tp=0, dp=0, peak_bytes=measured["memory"]["peak_bytes"],
                                           update_seconds_median=measured["time"]["update_seconds_median"])]
    rows = [dict(rank=r["rank"], dp=r["dp"], tp=r["tp"], pp=r["pp"], measured=r["peak_bytes"],
                 formula=stages[r["pp"]]["peak_bytes"], trace=trace[r["pp"]], parts=stages[r["pp"]]["parts"])
            for r in ranks]
    return dict(name=name, flags=flags, base=base, rows=rows, seconds=[_slowest(measured)],
                formula_seconds=estimate["time"]["update_seconds"])


def timed_link() -> tuple[float, float]:
    """(bytes/s, seconds per message) of gloo's link between two local processes, timed now as ``batchlab
    calibrate`` times it (calibrate/link.py: all-reduces right after a burst of compute, fitted to the ring model)."""
    from batchlab.calibrate.link import allreduce_times, ring_fit

    return ring_fit(allreduce_times(6.0).get("seconds", {}))


def priced(flags: list[str], link: tuple[float, float] | None) -> float:
    """The formula's update time with the nominal per-op costs of ``estimate`` and, where ``link`` is given, the
    local ranks' messages on that link (as a calibration's link prices them: formula/pipeline.py)."""
    import dataclasses

    from batchlab.cli.common import config_from_command
    from batchlab.formula import flops, memory, timing
    from batchlab.formula.oplist import update_ops
    from batchlab.formula.timing import costs_for

    cfg = config_from_command(["estimate", *BASE, *flags])
    costs = costs_for(cfg, None, update_ops(cfg))
    if link is not None:
        costs = dataclasses.replace(costs, link_bytes_per_s=link[0], link_latency_s=link[1])
    return timing(cfg, flops(cfg), memory(cfg), costs).update_seconds


def _rank_table(results: dict, with_shape: bool) -> None:
    """Every rank's measured, formula and trace peaks, and the largest error of each over the table."""
    shape_head, shape_rule = ("shape | ", "---|") if with_shape else ("", "")
    print(f"| layout | {shape_head}rank | dp | tp | pp | measured (MiB) | formula (MiB) | error | trace (MiB) | error |")
    print(f"|---|{shape_rule}---|---|---|---|---|---|---|---|---|")
    worst = {"formula": 0.0, "trace": 0.0}
    for res in results.values():
        shape = f" {'/'.join(res['base'][1::2])} |" if with_shape else ""
        for r in res["rows"]:
            for k in worst:
                worst[k] = max(worst[k], abs(r[k] - r["measured"]) / r["measured"])
            print(f"| {res['name']} |{shape} {r['rank']} | {r['dp']} | {r['tp']} | {r['pp']} "
                  f"| {r['measured'] / MiB:.2f} | {r['formula'] / MiB:.2f} | {_err(r['formula'], r['measured'])} "
                  f"| {r['trace'] / MiB:.2f} | {_err(r['trace'], r['measured'])} |")
    print(f"\nLargest error over every rank: formula {worst['formula']:.1%}, trace {worst['trace']:.1%}.\n")


def _err(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}"


def document(results: dict[str, dict], link: tuple[float, float] | None = None) -> None:
    print("The tiny model (4 layers, hidden 128, 4 heads, vocabulary 512, tied embeddings) and a 2-layer Llama "
          "(Hugging Face `LlamaForCausalLM`, hidden 128, 4 heads, 2 kv heads, MLP 256, vocabulary 512; 4 layers for its "
          "interleaved schedule), micro-batch "
          "4 x sequence 64, 4 micro-batches per update, fp32, AdamW, on forked gloo ranks (CPU, live-storage "
          "tracker: every storage an op makes, a DTensor op's local work included). Formula: `batchlab estimate` "
          "for the same command, the entry of the rank's pipeline stage in `memory.ranks`; its times priced by the "
          "nominal per-op costs for every layout alike (no cached calibration read). Trace: `batchlab estimate "
          "--trace`'s run of the stage's first rank on a fake process group (the measurement's own build of that "
          "rank: its shard and stage, on fake tensors). Error = (predicted - measured) / measured.\n")
    print("## Peak memory per rank\n")
    _rank_table(results, with_shape=False)
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
        if link is not None:
            print(f"Formula: `batchlab estimate`'s nominal costs, whose CPU entry knows no per-message cost of the "
                  f"link; beside it, the same costs with the local ranks' messages on gloo's link as `batchlab "
                  f"calibrate` times it, timed in this run between the two passes: {link[0] / 1e9:.2f} GB/s + "
                  f"{link[1] * 1e6:.0f} us per message (each collective: its ring messages x that + its bytes; each "
                  "pipeline send: one message). The nominal compute is an idle core's; the link is timed on the loaded "
                  "machine the layouts ran on, so this column weighs messages against compute as the load does "
                  "for the messages only.\n")
        print("| change | measured ratio | formula ratio | error | formula, link timed in this run | error |")
        print("|---|---|---|---|---|---|")
        for a, b, what in rows:
            m = min(results[b]["seconds"]) / min(results[a]["seconds"])
            f = results[b]["formula_seconds"] / results[a]["formula_seconds"]
            linked = ""
            if "linked_seconds" in results[a] and "linked_seconds" in results[b]:
                g = results[b]["linked_seconds"] / results[a]["linked_seconds"]
                linked = f" {g:.2f} | {_err(g, m)} |"
            print(f"| {what} | {m:.2f} | {f:.2f} | {_err(f, m)} |" + (linked or " | |"))
        print(f"\nLoad average at the end of the run: {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores).\n")
        print("What these differences are made of, measured (DTensor's host work, the collectives and point-to-point "
              "ops counted against the formula's catalogue, each schedule's compute, p2p and waits): "
              "[parallel-time-parts.md](parallel-time-parts.md), written by `benchmarks/parallel_time_parts.py`.\n")


def document_unlisted(results: dict[str, dict]) -> None:
    print(f"{UNLISTED_HEADING}\n")
    print("Layouts, models and shapes none of the rows above use (each at its own shape: seq / micro-batch / accum "
          "in the shape column), measured, estimated and traced as above. Where these rows found the formula off, its "
          "mechanism was corrected against the trace, no constant fitted: each pipeline stage is priced at every "
          "distinct step of its schedule (formula/stage_steps.py: a later backward with every gradient can top the "
          "first one with every warm-up micro-batch), FSDP2 inside a stage as torch.distributed.pipelining runs it "
          "(formula/fsdp_pipeline.py: gradients unsharded and accumulated, units regathered after each forward), and the "
          "interleaved schedule chunk by chunk in torch's own order (formula/interleaved.py, fsdp_interleaved.py: "
          "the other chunks' micro-batches, gradients and gathered units, and the sends its runtime keeps to the "
          "step's end).\n")
    _rank_table(results, with_shape=True)
    print("Llama TP2 + SP is not on the table: `batchlab measure` refuses it (sequence parallelism is measured on "
          "the built-in GPT only), in one line naming `sequence_parallel`; its formula and trace have no run to "
          "be checked against.\n")
    print("Commands:\n")
    for res in results.values():
        print(f"- {res['name']}: `batchlab measure {' '.join(res['base'] + res['flags'])}`")
    print()


def _kept(group: str) -> str:
    """The page's other table as it stands (``--group``: one table rerun), with the date it was written."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "accuracy" / "parallel.md").read_text()
    date = next((line.split("|")[2].strip() for line in page.splitlines() if line.startswith("| date |")), "?")
    body = page.split("| reproduce |", 1)[1].split("\n", 2)[2] if "| reproduce |" in page else ""
    listed, _, unlisted = body.partition(UNLISTED_HEADING)
    kept = listed if group == "unlisted" else UNLISTED_HEADING + unlisted if unlisted else ""
    return (f"{kept.rstrip()}\n\n(The table above is kept from the run of {date}.)\n\n" if kept.strip() else "")


def main() -> int:
    args = sys.argv[1:]
    only = None
    if "--only" in args:
        only = args[args.index("--only") + 1].split(",")
    group = args[args.index("--group") + 1] if "--group" in args else "all"
    if group not in ("all", "listed", "unlisted"):
        raise SystemExit(f"--group: one of all, listed, unlisted, got {group!r}")
    if group == "unlisted":
        print(_kept(group), end="")
    else:
        results = {}
        for name, flags in LAYOUTS.items():
            if only and name not in only:
                continue
            print(f"running {name}", file=sys.stderr)
            results[name] = run(name, flags)
        timed = [n for n in LAYOUTS if n in results and any(n in pair[:2] for pair in RATIOS)]
        print("timing gloo's link", file=sys.stderr)
        link = timed_link()
        for name in timed:
            nominal = priced(LAYOUTS[name], None)
            if abs(nominal - results[name]["formula_seconds"]) > 1e-6 * nominal:  # the in-process pricing is estimate's
                raise SystemExit(f"{name}: in-process nominal {nominal} s != batchlab estimate's "
                                 f"{results[name]['formula_seconds']} s")
            results[name]["linked_seconds"] = priced(LAYOUTS[name], link)
        for name in reversed(timed):  # a second pass, reversed: a slow spell of the shared machine hits both sides
            print(f"timing {name} again", file=sys.stderr)
            results[name]["seconds"].append(_slowest(_measure(LAYOUTS[name])))
        document(results, link)
    if group == "listed":
        print(_kept(group), end="")
    else:
        unlisted = {}
        for name, (base, flags) in UNLISTED.items():
            if only and name not in only:
                continue
            print(f"running {name}", file=sys.stderr)
            unlisted[name] = run(name, flags, base)
        document_unlisted(unlisted)
    return 0


if __name__ == "__main__":
    publish(main, "parallel", "Accuracy: tensor and pipeline parallelism, per rank")
