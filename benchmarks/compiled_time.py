"""Compiled against eager update time on CPU (``--compile blocks``, inductor): the measured ratio beside the one the
time model predicts (formula, and the trace where asked), for the built-in GPT, hf:gpt2 and a factory model, AC none
and full, two shapes each.

Measured in one process per case, both trainers built side by side and their updates interleaved A B A B (compile
and warm-up excluded): each round's B/A ratio is paired, so the load other processes put on the host moves both
sides alike.  Only ratios are reported.  The measured figures are slow (an inductor compile per case) and are kept in
benchmarks/compiled_time_measured.json; ``--measure`` (re)measures the cases missing there.

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compiled_time.py --measure   # ~10 min on 2 cores
    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compiled_time.py --trace     # the page, with the trace
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "configs"))  # the factory module
MEASURED = HERE / "compiled_time_measured.json"

MODELS = {  # name -> (preset, overrides, source)
    "GPT tiny, 2 layers": ("tiny", dict(layers=2), "builtin"),
    "GPT tiny, 2 layers, no dropout": ("tiny", dict(layers=2, dropout=0.0), "builtin"),
    "hf:gpt2, 2 layers, h 128": ("gpt2", dict(layers=2, hidden=128, heads=4, vocab=1024, max_positions=256), "hf:gpt2"),
    "factory (GPT), 3 layers, h 96": ("tiny", dict(layers=3, hidden=96, heads=3, vocab=384), "compiled_factory:gpt"),
    "hf:gpt2, 2 layers, h 128, dropout": ("gpt2", dict(layers=2, hidden=128, heads=4, vocab=1024, max_positions=256,
                                                       dropout=0.1), "hf:gpt2"),
    "hf:llama, 2 layers, h 128": ("llama-2-7b", dict(layers=2, hidden=128, heads=4, ffn=352, vocab=1024,
                                                     max_positions=256), "hf:llama"),
}
# the grid's four models at both shapes and policies, then cases added later (another shape or model): each with
# its first predicted error recorded before any change that followed (FIRST), every third a hold-out (never tuned on)
EXTRA = (("hf:gpt2, 2 layers, h 128, dropout", "none", (64, 2)), ("hf:gpt2, 2 layers, h 128, dropout", "none", (128, 4)),
         ("hf:llama, 2 layers, h 128", "none", (64, 2)), ("GPT tiny, 2 layers", "none", (256, 2)),
         ("hf:gpt2, 2 layers, h 128, dropout", "full", (64, 2)), ("hf:llama, 2 layers, h 128", "full", (128, 4)))
HOLD_OUT = frozenset(EXTRA[2::3])
FIRST = HERE / "compiled_time_first.json"  # the added cases' first predictions and errors
SHAPES = ((64, 2), (128, 8))  # (seq, micro-batch): a dispatch-bound one and a larger one
POLICIES = ("none", "full")
ROUNDS, WARMUP = 8, 3


def config(name: str, ac: str, shape: tuple[int, int], mode: str):
    from batchlab.config import RunConfig, preset

    base, over, source = MODELS[name]
    return RunConfig(model=preset(base, **over), model_source=source, seq=shape[0], micro_batch=shape[1], accum=1,
                     ac=ac, compile=mode)


def key(name: str, ac: str, shape: tuple[int, int]) -> str:
    return f"{name} | {ac} | {shape[0]} x {shape[1]}"


GRID_MODELS = tuple(MODELS)[:4]


def grid():
    return [(n, ac, s) for n in GRID_MODELS for ac in POLICIES for s in SHAPES] + list(EXTRA)


def _timed(trainer) -> float:
    t0 = time.perf_counter()
    trainer.update()
    return time.perf_counter() - t0


def measure_case(name: str, ac: str, shape: tuple[int, int]) -> dict:
    """Eager (A) and compiled (B) trainers in this process, updates interleaved; per-round B/A ratios."""
    from batchlab.measure.harness import Trainer

    eager = Trainer(config(name, ac, shape, "none"), "cpu")
    compiled = Trainer(config(name, ac, shape, "blocks"), "cpu")  # resets dynamo: one compiled model at a time
    t0 = time.perf_counter()
    for _ in range(WARMUP):
        compiled.update()
    compile_s = time.perf_counter() - t0
    for _ in range(WARMUP):
        eager.update()
    ratios, a_s, b_s = [], [], []
    for i in range(ROUNDS):  # A B, then B A: neither side always runs first
        if i % 2 == 0:
            a, b = _timed(eager), _timed(compiled)
        else:
            b, a = _timed(compiled), _timed(eager)
        ratios.append(b / a)
        a_s.append(a)
        b_s.append(b)
    return dict(ratio=statistics.median(ratios), low=min(ratios), high=max(ratios), rounds=ROUNDS,
                load=os.getloadavg()[0], threads=__import__("torch").get_num_threads(), warmup_compile_s=compile_s)


def measure_all() -> None:
    kept = json.loads(MEASURED.read_text()) if MEASURED.exists() else {}
    for name, ac, shape in grid():
        k = key(name, ac, shape)
        if k in kept:
            continue
        print(f"measuring {k} (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
        kept[k] = measure_case(name, ac, shape)
        MEASURED.write_text(json.dumps(kept, indent=1))
        print(f"  compiled/eager {kept[k]['ratio']:.3f} ({kept[k]['low']:.3f}-{kept[k]['high']:.3f})",
              file=sys.stderr, flush=True)


def record_first() -> None:
    """The added cases' predictions by today's code, kept as their first (before any change made after them)."""
    first = json.loads(FIRST.read_text()) if FIRST.exists() else {}
    for name, ac, shape in EXTRA:
        k = key(name, ac, shape)
        if k not in first:
            first[k] = dict(predicted(name, ac, shape, trace=True), hold_out=(name, ac, shape) in HOLD_OUT)
            FIRST.write_text(json.dumps(first, indent=1))


def predicted(name: str, ac: str, shape: tuple[int, int], trace: bool) -> dict:
    from batchlab.cache.calibrations import load_all
    from batchlab.formula import estimate, unseen_model

    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    cals = load_all(threads)
    a, b = config(name, ac, shape, "none"), config(name, ac, shape, "blocks")
    out = {}
    if not unseen_model(a):
        out["formula"] = estimate(b, cals).time.update_seconds / estimate(a, cals).time.update_seconds
    if trace:
        from batchlab.trace import estimate as traced

        out["trace"] = traced(b, calibrations=cals).time.seconds / traced(a, calibrations=cals).time.seconds
    return out


def page(trace: bool) -> str:
    kept = json.loads(MEASURED.read_text())
    lines = ["Compiled (`--compile blocks`, inductor) over eager update time on this CPU: measured in one process per "
             f"case, the two trainers' updates interleaved A B A B ({ROUNDS} rounds after {WARMUP} warm-up updates "
             "each, the compile excluded), the median of the per-round paired ratios and their range; beside it the "
             "ratio the time model predicts (formula: the op list with pointwise chains fused, formula/fusion.py"
             + ("; trace: each kernel inductor's generated wrapper calls, one launch moving its buffers once, "
                "trace/inductor_plan.py: the per-element arithmetic of the ops a kernel fuses (softmax, dropout's RNG, "
                "activations) is not priced there" if trace else "") + "). Ratios only: "
             "the host is shared, absolute times are no goal. fp32, one optimizer update of one micro-batch. The "
             "time model prices inductor's kernels at eager PyTorch's calibrated rates (per-element rates, the "
             "bandwidth curve, a no-grad call's dispatch per kernel); a compiled graph's own call (guards, "
             "AOTAutograd's wrapper) and the random numbers inductor generates inside its kernels for dropout (not "
             "ATen's bernoulli_) are not modelled.", "",
             "| model | dropout | seq x micro-batch | AC | measured compiled/eager (range) | load | formula | error |"
             + (" trace | error |" if trace else ""),
             "|---|---:|---|---|---:|---:|---:|---:|" + ("---:|---:|" if trace else "")]
    errs: dict[str, list[float]] = {"formula": [], "trace": []}
    right: dict[str, list[bool]] = {"formula": [], "trace": []}
    for name, ac, shape in grid():
        m = kept.get(key(name, ac, shape))
        if m is None:
            continue
        p = predicted(name, ac, shape, trace)
        cells = []
        for src in ("formula", "trace") if trace else ("formula",):
            v = p.get(src)
            if v is None:
                cells.append("- | - |")
                continue
            e = (v - m["ratio"]) / m["ratio"]
            errs[src].append(abs(e))
            if not m["low"] <= 1.0 <= m["high"]:  # a direction the measurement settles
                right[src].append((v < 1.0) == (m["ratio"] < 1.0))
            cells.append(f"{v:.3f} | {e:+.1%} |")
        lines.append(f"| {name} | {config(name, ac, shape, 'none').model.dropout:g} | {shape[0]} x {shape[1]} | {ac} | {m['ratio']:.3f} ({m['low']:.3f}-{m['high']:.3f}) "
                     f"| {m['load']:.1f} | " + " ".join(cells))
    lines += ["", "Without AC the built-in GPT and the factory (its code) measure slower compiled than predicted. A "
              "profile with inductor's kernel profiling (`torch._inductor.config.cpp.enable_kernel_profile`, one run "
              "on the loaded host) put most of their compiled blocks' own kernel time in the kernels that fuse the "
              "attention scores' scale, causal mask, softmax and dropout, which the rule prices at ATen's `_softmax` "
              "and `bernoulli_` rates per element; inductor draws dropout's random numbers element by element in a "
              "scalar loop (its generated C++), ATen's `bernoulli_` in bulk. With full AC the compiled "
              "blocks measure faster than predicted (the compiled backward runs the recompute inside its own graph); "
              "where the saving beyond the fused chains comes from is not identified yet.", ""]
    for src, e in errs.items():
        if e:
            lines.append(f"- {src}: mean |error| of the ratio {statistics.fmean(e):.1%}, max {max(e):.1%} over {len(e)} "
                         f"cases; direction right in {sum(right[src])} of {len(right[src])} cases whose range excludes 1")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measure", action="store_true", help="measure the cases missing from the kept figures")
    p.add_argument("--trace", action="store_true", help="also the trace's predicted ratio (a few seconds per case)")
    p.add_argument("--first", action="store_true", help="keep the added cases' predictions not kept yet as their first")
    args = p.parse_args(argv)
    if args.first:
        record_first()
    if args.measure:
        measure_all()
    print(page(args.trace))
    return 0


if __name__ == "__main__":
    import page as page_module  # benchmarks/page.py

    page_module.publish(main, "compiled-time", "Compiled update time against eager on CPU")
