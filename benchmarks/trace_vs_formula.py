"""Every preset at its full depth and its own sequence length: the trace (the preset's --impl code on fake
tensors) against the formula, activations and peak.  The trace runs the code the formula's layer terms describe
(``--impl``); where that code is not installed here (torchtitan, nanoGPT) the nearest installed code is traced and
the row says so.  Fake tensors allocate nothing, so the largest presets trace on a CPU; the time is per op.

    PYTHONPATH=src python benchmarks/trace_vs_formula.py            # writes docs/accuracy/trace_vs_formula.md
    PYTHONPATH=src python benchmarks/trace_vs_formula.py --only gpt2,llama-2-7b   # prints only
"""
from __future__ import annotations

import sys
import time

from page import publish

from batchlab.config import RunConfig, preset
from batchlab.config.model import PRESETS
from batchlab.formula import estimate as formula_estimate
from batchlab.formula.activations import describe_impl, implementation
from batchlab.trace import estimate as trace_estimate
from batchlab.util.units import fmt_bytes

PRECISIONS = ("bf16-mixed", "fp32")
# cpu: the formula's terms for the kernels the trace runs (the bound); h100-sxm: its CUDA terms against the same CPU
# trace, which differ where the kernels keep other dtypes (dropout masks, eager softmax; the trace's note says so)
DEVICES = ("cpu", "h100-sxm")
BOUND = 0.05


def _only() -> list[str] | None:
    for i, a in enumerate(sys.argv):
        if a.startswith("--only"):
            value = a.split("=", 1)[1] if "=" in a else sys.argv[i + 1]
            return value.split(",")
    return None


def row(name: str, precision: str, device: str, impl: str | None = None) -> tuple[str, float]:
    spec = preset(name, impl=impl)
    cfg = RunConfig(model=spec, seq=spec.max_positions, micro_batch=1, precision=precision, device=device)
    start = time.perf_counter()
    t = trace_estimate(cfg)
    seconds = time.perf_counter() - start
    f = formula_estimate(cfg).memory
    act = (f.activations_bytes - t.memory.activations_bytes) / t.memory.activations_bytes
    peak = (f.peak_tensor_bytes - t.memory.peak_bytes) / t.memory.peak_bytes
    stand_in = "; ".join(n.split(";")[0] for n in t.notes if "runs in its place" in n)
    code = describe_impl(implementation(cfg.model_kind, spec)) + (f" ({stand_in})" if stand_in else "")
    line = (f"| {name} | {spec.impl.value} | {device} | {precision} | {cfg.seq} | {spec.layers} | {code} | "
            f"{fmt_bytes(t.memory.activations_bytes)} | {fmt_bytes(f.activations_bytes)} | {act:+.2%} | "
            f"{fmt_bytes(t.memory.peak_bytes)} | {fmt_bytes(f.peak_tensor_bytes)} | {peak:+.2%} | {seconds:.1f} |")
    print(line, flush=True)
    return name, act


def main() -> int:
    names = _only() or list(PRESETS)
    print("Micro-batch 1, each preset's own sequence length (max_positions). The trace runs CPU kernels; the formula "
          "is evaluated for the device named: `cpu` counts the kernels the trace runs, `h100-sxm` CUDA's (a 1-byte "
          "dropout mask, fp32 eager softmax under autocast), so only batchlab's own models with dropout and eager "
          "attention (tiny, small) differ there. Error = (formula - trace) / trace; the bound on activations is "
          f"{BOUND:.0%} for every preset at its own --impl on `cpu`. The last rows trace the presets' other implementations: "
          "not installed here, their nearest installed code is traced, so those rows measure how far apart the two "
          "codes are, not the formula.\n")
    print("| preset | --impl | device | precision | seq | layers | formula's layer terms (traced code) | trace activations "
          "| formula activations | error | trace peak | formula peak | error | trace s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst = []
    for device in DEVICES:
        for precision in PRECISIONS:
            for name in names:
                _, err = row(name, precision, device)
                if device == "cpu":
                    worst.append((name, err))
    for name, impl in (("llama-2-7b", "torchtitan"), ("gpt2", "nanogpt")):
        if name in names:
            row(name, "bf16-mixed", "h100-sxm", impl)
    off = [(n, e) for n, e in worst if abs(e) > BOUND]
    print(f"\n{len(worst) - len(off)} of {len(worst)} preset rows within {BOUND:.0%} on activations; worst "
          f"{max(worst, key=lambda r: abs(r[1]))[0]} {max(abs(e) for _, e in worst):.2%}.")
    return 1 if off else 0


if __name__ == "__main__":
    publish(main, "trace_vs_formula", "Trace vs formula, every preset")
