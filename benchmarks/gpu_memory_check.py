"""On a CUDA machine: allocated, reserved and device-view peaks and tokens/s of a few configs, each beside the
formula's figure of the same kind (formula/allocator.py, formula/efficiency.py).  Writes a Markdown summary and
JSON to --out.  Figures: allocator (torch.cuda max_memory_allocated / max_memory_reserved), device view
(cudaMemGetInfo: total - free, the whole device as nvidia-smi sees it), wall-clock (synchronised, warmup
excluded, median of the timed updates).

    PYTHONPATH=src python benchmarks/gpu_memory_check.py --out gpu-check [--only NAME] [--steps 4]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

CONFIGS = {  # name -> RunConfig fields (sizes that fit a 16 GB card)
    "gpt2-none": dict(model="gpt2", seq=1024, micro_batch=4, precision="bf16-mixed", ac="none"),
    "gpt2-selective-op": dict(model="gpt2", seq=1024, micro_batch=4, precision="bf16-mixed", ac="selective-op"),
    "gpt2-full": dict(model="gpt2", seq=1024, micro_batch=8, precision="bf16-mixed", ac="full"),
    "gpt2-chunked-loss": dict(model="gpt2", seq=1024, micro_batch=4, precision="bf16-mixed", loss="chunked:8"),
    "llama-small-megatron": dict(model="gpt2-medium", seq=1024, micro_batch=2, precision="bf16-mixed",
                                 ac="megatron-selective", mlp="swiglu", norm="rmsnorm", position="rope",
                                 kv_heads=4, attention="sdpa", dropout=0.0),
    "gpt2-fp32": dict(model="gpt2", seq=512, micro_batch=4, precision="fp32", ac="none"),
}


def config(name: str, device: str):
    from batchlab.config import RunConfig, preset

    fields = dict(CONFIGS[name])
    model_fields = {k: fields.pop(k) for k in ("mlp", "norm", "position", "kv_heads", "attention", "dropout")
                    if k in fields}
    spec = preset(fields.pop("model"), **model_fields)
    return RunConfig(model=spec, device=device, **fields)


def local_device() -> str:
    import torch

    from batchlab.config import catalogue_key

    name = torch.cuda.get_device_name()
    key = catalogue_key(name)
    if key:
        return key
    props = torch.cuda.get_device_properties(0)
    print(f"{name} is not in batchlab's catalogue: a custom entry with its reported capacity", file=sys.stderr)
    return f"custom:mem={props.total_memory}B,tflops=100"


def measure(cfg, steps: int) -> dict:
    import torch

    from batchlab.measure.harness import Trainer

    torch.cuda.empty_cache()
    trainer = Trainer(cfg, "cuda")
    trainer.update()  # warmup: AdamW state, cuBLAS handles, caching-allocator segments
    trainer.update()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.update()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    free, total = torch.cuda.mem_get_info()
    out = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
           "device": total - free, "device_total": total, "update_s": statistics.median(times),
           "update_s_spread": [min(times), max(times)], "tokens_per_s": cfg.tokens_per_update / statistics.median(times),
           "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0)}
    del trainer
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu-check"))
    p.add_argument("--only", default="")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    import torch

    from batchlab.formula import estimate
    from batchlab.util.units import relative_to

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    device = local_device()
    names = args.only.split(",") if args.only else list(CONFIGS)
    rows = []
    for name in names:
        cfg = config(name, device)
        est = estimate(cfg)
        m = est.memory
        try:
            got = measure(cfg, args.steps)
        except torch.OutOfMemoryError as e:
            got = {"error": f"OOM: {e}"[:200]}
        pred = {"allocated": m.allocated_bytes, "reserved": m.reserved_bytes, "device": m.device_bytes,
                "tokens_per_s": est.time.tokens_per_second}
        err = {k: relative_to(pred[k], got[k]) for k in pred if k in got}
        rows.append({"name": name, "config": cfg.to_dict(), "measured": got, "formula": pred, "error": err,
                     "reserved_parts": m.reserved_parts, "fraction_source": est.time.fraction_source})
        print(name, json.dumps({k: f"{v:+.1%}" for k, v in err.items()}), flush=True)
    (args.out / "gpu_memory_check.json").write_text(json.dumps(rows, indent=1))
    lines = [f"# formula vs {torch.cuda.get_device_name()} ({device}), torch {torch.__version__}", "",
             "| config | allocated GiB (meas / formula) | reserved GiB | device view GiB | tokens/s |",
             "|---|---|---|---|---|"]
    for r in rows:
        g, f, e = r["measured"], r["formula"], r["error"]
        if "error" in g:
            lines.append(f"| {r['name']} | {g['error']} | | | |")
            continue
        cell = lambda k, scale: f"{g[k] / scale:,.2f} / {f[k] / scale:,.2f} ({e[k]:+.1%})"  # noqa: E731
        lines.append(f"| {r['name']} | {cell('allocated', 2**30)} | {cell('reserved', 2**30)} | "
                     f"{cell('device', 2**30)} | {cell('tokens_per_s', 1)} |")
    (args.out / "gpu_memory_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
