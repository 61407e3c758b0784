"""Compiled runs (``--compile blocks``, inductor, CPU): the formula's compiled terms and the compiled trace against
measured peaks, for the built-in GPT, two Hugging Face families and a factory, AC none / full / selective-op, and
torch.compile's activation_memory_budget (--ac budget:F) on the built-in GPT and GPT-2.

The measured figures are slow (an inductor compile per config, 30-60 s here) and are kept in
benchmarks/compiled_measured.json; ``--measure`` (re)measures them, otherwise the page is written from that file.
The trace's figures (an inductor compile without kernels per config) are kept alike in
benchmarks/compiled_traced.json; ``--trace`` retraces them (rerun it where the trace's code changed).
No shape here is the shape the compiled terms are derived at (formula/compiled.py: prime-valued dimensions).

    PYTHONPATH=src .venv/bin/python benchmarks/compiled_accuracy.py --measure   # ~15 min on 2 idle cores
    PYTHONPATH=src .venv/bin/python benchmarks/compiled_accuracy.py --trace     # the page, the trace's figures retraced
    PYTHONPATH=src .venv/bin/python benchmarks/compiled_accuracy.py             # the page from the kept figures (seconds)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "configs"))  # the factory module
MEASURED = HERE / "compiled_measured.json"
TRACED = HERE / "compiled_traced.json"
PAGE = HERE.parent / "docs" / "accuracy" / "compiled.md"

MODELS = {  # name -> (preset, overrides, source)
    "GPT tiny, 2 layers": ("tiny", dict(layers=2), "builtin"),
    "hf:gpt2, 2 layers, h 128": ("gpt2", dict(layers=2, hidden=128, heads=4, vocab=1024, max_positions=256), "hf:gpt2"),
    "hf:llama, 2 layers, h 128, GQA": ("llama-2-7b", dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn=352, vocab=1024,
                                                          max_positions=256), "hf:llama-2-7b"),
    "factory (GPT), 3 layers, h 96": ("tiny", dict(layers=3, hidden=96, heads=3, vocab=384), "compiled_factory:gpt"),
}
# table entries the grid above does not reach (SDPA, GQA, bf16 autocast), each at one more shape
OTHERS = {
    "GPT, 2 layers, h 160, SDPA, GQA": ("tiny", dict(layers=2, hidden=160, heads=4, kv_heads=2, vocab=512,
                                                     attention="sdpa", dropout=0.0), "builtin", (112, 3), "fp32"),
    "hf:gpt2, 2 layers, h 96, bf16 autocast": ("gpt2", dict(layers=2, hidden=96, heads=3, vocab=512, max_positions=256),
                                               "hf:gpt2", (72, 5), "bf16-mixed"),
}
# models and shapes no row above has, added with the trace built on inductor's own plan (trace/inductor_plan.py)
# and measured before it was first run on them
UNLISTED = {
    "GPT, 3 layers, h 192, 6 heads": ("tiny", dict(layers=3, hidden=192, heads=6, vocab=640), "builtin", (96, 3),
                                      "fp32"),
    "hf:gpt2, 3 layers, h 64": ("gpt2", dict(layers=3, hidden=64, heads=2, vocab=768, max_positions=256), "hf:gpt2",
                                (112, 2), "fp32"),
}
SHAPES = {"GPT tiny, 2 layers": (128, 4), "hf:gpt2, 2 layers, h 128": (128, 4),
          "hf:llama, 2 layers, h 128, GQA": (96, 4), "factory (GPT), 3 layers, h 96": (80, 6)}
POLICIES = ("none", "full", "selective-op")
WHOLE_MODEL = (("GPT tiny, 2 layers", "none"), ("GPT tiny, 2 layers", "full"))  # also measured with --compile model
# torch.compile's activation_memory_budget (--ac budget:F): no checkpoint region, the partitioner's knapsack recomputes
BUDGETS = ("budget:0", "budget:0.3", "budget:0.6", "budget:1")
BUDGET_MODELS = ("GPT tiny, 2 layers", "hf:gpt2, 2 layers, h 128")
# --compile model on configs no measured row has, against the trace (exact on every measured row): its figures and
# the formula's first error on each row kept in benchmarks/compiled_model_traced.json; † rows are hold-outs
MODEL_TRACED = HERE / "compiled_model_traced.json"
WHOLE_UNLISTED = {  # "name | ac" -> (preset, overrides, source, seq, micro-batch, precision)
    "GPT, 2 layers, h 80, 2 heads, V 520": ("tiny", dict(layers=2, hidden=80, heads=2, vocab=520), "builtin", 56, 3, "fp32"),
    "hf:gpt2, 2 layers, h 128": ("gpt2", dict(layers=2, hidden=128, heads=4, vocab=1024, max_positions=256), "hf:gpt2",
                                 128, 4, "fp32"),
    "hf:llama, 2 layers, h 128, GQA": ("llama-2-7b", dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn=352, vocab=1024,
                                                          max_positions=256), "hf:llama-2-7b", 96, 4, "fp32"),
    "hf:gpt2, 2 layers, h 96, bf16 autocast": ("gpt2", dict(layers=2, hidden=96, heads=3, vocab=512, max_positions=256),
                                               "hf:gpt2", 72, 5, "bf16-mixed"),
    "GPT, 3 layers, h 192, 6 heads": ("tiny", dict(layers=3, hidden=192, heads=6, vocab=640), "builtin", 96, 3, "fp32"),
    "hf:gpt2, 3 layers, h 64": ("gpt2", dict(layers=3, hidden=64, heads=2, vocab=768, max_positions=256), "hf:gpt2",
                                112, 2, "fp32"),
    # added with the whole-model working set (trace/compiled_model_working.py), traced before it was written
    "GPT, 3 layers, h 96, 3 heads, V 600": ("tiny", dict(layers=3, hidden=96, heads=3, vocab=600), "builtin", 64, 2,
                                            "fp32"),
    "GPT, 4 layers, h 64, 2 heads, no dropout": ("tiny", dict(layers=4, hidden=64, heads=2, vocab=448, dropout=0.0),
                                                 "builtin", 80, 2, "fp32"),
    "GPT, 2 layers, h 112, GQA 4/2, SDPA, no dropout": ("tiny", dict(layers=2, hidden=112, heads=4, kv_heads=2, vocab=500,
                                                                     attention="sdpa", dropout=0.0), "builtin", 72, 3,
                                                        "fp32"),
    "hf:gpt2, 3 layers, h 96": ("gpt2", dict(layers=3, hidden=96, heads=3, vocab=640, max_positions=256), "hf:gpt2",
                                96, 3, "fp32"),
    "hf:gpt2, 2 layers, h 64": ("gpt2", dict(layers=2, hidden=64, heads=2, vocab=700, max_positions=256), "hf:gpt2",
                                160, 2, "fp32"),
    "hf:llama, 3 layers, h 96, GQA": ("llama-2-7b", dict(layers=3, hidden=96, heads=4, kv_heads=2, ffn=256, vocab=900,
                                                         max_positions=256), "hf:llama-2-7b", 64, 3, "fp32"),
    "GPT, 3 layers, h 128, 4 heads": ("tiny", dict(layers=3, hidden=128, heads=4, vocab=512), "builtin", 64, 4, "fp32"),
    "GPT, 2 layers, h 96, untied head": ("tiny", dict(layers=2, hidden=96, heads=3, vocab=540, tied_embeddings=False),
                                         "builtin", 64, 3, "fp32"),
    "hf:gpt2, 4 layers, h 64": ("gpt2", dict(layers=4, hidden=64, heads=2, vocab=512, max_positions=256), "hf:gpt2",
                                80, 2, "fp32"),
    # added with the several-graph derivation (transformers' GPT-2 read as its model and loss graphs), traced and
    # their first error recorded before any GPT-2 entry was derived; every third a hold-out, marked before
    "hf:gpt2, 2 layers, h 96, V 900": ("gpt2", dict(layers=2, hidden=96, heads=3, vocab=900, max_positions=256),
                                       "hf:gpt2", 64, 3, "fp32"),
    "hf:gpt2, 3 layers, h 128, V 600": ("gpt2", dict(layers=3, hidden=128, heads=4, vocab=600, max_positions=256),
                                        "hf:gpt2", 96, 2, "fp32"),
    "hf:gpt2, 4 layers, h 64, V 1000": ("gpt2", dict(layers=4, hidden=64, heads=2, vocab=1000, max_positions=256),
                                        "hf:gpt2", 128, 2, "fp32"),
    # four-layer models read the deeper models' stretches (formula/compiled.py OWN_LAYERS), decided on the first row
    # below (a shape no earlier row has) after both four-layer GPT-2 hold-outs above had been seen: the rows after
    # it are new hold-outs, marked before they were traced
    "hf:gpt2, 4 layers, h 80, V 1000": ("gpt2", dict(layers=4, hidden=80, heads=4, vocab=1000, max_positions=128,
                                                     dropout=0.0), "hf:gpt2", 72, 2, "fp32"),
    "hf:gpt2, 4 layers, h 96, V 800": ("gpt2", dict(layers=4, hidden=96, heads=3, vocab=800, max_positions=256),
                                       "hf:gpt2", 96, 2, "fp32"),
    "hf:gpt2, 5 layers, h 64, V 640": ("gpt2", dict(layers=5, hidden=64, heads=2, vocab=640, max_positions=256),
                                       "hf:gpt2", 64, 3, "fp32"),
    "GPT, 4 layers, h 96, 3 heads": ("tiny", dict(layers=4, hidden=96, heads=3, vocab=576), "builtin", 64, 2, "fp32"),
}


def config(name: str, ac: str, mode: str = "blocks"):
    from batchlab.config import RunConfig, preset

    if name in OTHERS or name in UNLISTED:
        base, over, source, (seq, mb), precision = {**OTHERS, **UNLISTED}[name]
    else:
        (base, over, source), (seq, mb), precision = MODELS[name], SHAPES[name], "fp32"
    return RunConfig(model=preset(base, **over), model_source=source, seq=seq, micro_batch=mb, ac=ac, compile=mode,
                     precision=precision)


def key(name: str, ac: str, mode: str = "blocks") -> str:
    return f"{name} | {ac}" + ("" if mode == "blocks" else f" | {mode}")


def grid():
    """(model, AC, compile mode) of every row."""
    return ([(n, ac, "blocks") for n in MODELS for ac in POLICIES] + [(n, ac, "model") for n, ac in WHOLE_MODEL]
            + [(n, ac, "blocks") for n in OTHERS for ac in ("none", "selective-op")]
            + [(n, ac, "blocks") for n in UNLISTED for ac in ("full", "selective-op")]
            + [(n, ac, "blocks") for n in BUDGET_MODELS for ac in BUDGETS] + [(BUDGET_MODELS[0], BUDGETS[1], "model")])


def measure_all() -> None:
    import torch

    from batchlab.measure import MeasureOptions
    from batchlab.run import measure

    kept = json.loads(MEASURED.read_text()) if MEASURED.exists() else {}
    for name, ac, mode in grid():
        if key(name, ac, mode) in kept:
            continue
        torch._dynamo.reset()
        print(f"measuring {name}, ac {ac}, compile {mode} (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
        m = measure(config(name, ac, mode), MeasureOptions(warmup=2, steps=1, memory=True, timing=False))
        if not m.ok:
            print(f"  {m.outcome.value}: {m.outcome_detail}", file=sys.stderr)
            continue
        kept[key(name, ac, mode)] = dict(peak=m.memory.peak_bytes, activations=m.memory.activations_bytes,
                                         phase=m.memory.peak_phase.value)
        MEASURED.write_text(json.dumps(kept, indent=1))
        print(f"  peak {m.memory.peak_bytes:,} ({m.memory.peak_phase.value})", file=sys.stderr, flush=True)


def rows(trace: bool):
    from batchlab.formula import compiled, estimate as formula_estimate
    from batchlab.trace.profile import with_profile

    kept = json.loads(MEASURED.read_text())
    traces = json.loads(TRACED.read_text()) if TRACED.exists() else {}
    out = []
    for name, ac, mode in grid():
        m = kept.get(key(name, ac, mode))
        if m is None:
            continue
        cfg = with_profile(config(name, ac, mode))
        est = formula_estimate(cfg).memory
        row = dict(name=name, ac=ac, mode=mode, shape=(cfg.seq, cfg.micro_batch), measured=m["peak"], phase=m.get("phase", "-"),
                   terms="compiled" if compiled.applies(cfg) else
                   "eager: " + compiled.missing_note(cfg).split(": ", 1)[1].split("; estimate")[0],
                   formula=est.peak_tensor_bytes, formula_phase=est.peak_phase)
        if trace:
            from batchlab.trace import estimate as trace_estimate

            row["trace"] = traces[key(name, ac, mode)] = trace_estimate(cfg).memory.peak_bytes
            TRACED.write_text(json.dumps(traces, indent=1))
            print(f"  {key(name, ac, mode)}: trace {row['trace']:,}, measured {m['peak']:,} "
                  f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
        elif key(name, ac, mode) in traces:
            row["trace"] = traces[key(name, ac, mode)]
        out.append(row)
    return out


def err(p, m) -> float:
    return (p - m) / m


def page(rs, retraced: bool) -> str:
    lines = ["# Compiled runs: formula and trace against measured peaks", "",
             f"Generated by `benchmarks/compiled_accuracy.py` on {datetime.date.today()} (CPU, fp32 unless named, "
             "torch.compile per block with inductor unless `--compile model`; measured: the allocator's events, "
             "docs/how-to/compile.md). The formula's compiled terms are derived from AOTAutograd's partition at prime-valued dimensions (formula/compiled.py), "
             "and each block's backward high points from inductor's plan of that block (trace/compiled_working.py); none of these shapes is that one. "
             + ("The trace column was traced in this run." if retraced else
                "The trace column is kept from benchmarks/compiled_traced.json, not traced in this run "
                "(`--trace` retraces it: rerun it where the trace's code changed)."), "",
             "| model | seq x micro-batch | AC | --compile | measured peak | phase | formula's layer terms | formula | error "
             "| trace | error |", "|---|---|---|---|---:|---|---|---:|---:|---:|---:|"]
    for r in rs:
        t = r.get("trace")
        lines.append(f"| {r['name']} | {r['shape'][0]} x {r['shape'][1]} | {r['ac']} | {r['mode']} | {r['measured']:,} | "
                     f"{r['phase']} | "
                     f"{r['terms']} | "
                     f"{r['formula']:,} | {err(r['formula'], r['measured']):+.1%} | "
                     + (f"{t:,} | {err(t, r['measured']):+.1%} |" if t is not None else "- | - |"))
    policies = [r for r in rs if not r["ac"].startswith("budget:")]
    errs = [abs(err(r["formula"], r["measured"])) for r in policies]
    traced = [(r, abs(err(r["trace"], r["measured"]))) for r in rs if r.get("trace") is not None]
    if traced:
        unlisted = [e for r, e in traced if r["name"] in UNLISTED]
        lines += ["", f"Trace: mean |error| {sum(e for _, e in traced) / len(traced):.2%}, max "
                  f"{max(e for _, e in traced):.2%} over {len(traced)} configs; on the {len(unlisted)} configs of "
                  f"models and shapes measured before the trace first ran on them ({'; '.join(UNLISTED)}): max "
                  f"{max(unlisted, default=0):.2%}. The trace compiles with inductor itself and runs its generated "
                  "wrapper on fake tensors with no kernel built (trace/inductor_plan.py): the buffers it allocates, "
                  "reuses and frees are what the allocator sees. Where it is not byte-exact: a block that runs eagerly "
                  "(Llama's graph break) keeps the CPU generator's state for its recompute (5,056 B per block), which "
                  "the eager trace does not count."]
    if errs:
        lines += ["", f"Formula: mean |error| {sum(errs) / len(errs):.1%}, max {max(errs):.1%} over {len(errs)} configs "
                  "with a checkpointing policy or none.",
                  "", "transformers' Llama does not compile under activation checkpointing here (a graph break: the "
                  "checkpoint's forward mutates a context variable), so its checkpointed blocks run eagerly, and the "
                  "formula uses its eager terms (the derivation finds no partition for them)."]
    budget = [r for r in rs if r["ac"].startswith("budget:")]
    if budget:
        traced = [err(r["trace"], r["measured"]) for r in budget if r.get("trace") is not None]
        lines += ["", "`budget:F` rows: torch.compile's `activation_memory_budget` (docs/how-to/compile.md). The "
                  "formula is the knob's line, each block's input plus F of the rest of its default partition's "
                  "saved bytes, which the partitioner's knapsack keeps within (it picks the tensors by FLOPs): a "
                  "bound on the saved bytes, not a prediction of the peak"
                  + (f". Trace: {min(traced):+.1%} to {max(traced):+.1%} over {len(traced)} rows: what the forward "
                     "saves is the solver's own choice, and inductor's plan fuses what the backward recomputes as it "
                     "fuses a checkpoint's." if traced else ".")]
    return "\n".join(lines) + "\n"


def whole_model_unlisted() -> list[str]:
    """The formula against the stored trace on --compile model configs no measured row has."""
    from batchlab.config import RunConfig, preset
    from batchlab.formula import estimate as formula_estimate

    if not MODEL_TRACED.exists():
        return []
    lines = ["", "`--compile model` on configs no measured row has, formula against the trace (exact on every measured "
             "row above; † a hold-out, never looked at before the formula was changed; first: the formula's error when "
             "the row was first traced):", "", "| model | seq x micro-batch | AC | trace | formula | error | first |",
             "|---|---|---|---:|---:|---:|---:|"]
    errs = []
    for row, kept in json.loads(MODEL_TRACED.read_text()).items():
        name, ac = (p.strip(" †") for p in row.split(" | "))
        base, over, source, seq, mb, precision = WHOLE_UNLISTED[name]
        cfg = RunConfig(model=preset(base, **over), model_source=source, seq=seq, micro_batch=mb, ac=ac,
                        compile="model", precision=precision)
        f = formula_estimate(cfg).memory.peak_tensor_bytes
        errs.append(err(f, kept["trace"]))
        lines.append(f"| {name}{' †' if '†' in row else ''} | {seq} x {mb} | {ac} | {kept['trace']:,} | {f:,} | "
                     f"{errs[-1]:+.1%} | {kept['first_error']:+.1%} |")
    lines += ["", f"Formula against the trace: mean |error| {sum(map(abs, errs)) / len(errs):.1%}, max "
              f"{max(map(abs, errs)):.1%} over {len(errs)} configs. A whole-model graph holds its loss (batchlab's GPT and "
              "transformers' models compute it in forward): partitioned as a compiled loss, and the tied LM head's "
              "weight gradient made at the graph's end, its inputs (the logits' gradient, the final norm's output) "
              "held through the blocks' backward (formula/compiled.py). Where a whole-model entry is derived "
              "(formula/compiled_model_working_table.py; entries: " + ", ".join(_whole_entries()) + "), each layer's "
              "stretch of the one backward graph is read off inductor's plan of a whole model, which holds what no "
              "block's plan has (the next block's recompute started early, the embedding's and causal masks, the "
              "head's tensors), in each topological order inductor's reordering for peak memory chooses among, and "
              "the formula takes the order inductor keeps at the row's shape (trace/compiled_model_working.py). "
              "transformers' GPT-2 compiles into two graphs, the model's and the loss's: their backward graphs are "
              "read in turn, the model graph's saved tensors held through the loss graph's backward. Where inductor's "
              "schedule moved with the number of KV heads the entry keeps both schedules' high points (a bound, "
              "marked so; a row is priced as a bound only where inductor keeps such an order at its shape). Elsewhere each block's own plan: grouped-query attention (its fused q, k, v width is not "
              "derived here), entries not derived. Seen before a change: the two four-layer GPT-2 hold-outs (h 64, "
              "and h 64 V 1000) had been read when four-layer models were moved to the deeper models' stretches, "
              "which was decided on the h 80 rows (a shape no row had); the three hold-outs after those rows were "
              "marked before they were traced."]
    return lines


def _whole_entries() -> list[str]:
    try:
        from batchlab.formula import compiled_model_working_table as table
    except ImportError:
        return ["none"]
    return [k.replace("|", " ") + (" (an order kept as a bound)" if "bound" in v else "") for k, v in table.HIGHS.items()
            if isinstance(v, dict)] or ["none"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--trace", action="store_true", help="add the compiled trace's column (slow: an inductor compile "
                    "without kernels per row)")
    a = ap.parse_args()
    if a.measure:
        measure_all()
    text = page(rows(a.trace), a.trace) + "\n".join(whole_model_unlisted()) + "\n"
    PAGE.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
