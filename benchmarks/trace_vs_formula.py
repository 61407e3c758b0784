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
# cpu: the CPU kernels' terms; h100-sxm: CUDA's terms against a trace that takes CUDA's kernel choices on this
# CPU-only machine (trace/cuda_policy.py: CUDA's autocast lists, the fused dropout, fused attention with dropout)
DEVICES = ("cpu", "h100-sxm")
BOUND = 0.05
# configurations the preset grid does not cover (another card, fp16, other sequence lengths and micro-batches,
# recompute, SDPA with dropout, transformers' eager attention): (preset, layers, seq, micro-batch, changes)
OTHERS = (
    ("tiny", None, 128, 4, dict(device="a100-80gb", precision="fp16-mixed")),
    ("tiny", None, 64, 8, dict(device="h100-sxm", precision="bf16-mixed")),
    ("tiny", None, 256, 1, dict(device="h100-sxm", precision="bf16-mixed", ac="selective")),
    ("tiny", None, 256, 1, dict(device="h100-sxm", precision="bf16-mixed", ac="full")),
    ("tiny", None, 256, 1, dict(device="h100-sxm", precision="bf16-mixed", attention="sdpa")),
    ("tiny", None, 256, 1, dict(device="h100-sxm", precision="bf16")),
    ("small", None, 512, 2, dict(device="a100-80gb", precision="bf16-mixed", ac="selective")),
    ("gpt2", 2, 1024, 1, dict(device="h100-sxm", precision="bf16-mixed", attention="eager")),
    ("gpt2", 2, 1024, 1, dict(device="h100-sxm", precision="bf16-mixed", attention="eager", dropout=0.1)),
    ("gpt2", 2, 1024, 1, dict(device="h100-sxm", precision="bf16-mixed", dropout=0.1)),
    ("llama-2-7b", 2, 2048, 1, dict(device="h100-sxm", precision="bf16-mixed", attention="eager")),
)


def _only() -> list[str] | None:
    for i, a in enumerate(sys.argv):
        if a.startswith("--only"):
            value = a.split("=", 1)[1] if "=" in a else sys.argv[i + 1]
            return value.split(",")
    return None


def row(name: str, precision: str, device: str, impl: str | None = None) -> tuple[str, float]:
    spec = preset(name, impl=impl)
    cfg = RunConfig(model=spec, seq=spec.max_positions, micro_batch=1, precision=precision, device=device)
    return _row(cfg, name)


def other_row(name: str, layers: int | None, seq: int, micro_batch: int, changes: dict) -> tuple[str, float]:
    spec = preset(name, **({"layers": layers} if layers else {}))
    run = {k: v for k, v in changes.items() if k in ("device", "precision", "ac")}
    cfg = RunConfig(model=spec, seq=seq, micro_batch=micro_batch, **run)
    model = {k: v for k, v in changes.items() if k not in run}
    cfg = cfg.replace(**model) if model else cfg
    what = ", ".join(f"{k} {v}" for k, v in changes.items() if k not in ("device", "precision"))
    label = name + (f" ({layers} layers)" if layers else "")
    return _row(cfg, label, micro=f"b {micro_batch}" + (f", {what}" if what else ""))


def _row(cfg: RunConfig, name: str, micro: str | None = None) -> tuple[str, float]:
    spec, device, precision = cfg.model, cfg.device, cfg.precision.value
    start = time.perf_counter()
    t = trace_estimate(cfg)
    seconds = time.perf_counter() - start
    f = formula_estimate(cfg).memory
    act = (f.activations_bytes - t.memory.activations_bytes) / t.memory.activations_bytes
    peak = (f.peak_tensor_bytes - t.memory.peak_bytes) / t.memory.peak_bytes
    stand_in = "; ".join(n.split(";")[0] for n in t.notes if "runs in its place" in n)
    code = describe_impl(implementation(cfg.model_kind, spec)) + (f" ({stand_in})" if stand_in else "")
    if micro is not None:  # the other configurations' table: what differs from the preset instead of the code
        code = micro
    line = (f"| {name} | {spec.impl.value} | {device} | {precision} | {cfg.seq} | {spec.layers} | {code} | "
            f"{fmt_bytes(t.memory.activations_bytes)} | {fmt_bytes(f.activations_bytes)} | {act:+.2%} | "
            f"{fmt_bytes(t.memory.peak_bytes)} | {fmt_bytes(f.peak_tensor_bytes)} | {peak:+.2%} | {seconds:.1f} |")
    print(line, flush=True)
    return name, act


def main() -> int:
    names = _only() or list(PRESETS)
    print("Micro-batch 1, each preset's own sequence length (max_positions). This machine has no CUDA: for `cpu` the "
          "trace runs CPU kernels; for `h100-sxm` it runs on CPU fake tensors with CUDA's kernel choices "
          "(src/batchlab/trace/cuda_policy.py: CUDA's autocast op lists, so softmax and pow in fp32 under autocast; "
          "the fused dropout, so a 1-byte mask; fused attention with dropout), and the formula counts CUDA's terms. "
          "Fake CUDA tensors themselves run forward without CUDA but not backward (autograd asks for the CUDA device "
          "and its stream), so the kernels are CPU's with CUDA's choices. Error = (formula - trace) / trace; the bound "
          f"on activations is {BOUND:.0%} for every preset at its own --impl on both devices. The presets' other "
          "implementations (torchtitan, nanoGPT) are not installed here: their nearest installed code is traced, so "
          "those rows measure how far apart the two codes are, not the formula.\n")
    print("| preset | --impl | device | precision | seq | layers | formula's layer terms (traced code) | trace activations "
          "| formula activations | error | trace peak | formula peak | error | trace s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst = []
    for device in DEVICES:
        for precision in PRECISIONS:
            for name in names:
                worst.append(row(name, precision, device) + (device,))
    for name, impl in (("llama-2-7b", "torchtitan"), ("gpt2", "nanogpt")):
        if name in names:
            row(name, "bf16-mixed", "h100-sxm", impl)
    off = [(n, e, d) for n, e, d in worst if abs(e) > BOUND]
    top = max(worst, key=lambda r: abs(r[1]))
    print(f"\n{len(worst) - len(off)} of {len(worst)} preset rows within {BOUND:.0%} on activations; worst "
          f"{top[0]} on {top[2]} {abs(top[1]):.2%}.")
    others = [o for o in OTHERS if o[0] in names]
    if others:
        print("\nOther configurations (checks beyond the preset grid, each preset at the layers, sequence length, "
              "micro-batch and changes shown; same bound):\n")
        print("| preset | --impl | device | precision | seq | layers | micro-batch, changes | trace activations "
              "| formula activations | error | trace peak | formula peak | error | trace s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        errs = [other_row(*o) for o in others]
        far = [(n, e) for n, e in errs if abs(e) > BOUND]
        print(f"\n{len(errs) - len(far)} of {len(errs)} other rows within {BOUND:.0%} on activations; worst "
              f"{max(abs(e) for _, e in errs):.2%}.")
        off += far
    return 1 if off else 0


if __name__ == "__main__":
    publish(main, "trace_vs_formula", "Trace vs formula, every preset")
