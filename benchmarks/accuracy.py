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
    .venv/bin/python benchmarks/accuracy.py --families --reference trace   # the HF family grid, formula vs trace

The family grid (--families: every family in HF_FAMILIES x fp32, bf16-mixed x AC none, full, selective x
seq 64, 200, 256, 512) compares the formula with a real run, or with --reference trace with the trace, which
equals a real run's live tensors on every family (tests/models/test_any_model.py checks it) and is ~10x faster.
Prints Markdown on stdout (progress on stderr).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import os
import statistics
import sys
import time

import torch

from batchlab.calibrate import load_all
from batchlab.config import RunConfig, preset, resolve_model
from batchlab.measure import MeasureOptions
from batchlab.run import measure as run
from batchlab.measure.harness import Trainer
from batchlab.formula import estimate as formula_estimate
from batchlab.host import cpu_hardware
from batchlab.trace import estimate as trace_estimate
from batchlab.trace.profile import with_profile
from batchlab.util.units import relative_to

# Hugging Face families through hf:CONFIG.json (2 layers, h 128, random init): the calculator's layer terms
# come from each model's own code (a layer profile, trace/profile.py), not from a table per family.
HF_SHAPE = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                max_position_embeddings=1024)
HF_FAMILIES = {
    "mistral": dict(num_key_value_heads=2, sliding_window=256, rms_norm_eps=1e-5),  # seq 512 >= window
    "qwen2": dict(num_key_value_heads=2, rms_norm_eps=1e-6),
    "gemma": dict(num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6),
    "phi3": dict(num_key_value_heads=2, rms_norm_eps=1e-5),
    "gpt_neox": dict(),
    "opt": dict(ffn_dim=256, word_embed_proj_dim=128, intermediate_size=None),
    "falcon": dict(),
    "bloom": dict(n_layer=2, n_head=4, num_hidden_layers=None, num_attention_heads=None, intermediate_size=None,
                  max_position_embeddings=None),
    "mixtral": dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5),
    # not in any list the calculator was written for: the same mechanism
    "stablelm": dict(num_key_value_heads=2),
    "granite": dict(num_key_value_heads=2, rms_norm_eps=1e-6),
    "qwen3": dict(num_key_value_heads=2, head_dim=32),
    "olmo2": dict(num_key_value_heads=2),
    # alternating sliding / global layers (P = 2): seq 256 and 512 take the explicit-mask path on half of them
    "gemma2": dict(num_key_value_heads=2, head_dim=32, sliding_window=256),
    # parallel attention and MLP, partial rotary, its own field names
    "gptj": dict(n_embd=128, n_layer=2, n_head=4, n_positions=1024, rotary_dim=16, n_inner=256, hidden_size=None,
                 num_hidden_layers=None, num_attention_heads=None, intermediate_size=None,
                 max_position_embeddings=None),
}


def hf_config_file(family: str, root: str | None = None) -> str:
    """A config.json for ``family`` at the benchmark's size (written under ``root``, default a temp dir)."""
    import json
    import tempfile

    values = {k: v for k, v in {**HF_SHAPE, **HF_FAMILIES[family]}.items() if v is not None}
    folder = os.path.join(root or tempfile.gettempdir(), f"batchlab-accuracy-{family}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(values, model_type=family), f)
    return folder


def _hf(family: str):
    source = "hf:" + hf_config_file(family)
    return resolve_model(source)[0], source


MODELS = {
    "tiny": lambda: (preset("tiny"), "builtin"),
    "small": lambda: (preset("small"), "builtin"),
    "hf gpt2": lambda: (preset("gpt2", layers=2, hidden=128, heads=4, vocab=1024, max_positions=256), "hf:gpt2"),
    "hf llama": lambda: (preset("llama-2-7b", layers=2, hidden=128, heads=4, kv_heads=2, ffn=352, vocab=1024,
                                max_positions=256), "hf:llama-2-7b"),
    **{f"hf {name}": (lambda name=name: _hf(name)) for name in HF_FAMILIES},
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def error(predicted, measured) -> float | None:
    return relative_to(predicted, measured)


def pct(e: float | None) -> str:
    return "-" if e is None else f"{e:+.1%}"


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def memory_rows(models, micro_batches, seqs, policies, precisions=("fp32",), reference="measure"):
    """Rows of errors against ``reference``: "measure" (a real run's live tensors) or "trace" (the fake-tensor
    trace, which equals the real run's live tensors on every family: the fast reference for wide grids)."""
    rows = []
    for name in models:
        spec, source = MODELS[name]()
        for mb, seq, ac, precision in itertools.product(micro_batches, seqs, policies, precisions):
                    if seq > spec.max_positions:
                        continue
                    cfg = with_profile(RunConfig(model=spec, model_source=source, micro_batch=mb, seq=seq, ac=ac,
                                                 precision=precision))
                    log(f"memory: {name} mb={mb} seq={seq} ac={ac} {precision}")
                    tr = trace_estimate(cfg)
                    if reference == "trace":
                        peak, act = tr.memory.peak_bytes, tr.memory.activations_bytes
                    else:
                        m = run(cfg, MeasureOptions(warmup=1, steps=1, memory=True, timing=False))
                        if not m.ok:
                            log(f"  measurement {m.outcome.value}: {m.outcome_detail}")
                            continue
                        peak, act = m.memory.peak_bytes, m.memory.activations_bytes
                    est = formula_estimate(cfg).memory
                    rows.append(dict(model=name, mb=mb, seq=seq, ac=ac, precision=precision, peak=peak, act=act,
                                     f_peak=error(est.peak_tensor_bytes, peak),  # tensor bytes, no margin
                                     t_peak=None if reference == "trace" else error(tr.memory.peak_bytes, peak),
                                     f_act=error(est.activations_bytes, act),
                                     t_act=None if reference == "trace" else error(tr.memory.activations_bytes, act)))
                    log("  row: " + row_text(rows[-1]))
    return rows


def row_text(r) -> str:
    return (f"| {r['model']} | {r['precision']} | {r['mb']} | {r['seq']} | {r['ac']} | {mib(r['peak'])} | "
            f"{pct(r['f_peak'])} | {pct(r['t_peak'])} | {mib(r['act'])} | {pct(r['f_act'])} | {pct(r['t_act'])} |")


def print_memory(rows, reference="measure") -> None:
    ref = "measured" if reference == "measure" else "traced"
    print(f"| model | precision | micro-batch | seq | AC | {ref} peak MiB | formula | trace | {ref} activations MiB "
          "| formula | trace |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(row_text(r))
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
    print_worst(rows)


def print_worst(rows) -> None:
    """Per model, the row with the largest formula |error| on peak and on activations."""
    print("| model | rows | worst formula peak | at | worst formula activations | at |")
    print("|---|---:|---:|---|---:|---|")
    at = lambda r: f"{r['precision']}, seq {r['seq']}, AC {r['ac']}"  # noqa: E731
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        p = max(mine, key=lambda r: abs(r["f_peak"] or 0))
        a = max(mine, key=lambda r: abs(r["f_act"] or 0))
        print(f"| {name} | {len(mine)} | {pct(p['f_peak'])} | {at(p)} | {pct(a['f_act'])} | {at(a)} |")
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
    p.add_argument("--families", action="store_true",
                   help="the Hugging Face family grid: fp32 and bf16-mixed, AC none/full/selective, seq 64-512")
    p.add_argument("--reference", choices=("measure", "trace"), default="measure",
                   help="what the formula is compared with: a real run, or the trace (equal to it, much faster)")
    p.add_argument("--only", default="", help="comma-separated model names (e.g. 'hf bloom,hf opt')")
    p.add_argument("--seqs", default="", help="comma-separated sequence lengths instead of the grid's")
    args = p.parse_args(argv)
    start = time.perf_counter()
    pairs = 4 if args.quick else args.pairs
    if args.families:
        # 64, 256 and 512 are among the lengths a profile traces (most families); 200 lies between two (interpolated)
        grid = ([f"hf {n}" for n in HF_FAMILIES], [2], [64, 200, 256, 512], ["none", "full", "selective"],
                ["fp32", "bf16-mixed"])
    elif args.quick:
        grid = (["tiny", "hf llama"], [2], [64], ["none", "full"])
    else:
        grid = (list(MODELS), [1, 4], [64, 128], ["none", "full", "selective"])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"Accuracy on {cpu_hardware()} ({torch.get_num_threads()} threads, load average {load:.1f} at start), "
          f"torch {torch.__version__}, {datetime.date.today().isoformat()}; AdamW, accum 1. "
          + ("error = (predicted - measured) / measured; measured = live tensor-storage tracker (allocator)."
             if args.reference == "measure" else
             "error = (formula - trace) / trace; the trace equals a real run's live tensors (checked by tests)."))
    print()
    if args.only:
        grid = ([n.strip() for n in args.only.split(",")], *grid[1:])
    if args.seqs:
        grid = (grid[0], grid[1], [int(v) for v in args.seqs.split(",")], *grid[3:])
    if args.part in ("all", "memory"):
        print_memory(memory_rows(*grid, reference=args.reference), args.reference)
    if args.part in ("all", "time") and not args.families:
        print_time(time_rows(pairs), pairs)
    log(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    import page  # benchmarks/page.py: this script's page of the docs

    page.publish(main, page.variant("accuracy", {"--families": "families", "--reference=": "", "--part=": ""}), "Memory accuracy: formula and trace against real steps")
