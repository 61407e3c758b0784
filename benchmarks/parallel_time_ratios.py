"""Predicted against measured update-time ratios of tensor / pipeline / schedule changes, on 4 forked gloo ranks.

Each model's layouts are all built in the same 4 rank processes (one thread each), which run their updates
paired and interleaved: for every A/B pair, rounds of A B (B A on odd rounds), each update started on a barrier and
timed on every rank; an update's time is its slowest rank's, a round's ratio B/A.  Reported: the median of the
rounds' ratios and their spread (min-max), against the formula's ratio (``batchlab estimate`` for each side).
The page brackets each model's rounds with calibrations (``--calibration bracket``): one measured before the first
model and one after each, every part compare measures (the kernels, gloo's link, its chained all-reduce, DTensor's
host cost), and prices a model's rows with the two either side of its rounds.  On a shared VM the link and the
compute rates drift over minutes (by tens of percent between calibrations taken tens of minutes apart: docs/cpu.md,
"Figures behind the code's choices"): a calibration taken before the run prices every row at another moment's machine, and the two
sides' figures say how far the machine itself moved while the rows ran.  ``--calibration cached`` prices with
this CPU's cached calibration, as compare does.  Every pair keeps the
world at 4 ranks and the global batch fixed (fewer data-parallel ranks: more micro-batches per update), so that both
sides of a pair share the same processes.  The load average and the CPUs this process may run on are printed
before and after: forked ranks share the host's cores with whatever else runs.  The script runs in the allocator
regime batchlab's own measuring processes use (batchlab.host.regime: glibc keeps freed memory, the heap pre-touched
after warmup; the state the time model prices): under glibc's defaults GPipe's m micro-batches of activations alive at
once were unmapped after every update and faulted in again in the next (500-3,000 minor faults a rank per update
against ~10 for 1F1B, ~10% more CPU time a rank), which the GPipe -> 1F1B rows measured as 1F1B 10-25% faster.
The page faults of each side's updates are printed.

    PYTHONPATH=src python benchmarks/parallel_time_ratios.py      # writes docs/accuracy/parallel-time-ratios.md
    PYTHONPATH=src python benchmarks/parallel_time_ratios.py --quick   # 2 rounds, GPT only, prints only
    PYTHONPATH=src python benchmarks/parallel_time_ratios.py --only "GPT s128"   # one model's pairs, prints only

The rows of the models after the first two were added after the time model was fitted on those: each one's first
error (before any change made with it in view) is kept in ``FIRST_ERROR``, every third is a hold-out (†) that no
change is ever tuned against.
"""
from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from page import publish  # noqa: E402

WARMUP = 2  # untimed updates of every layout before the rounds
WORLD = 4
# paired rounds per A/B pair: ranks time-sharing cores spread a pair's per-round ratios by a third, and a median of
# 5 rounds moved between runs by more than the 15% the issue allows; 9 keeps the median's own spread well inside it
# at about twice the run time.  With a core per rank 5 serve.
DEFAULT_ROUNDS = 9 if len(os.sched_getaffinity(0)) < WORLD else 5  # the cores this process may use, not the host's
THREADS = 1
BASE = "--seq 64 --micro-batch 4"
GPT = ""
LLAMA = "--model hf:llama --layers 2 --hidden 128 --heads 4 --kv-heads 2 --ffn 256 --vocab 512"
# name -> flags at a world of 4 ranks and a global batch of 4 x 16 = 64 sequences
LAYOUTS = {
    "DP4": "--dp 4 --accum 4",
    "TP2 x DP2": "--tp 2 --dp 2 --accum 8",
    "TP2 x DP2 + SP": "--tp 2 --dp 2 --accum 8 --sequence-parallel",
    "FSDP2 x TP2": "--tp 2 --dp 2 --accum 8 --zero 3",
    "PP2 x DP2 GPipe": "--pp 2 --dp 2 --accum 8 --pp-schedule gpipe",
    "PP2 x DP2 1F1B": "--pp 2 --dp 2 --accum 8 --pp-schedule 1f1b",
    "PP2 x DP2 interleaved (2 chunks)": "--pp 2 --dp 2 --accum 8 --pp-schedule interleaved-1f1b --pp-virtual 2",
}
PAIRS = {  # model -> [(A, B, what changes)]
    "GPT": [("DP4", "TP2 x DP2", "tp 1 -> 2"),
            ("TP2 x DP2", "TP2 x DP2 + SP", "+ sequence parallelism"),
            ("TP2 x DP2", "FSDP2 x TP2", "DDP -> FSDP2 (ZeRO-3) beside TP2"),
            ("DP4", "PP2 x DP2 1F1B", "pp 1 -> 2"),
            ("PP2 x DP2 GPipe", "PP2 x DP2 1F1B", "GPipe -> 1F1B"),
            ("PP2 x DP2 1F1B", "PP2 x DP2 interleaved (2 chunks)", "1F1B -> interleaved (2 chunks)")],
    "Llama": [("DP4", "TP2 x DP2", "tp 1 -> 2"),
              ("PP2 x DP2 GPipe", "PP2 x DP2 1F1B", "GPipe -> 1F1B"),
              ("DP4", "PP2 x DP2 1F1B", "pp 1 -> 2")],
}
MODELS = {"GPT": GPT, "Llama": LLAMA}
# added later, at other shapes and micro-batch counts (see the module's docstring)
MODELS.update({"GPT s128": "--seq 128 --micro-batch 2", "Llama s128": LLAMA + " --seq 128 --micro-batch 2"})
LAYOUTS.update({"PP2 x DP2 GPipe m4": "--pp 2 --dp 2 --accum 4 --pp-schedule gpipe",
                "PP2 x DP2 1F1B m4": "--pp 2 --dp 2 --accum 4 --pp-schedule 1f1b"})
PAIRS.update({
    "GPT s128": [("DP4", "TP2 x DP2", "tp 1 -> 2"), ("PP2 x DP2 GPipe m4", "PP2 x DP2 1F1B m4", "GPipe -> 1F1B, m 4"),
                 ("DP4", "TP2 x DP2 + SP", "tp 1 -> 2 with sequence parallelism")],
    "Llama s128": [("DP4", "TP2 x DP2", "tp 1 -> 2"), ("PP2 x DP2 GPipe m4", "PP2 x DP2 1F1B m4", "GPipe -> 1F1B, m 4"),
                   ("DP4", "PP2 x DP2 GPipe", "pp 1 -> 2 (GPipe)")],
})
HOLDOUT = {("GPT s128", "tp 1 -> 2 with sequence parallelism"), ("Llama s128", "pp 1 -> 2 (GPipe)")}
FIRST_ERROR = {  # (model, change) -> the row's first error: its first run (load average 13-17), the formula before
    ("GPT s128", "tp 1 -> 2"): "-10%",  # any change made with it in view, this CPU's calibration as the page's
    ("GPT s128", "GPipe -> 1F1B, m 4"): "+32%",
    ("GPT s128", "tp 1 -> 2 with sequence parallelism"): "-30%",
    ("Llama s128", "tp 1 -> 2"): "-42%",
    ("Llama s128", "GPipe -> 1F1B, m 4"): "+33%",
    ("Llama s128", "pp 1 -> 2 (GPipe)"): "+21%",
}


def _options(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Tensor / pipeline time ratios on 4 gloo ranks (writes the page)")
    p.add_argument("--quick", action="store_true", help="2 rounds, GPT only, prints only")
    p.add_argument("--rounds", type=int, help=f"paired rounds per A/B pair (default {DEFAULT_ROUNDS})")
    p.add_argument("--only", help=f"models, comma-separated: {', '.join(PAIRS)}")
    p.add_argument("--pairs", help="only the changes named, ';'-separated (a smoke run of a few rows)")
    p.add_argument("--no-page", action="store_true", help="print, do not write the page")
    p.add_argument("--calibration", choices=("bracket", "cached"),
                   help="bracket (the page's default): calibrate afresh before the first model and after each, and "
                        "price a model's rows with the calibrations either side of its rounds; cached: this CPU's "
                        "cached calibration, as compare prices (the default with --quick)")
    a = p.parse_args(argv)
    if a.rounds is not None and not 1 <= a.rounds <= 1000:
        p.error(f"--rounds: 1 to 1000, got {a.rounds}")
    if a.only and (unknown := set(a.only.split(",")) - set(PAIRS)):
        p.error(f"--only: {', '.join(sorted(unknown))} is none of {', '.join(PAIRS)}")
    return a


def _selected(a: argparse.Namespace) -> dict:
    pairs = {"GPT": PAIRS["GPT"]} if a.quick else dict(PAIRS)
    if a.only:
        pairs = {m: pairs[m] for m in a.only.split(",") if m in pairs}
    if a.pairs:
        keep = a.pairs.split(";")
        pairs = {m: [p for p in ps if p[2] in keep] for m, ps in pairs.items() if any(p[2] in keep for p in ps)}
    if not pairs:
        raise SystemExit("--pairs / --only: no pair selected; the changes: "
                         + "; ".join(sorted({p[2] for ps in PAIRS.values() for p in ps})))
    return pairs


OPTIONS = _options(sys.argv[1:] if __name__ == "__main__" else [])
ROUNDS = OPTIONS.rounds or (2 if OPTIONS.quick else DEFAULT_ROUNDS)
BRACKET = (OPTIONS.calibration or ("cached" if OPTIONS.quick else "bracket")) == "bracket"
SECONDS = 10.0  # each fresh calibration's budget: `batchlab calibrate`'s default
PAIRS = _selected(OPTIONS)


def config(model: str, layout: str):
    from batchlab.cli.common import config_from_command

    base = BASE if model in ("GPT", "Llama") else ""
    return config_from_command(["estimate", *f"{base} {MODELS[model]} {LAYOUTS[layout]}".split()])


def _used(model: str) -> list[str]:
    return list(dict.fromkeys(n for a, b, _ in PAIRS[model] for n in (a, b)))


def rank_main(rank: int, model: str, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from batchlab.distributed import engines, layouts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(THREADS)
    dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    trainers = {}
    for name in _used(model):
        cfg = config(model, name)
        trainers[name] = (layouts.build(cfg, cpu, rank)[0] if layouts.applies(cfg)
                          else engines.build(cfg, cpu, rank, WORLD)[0])
    from batchlab.host import regime

    for tr in trainers.values():
        for _ in range(WARMUP):
            tr.update()
    regime.pretouch()  # as a measuring process does after warmup: the heap a long run has grown into
    walls: dict[tuple[str, str], list[tuple[float, float]]] = {}
    faults: dict[tuple[str, str], tuple[int, int]] = {}  # minor page faults of an update, A and B (median of rounds)
    for a, b, _ in PAIRS[model]:
        rows, most = [], {a: [], b: []}
        for k in range(ROUNDS):
            got = {}
            for name in ((a, b) if k % 2 == 0 else (b, a)):
                dist.barrier()
                f, t = regime.minor_faults(), time.perf_counter()
                trainers[name].update()
                got[name] = time.perf_counter() - t
                most[name].append(regime.minor_faults() - f)
            rows.append((got[a], got[b]))
        walls[(a, b)], faults[(a, b)] = rows, (statistics.median(most[a]), statistics.median(most[b]))
    queue.put((rank, walls, faults))
    dist.barrier()
    dist.destroy_process_group()


def measure(model: str) -> tuple[dict[tuple[str, str], list[tuple[float, float]]], dict[tuple[str, str], tuple]]:
    """Per pair, each round's (A, B) update time of the slowest rank, and the page faults of an A and a B update
    (the median of the rounds, on the rank with the most)."""
    import torch.multiprocessing as mp

    from batchlab.host import free_port

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, model, port, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    ranks: list = []
    while len(ranks) < WORLD:  # a rank that died fails the run at once, not after a long timeout
        try:
            ranks.append(q.get(timeout=5))
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    if p.is_alive():
                        p.kill()
                raise RuntimeError(f"rank(s) {dead} of the {model} layouts exited with {procs[dead[0]].exitcode}")
    for p in procs:
        p.join(timeout=60)
    out = {}
    for pair in ranks[0][1]:
        per_rank = [r[1][pair] for r in ranks]
        out[pair] = [(max(x[i][0] for x in per_rank), max(x[i][1] for x in per_rank)) for i in range(ROUNDS)]
    faults = {pair: tuple(max(r[2][pair][i] for r in ranks) for i in (0, 1)) for pair in ranks[0][2]}
    return out, faults


def predicted(model: str, cal) -> dict[str, float]:
    from batchlab.formula import estimate

    return {name: estimate(config(model, name), cal).time.update_seconds for name in _used(model)}


def direction(ratios: list[float], want: float) -> str:
    """"right" where the formula's ratio moves the way the rounds did: up (every round above 1), down (every round
    below 1), or, where the rounds straddle 1, a formula ratio inside their spread."""
    lo, hi = min(ratios), max(ratios)
    if lo > 1:
        return "right" if want > 1 else "WRONG"
    if hi < 1:
        return "right" if want < 1 else "WRONG"
    return "right (same)" if lo <= want <= hi else "WRONG (measured same)"


def _chain(c) -> str:
    from batchlab.calibrate import chain as chained

    return chained.text(c.link_chain_seconds) or c.untimed.get(chained.KEY, "not measured: priced from the link's medians")


def fresh(cfgs: tuple):
    """A calibration of this CPU at ``THREADS`` measured now, every part ``cfgs`` price with (what `batchlab
    calibrate --threads 1` and then compare's first run measure), cached as compare would cache it; the page's
    calibrations as ``load_all`` gives them, and what was said."""
    from batchlab.calibrate import auto, load_all, save
    from batchlab.calibrate.run import checked, measure as calibrate
    from batchlab.formula.calibration import needs

    scope = tuple(set().union(*map(needs, cfgs)))
    save(checked(lambda: calibrate("cpu", seconds=SECONDS, threads=THREADS, scope=scope)))
    said = auto("cpu", THREADS, cfgs=cfgs)  # the parts measured on first use: DTensor, the chain, the link's CPU share
    return load_all(THREADS), said


def calibration_row(name: str, cal) -> str:
    """One calibration's figures that move a ratio: fp32 matmul peak, link, chained all-reduce, DTensor."""
    c = cal.get("cpu")
    if c is None:
        return f"| {name} | none: nominal CPU figures | | | | | |"
    busy = f"{c.other_cores:.1f}" if c.other_cores >= 0 else "unknown"
    dt = " / ".join(f"{c.dtensor_seconds[k] * 1e6:.0f}" for k in ("forward", "backward", "collective")
                    if k in c.dtensor_seconds) or "nominal"
    return (f"| {name} | {c.measured_at[11:19]} | {busy} | {c.matmul_flops_fp32 / 1e9:.1f} | "
            f"{c.loopback_latency_s * 1e6:.0f} us, {c.loopback_bytes_per_s / 1e6:.0f} MB/s | {_chain(c)} | {dt} |")


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def _calibrations(cfgs: tuple) -> tuple[list, list[str]]:
    """The calibrations the rows are priced with: (``load_all`` answers, what measuring them said).  Bracketed:
    one measured now; the loop adds one after each model.  Cached: this CPU's, measured first where missing."""
    from batchlab.calibrate import auto, load_all

    if BRACKET:
        cal, said = fresh(cfgs)
        return [cal], [said] if said else []
    said = auto("cpu", THREADS, cfgs=cfgs)
    return [load_all(THREADS)], [said] if said else []


def _row(model: str, pair: tuple[str, str, str], walls, faults,
         sides: list[dict[str, float]]) -> tuple[str, float, float]:
    """One pair's table row, its error and the error under the first calibration alone: the formula's ratio is the
    geometric mean of its ratio under each calibration in ``sides`` (before and after the model's rounds where
    bracketed)."""
    a, b, what = pair
    ratios = [y / x for x, y in walls[(a, b)]]
    each = [f[b] / f[a] for f in sides]
    got, want = statistics.median(ratios), statistics.geometric_mean(each)
    err = (want - got) / got
    ms = [statistics.median(x[i] for x in walls[(a, b)]) * 1e3 for i in (0, 1)]
    fa, fb = (statistics.geometric_mean(f[n] for f in sides) * 1e3 for n in (a, b))
    mark = " †" if (model, what) in HOLDOUT else ""
    moved = f" | {each[0]:.2f} / {each[-1]:.2f} ({each[-1] / each[0] - 1:+.0%})" if BRACKET else ""
    return (f"| {model} | {what}{mark} | {a} | {b} | {ms[0]:.0f} / {ms[1]:.0f} | {fa:.0f} / {fb:.0f} | {got:.2f} | "
            f"{min(ratios):.2f}-{max(ratios):.2f} | {want:.2f}{moved} | {err:+.0%} | "
            f"{FIRST_ERROR.get((model, what), '')} | {direction(ratios, want)} | "
            f"{faults[(a, b)][0]:,.0f} / {faults[(a, b)][1]:,.0f} |"), err, (each[0] - got) / got


def main() -> int:
    from batchlab.calibrate.run import Rejected

    cpus = sorted(os.sched_getaffinity(0))
    print(f"Built-in tiny GPT (4 layers, hidden 128, vocabulary 512) and a 2-layer Hugging Face Llama (hidden 128, "
          f"4 heads, 2 kv heads, MLP 256, vocabulary 512), micro-batch 4 x sequence 64 (the \"s128\" rows: micro-batch "
          f"2 x sequence 128), fp32, AdamW; every layout on {WORLD} forked gloo ranks of {THREADS} thread each, a "
          f"global batch of 16 micro-batches (the \"m 4\" pipelines: 8). {ROUNDS} paired rounds "
          f"per pair (A B, then B A), {WARMUP} warmup updates of every layout first; an update's time is its slowest "
          f"rank's.\n")
    print(f"Before: {_load()}; this process may run on CPUs {cpus}.\n")
    cfgs = tuple(config(m, n) for m in PAIRS for n in _used(m))
    cals, said = _calibrations(cfgs)
    rows, errors, held, first = [], [], [], []
    for model in PAIRS:
        print(f"measuring {model} ...", file=sys.stderr, flush=True)
        walls, faults = measure(model)
        if BRACKET:
            try:
                cal, line = fresh(cfgs)
            except Rejected as e:  # the rounds are kept: the model is priced with the calibration before them alone
                cal, line = cals[-1], f"the calibration after {model} failed its checks twice ({e}): not used"
            cals.append(cal)
            said += [line] if line else []
        sides = [predicted(model, c) for c in (cals[-2:] if BRACKET else cals)]
        for pair in PAIRS[model]:
            row, err, before = _row(model, pair, walls, faults, sides)
            rows.append(row)
            first.append((abs(before), (model, pair[2]) in HOLDOUT))
            (held if (model, pair[2]) in HOLDOUT else errors).append(abs(err))
    if said:
        print("Calibration: " + "; ".join(said).replace("\n", "; ") + "\n")
    print("Calibrations, each `batchlab calibrate --threads 1` with what compare then measures for these layouts "
          + ("(taken before the first model's rounds and after each model's):\n" if BRACKET else
             "(this CPU's cached one, as compare prices; on a quiet machine, calibrate afresh first):\n"))
    print("| calibration | taken (UTC) | other processes' load (cores) | fp32 matmul peak (GFLOP/s) | gloo link "
          "| gloo's all-reduce as a chain pays it | DTensor per op, forward / backward / collective (us) |")
    print("|---|---|---|---|---|---|---|")
    for i, c in enumerate(cals):
        print(calibration_row("cached" if not BRACKET else "before " + list(PAIRS)[0] if i == 0
                              else "after " + list(PAIRS)[i - 1], c))
    print()
    both = " | formula B/A before / after (moved)" if BRACKET else ""
    print("| model | change | A | B | measured A / B (ms) | formula A / B (ms) | measured B/A (median) "
          f"| spread (min-max) | formula B/A{both} | error | first error | direction | page faults A / B |")
    print("|---" * (14 if BRACKET else 13) + "|")
    print("\n".join(rows))
    print(f"\nMedian absolute error {statistics.median(errors):.0%}; within 15%: "
          f"{sum(e <= 0.15 for e in errors)} of {len(errors)}"
          + (f"; hold-outs (†): {sum(e <= 0.15 for e in held)} of {len(held)} within 15%" if held else "")
          + (f"; priced with the calibration taken before the rounds alone (a prediction made before any of them "
             f"ran): {sum(e <= 0.15 for e, h in first if not h)} of {sum(not h for _, h in first)}, hold-outs "
             f"{sum(e <= 0.15 for e, h in first if h)} of {sum(h for _, h in first)}, worst of them all {max(e for e, _ in first):.0%}"
             if BRACKET else "")
          + ". Direction: up or down where every round agrees, else \"same\" (the formula's ratio inside the rounds' "
          "spread). First error: a row added later, as its first run had it (before any change made with it in view). "
          "Page faults: the minor page faults of one update (median of the rounds, the rank with the most; the allocator "
          "regime keeps them near 0)."
          "\n")
    print(f"After: {_load()}.\n")
    how = ("calibrations measured in this run either side of the model's rounds (the formula's ratio: the geometric "
           "mean of its ratio under each; *moved*: how far the machine's own figures moved it between them, which "
           "no prediction made before the rounds can know)" if BRACKET else
           "this CPU's cached calibration (the one compare prices with)")
    print(f"Formula: `batchlab estimate` of each side at 1 thread with {how}: local ranks sharing the cores, gloo's "
          "link, its tensor-parallel collectives as a chain of them pays each where measured, DTensor's host cost per "
          "op as calibrated. Error = (formula - measured) / measured. Rerun on a quiet machine: other processes' load "
          "stretches every side, the 4-rank layouts most.\n")
    return 0


def in_regime() -> None:
    """Start again in the allocator regime where this process lacks it (glibc reads it at start; the forked ranks
    inherit it)."""
    from batchlab.host import regime

    if (note := regime.restart_in_regime()) is not None:
        print(note, file=sys.stderr)


if __name__ == "__main__":
    in_regime()
    publish(main, "parallel-time-ratios", "Tensor / pipeline time ratios: predicted against measured on 4 gloo ranks")
