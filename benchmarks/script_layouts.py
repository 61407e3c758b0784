"""The PyTorch script `fit` prints, run as printed for every tensor / pipeline layout: each against its reference.

Every layout's script (the stand-in: 4 layers, width 64, 4 heads, seq 16, micro-batch 2, accumulation 2) runs through
``torchrun --standalone`` on gloo (CPU); its reference is the script of the same config with TP = PP = 1 (same seed,
same stand-in): single process where DP = 1, the DP script (DDP, or FSDP2 at ZeRO-2/3) where DP = 2.  Both are
sharpened alike (``tests/script_run.py`` ``sharpened``: SGD at lr 0.5, 8 decimals), so the loss printed after update 1's step
checks every gradient's size.  One launch per world size: 2 ranks (the DP = 1 references in rank 0, the TP2 / PP2
layouts, the DP2 references), 4 ranks (the layouts with DP or with both TP and PP) and 8 (DP x TP x PP).
Writes docs/accuracy/script-layouts.md.

    PYTHONPATH=src python benchmarks/script_layouts.py [--only=KEY,...] [--no-page]
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE)]  # script_run (a test helper), page

from page import publish  # noqa: E402

from batchlab.advise.torch_script import training_script  # noqa: E402
from batchlab.config import ACPolicy, RunConfig, preset  # noqa: E402
from script_run import run_scripts, sharpened  # noqa: E402

PLAN = "plan:full,selective-op,megatron-selective,none"


def config(ac: str = "none", **kw) -> RunConfig:
    return RunConfig(model=preset("tiny", layers=4, attention="sdpa"), seq=16, micro_batch=2, accum=2,
                     ac=ACPolicy.parse(ac), **kw)


# name -> config (fp32 layouts held to FP32_REL, bf16 ones to HALF_REL, each against its own precision's reference)
LAYOUTS = {
    "TP2": config(tp=2),
    "TP2 + SP": config(tp=2, sequence_parallel=True),
    "TP2 + SP, per-layer AC plan": config(tp=2, sequence_parallel=True, ac=PLAN),
    "PP2 GPipe": config(pp=2, pp_schedule="gpipe"),
    "PP2 1F1B": config(pp=2, pp_schedule="1f1b"),
    "PP2 interleaved (2 stages per rank)": config(pp=2, pp_schedule="interleaved-1f1b", pp_virtual=2),
    "PP2 1F1B, full AC, bf16-mixed": config(pp=2, ac="full", precision="bf16-mixed"),
    "TP2 x DP2 (all-reduce)": config(tp=2, dp=2),
    "PP2 x DP2 (all-reduce)": config(pp=2, dp=2),
    "FSDP2 (ZeRO-3) x TP2": config(tp=2, dp=2, zero=3),
    "PP2 x FSDP2 (ZeRO-2), bf16-fsdp": config(pp=2, dp=2, zero=2, precision="bf16-fsdp"),
    "TP2 + SP x PP2 1F1B": config(tp=2, sequence_parallel=True, pp=2),
    "FSDP2 (ZeRO-3) x TP2 + SP x PP2 interleaved, full AC": config(dp=2, zero=3, tp=2, sequence_parallel=True, pp=2,
                                                                  pp_schedule="interleaved-1f1b", pp_virtual=2,
                                                                  ac="full"),
}
FP32_REL = 1e-5  # fp32: the same sums in another order
HALF_REL = 1e-2  # bf16: 8 significant bits, sums in another order


def reference(cfg: RunConfig) -> RunConfig:
    return cfg.replace(tp=1, sequence_parallel=False, pp=1, pp_schedule="1f1b", pp_virtual=1)


def key(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def main() -> int:
    only = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--only=")), None)
    layouts = {n: c for n, c in LAYOUTS.items() if only is None or key(n) in only.split(",")}
    print(f"load average at the start: {os.getloadavg()[0]:.1f}\n")
    print("| layout | ranks | launch line | update 1 loss | update 2 loss | reference (TP = PP = 1) | "
          "largest relative difference | held to | |")
    print("|---|---|---|---|---|---|---|---|---|")
    failures = 0
    # one launch per world size: the layouts of that size and the DP references (DP ranks alone) of that size;
    # the single-process references in rank 0 of the smallest launch
    launches: dict[int, tuple[dict, dict]] = {}
    singles = {}
    for name, cfg in layouts.items():
        launches.setdefault(cfg.parallel.world_size, ({}, {}))[0][key(name)] = sharpened(training_script(cfg))
        ref = reference(cfg)
        text = sharpened(training_script(ref))
        if ref.dp == 1:
            singles[key(name) + "_ref"] = text
        else:
            launches.setdefault(ref.dp, ({}, {}))[0][key(name) + "_ref"] = text
    launches[min(launches)][1].update(singles)
    losses: dict[str, list[float]] = {}
    logs = []
    with tempfile.TemporaryDirectory() as tmp:
        for world, (scripts, refs) in sorted(launches.items()):
            t = time.perf_counter()
            run = run_scripts(Path(tmp) / f"world{world}", world, scripts, references=refs)
            logs.append(f"{world} ranks: {len(scripts)} scripts and {len(refs)} single-process references in one "
                        f"launch, {time.perf_counter() - t:.0f} s, exit {run.returncode}")
            losses.update(run.losses)
            if not run.ok:
                print(run.log[-3000:], file=sys.stderr)
        for name, cfg in layouts.items():
            got, want = losses.get(key(name)), losses.get(key(name) + "_ref")
            half = cfg.precision.value != "fp32"
            tol = HALF_REL if half else FP32_REL
            launch = next(line for line in training_script(cfg).splitlines() if line.startswith("# launch"))
            launch = launch.removeprefix("# launch: ").replace("python -m torch.distributed.run", "torchrun")
            if not got or not want or len(got) != 2 or len(want) != 2:
                failures += 1
                print(f"| {name} | {cfg.parallel.world_size} | `{launch}` | — | — | — | did not run | | ✗ |")
                continue
            diff = max(abs(a - b) / abs(b) for a, b in zip(got, want))
            ok = diff <= tol
            failures += not ok
            print(f"| {name} | {cfg.parallel.world_size} | `{launch}` | {got[0]:.6f} | {got[1]:.6f} | "
                  f"{want[0]:.6f}, {want[1]:.6f} | {diff:.1e} | {tol:.0e} | {'✓' if ok else '✗'} |")
    print()
    for line in logs:
        print(f"- {line}")
    print(f"\n{len(layouts) - failures} of {len(layouts)} layouts run as printed and match their reference.")
    return 1 if failures else 0


if __name__ == "__main__":
    publish(main, "script-layouts", "The printed PyTorch script under tensor and pipeline parallelism")
