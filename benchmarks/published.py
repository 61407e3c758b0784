"""batchlab's formula beside published GPU training runs: peak memory and tokens/s per GPU, with errors.

Reads benchmarks/published_runs.toml (each run with its source and quote) and benchmarks/gpu_catalogue.toml,
builds a RunConfig for every run, calls batchlab.formula.estimate (no torch) and prints, as Markdown,
predicted vs measured with error = (predicted - measured) / measured, the mean and worst |error|, and every
false OOM verdict.  Memory is matched to what the source measured:

  allocated  ->  memory.allocated_bytes   (max_memory_allocated: tensor bytes at the peak)
  reserved   ->  memory.reserved_bytes    (max_memory_reserved: formula/allocator.py's caching-allocator model)
  device     ->  memory.device_bytes      (nvidia-smi: reserved + CUDA context + NCCL buffers)

Runs marked ``holdout = true`` in the runs file were chosen before anything was tuned; their errors are
summarised on their own.

Every run feature RunConfig cannot express yet is printed on its own line (mapped to the nearest setting).

    PYTHONPATH=src python benchmarks/published.py                 # the whole table
    PYTHONPATH=src python benchmarks/published.py --only tt-h100-llama31-8b-fsdp8-sacop
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from batchlab.config import Assumptions, ModelSpec, RunConfig
from batchlab.formula import estimate
from batchlab.util.units import relative_to

HERE = Path(__file__).resolve().parent
UNITS = {"GiB": 2**30, "MiB": 2**20, "GB": 10**9, "MB": 10**6, "B": 1}

# published GPU key (gpu_catalogue.toml) -> batchlab catalogue entry (config/devices.py)
CATALOGUED = {"v100-sxm2-16gb": "v100-16gb", "v100-sxm2-32gb": "v100-32gb", "a10g": "a10g", "l4": "l4",
              "rtx-3090": "rtx-3090", "rtx-4090": "rtx-4090", "rtx-a6000": "rtx-a6000", "a100-sxm4-40gb": "a100-40gb",
              "a100-sxm4-80gb": "a100-80gb", "a100-pcie-80gb": "a100-pcie-80gb", "h100-sxm-80gb": "h100-sxm",
              "h100-pcie-80gb": "h100-pcie", "h100-nvl-94gb": "h100-nvl", "h100-sxm-96gb": "h100-96gb",
              "h200-sxm-141gb": "h200", "b200": "b200", "mi250x": "mi250x", "mi300x": "mi300x", "mi325x": "mi325x",
              "l40s": "l40s"}

PRECISION = {"fp32": "fp32", "fp16-amp": "fp16-mixed", "bf16-autocast": "bf16-mixed",
             "fsdp-mp-bf16": "bf16-fsdp", "composer-default-bf16": "bf16-mixed",
             "composer-pure-bf16": "bf16-fsdp", "fp8-float8-linear": "bf16-fsdp"}
PRECISION_GAP = {
    "composer-default-bf16": "Composer FSDP1 mixed_precision=DEFAULT (version-dependent param/reduce dtypes) + "
                             "amp_bf16 autocast; modelled as bf16-mixed (autocast: fp32 residual stream)",
    "composer-pure-bf16": "Composer FSDP1 mixed_precision=PURE (bf16 params, bf16 reduce, bf16 buffers); "
                          "modelled as bf16-fsdp (fp32 gradient shard where PURE keeps bf16: 2 B/param/dp high)",
    "fp8-float8-linear": "torchao Float8Linear (fp8 matmuls, fp8 all-gather) has no precision mode; modelled as "
                         "bf16-fsdp (fp8 matmul time and the fp8 weight copies not modelled)",
}
AC = {"none": "none", "full": "full", "selective-op": "selective-op", "megatron-selective": "megatron-selective"}
AC_GAP: dict[str, str] = {}
LOSS = {"causal-lm-ce": "full", "causal-lm-compiled-ce": "compiled", "causal-lm-fused-ce": "fused", "sequence-classification-ce": "classifier"}
LOSS_GAP: dict[str, str] = {}
SHARDING_ZERO = {"none": 0, "ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}


@dataclass
class Row:
    run: dict
    cfg: RunConfig | None = None
    gaps: list[str] = field(default_factory=list)
    mem_measured: int | None = None
    mem_predicted: int | None = None
    tps_measured: float | None = None
    tps_predicted: float | None = None
    fits: bool | None = None
    params: int | None = None
    implied_fraction: float | None = None
    failed: str | None = None

    @property
    def mem_error(self):
        return relative_to(self.mem_predicted, self.mem_measured)

    @property
    def tps_error(self):
        return relative_to(self.tps_predicted, self.tps_measured)


def load(path: Path) -> dict:
    with path.open("rb") as f:
        return tomllib.load(f)


def device_for(gpu: str, catalogue: dict[str, dict], gaps: list[str]) -> str:
    """batchlab's own entry where it has one, else a custom device from the catalogue's dense peaks."""
    if gpu in CATALOGUED:
        return CATALOGUED[gpu]
    raise ValueError(f"GPU {gpu} of the runs file is not mapped to a batchlab catalogue entry")


def config_for(run: dict, catalogue: dict[str, dict], gaps: list[str]) -> RunConfig:
    m = dict(run["model"])
    attention = m.pop("attention", run["attention"])
    if attention == "flash":
        attention = "sdpa"  # a fused kernel either way: no s x s tensor kept
    model = ModelSpec(attention=attention, **m)
    # torchtitan's Llama: separate wq/wk/wv, RoPE on q and k, SDPA; what its blocks keep (and the order its
    # matmuls run for selective-op) is Hugging Face Llama's, which the formula counts for hf: sources
    source = "hf:llama" if "torchtitan" in run["engine"] or run["id"].startswith("trainy") else "builtin"
    if run["precision"] in PRECISION_GAP:
        gaps.append(PRECISION_GAP[run["precision"]])
    ac = run["ac"]
    if ac.startswith("selective-layer:"):
        ac = "every:" + ac.split(":", 1)[1]  # torchtitan checkpoints blocks with index % K == 0, as every:K
    else:
        if ac in AC_GAP:
            gaps.append(AC_GAP[ac])
        ac = AC[ac]
    if run["loss"] in LOSS_GAP:
        gaps.append(f"loss {run['loss']}: " + LOSS_GAP[run["loss"]].format(vocab=model.vocab))
    if run.get("compile"):
        gaps.append("torch.compile is not modelled (fused kernels: faster, fewer saved intermediates)")
    state = run.get("optimizer_bytes_per_param")  # the optimizer's own state size (derived in `assumed`)
    assumptions = Assumptions(optimizer_bytes_per_param=state,
                              zero_grad_set_to_none=run.get("zero_grad_set_to_none", True),
                              torch_version=run.get("torch_version"))
    if run["optimizer"] != "adamw":
        gaps.append(f"optimizer {run['optimizer']}: AdamW's time"
                    + (f", its own state ({state} B/param)" if state is not None else " and state"))
    return RunConfig(model=model, model_source=source, seq=run["seq"], micro_batch=run["micro_batch"], accum=run["accum"],
                     dp=run["dp"], precision=PRECISION[run["precision"]], ac=ac, loss=LOSS[run["loss"]],
                     zero=SHARDING_ZERO[run["sharding"]], device=device_for(run["gpu"], catalogue, gaps),
                     assumptions=assumptions)


def evaluate(run: dict, catalogue: dict[str, dict]) -> Row:
    row = Row(run)
    measured = run["measured"]
    if "memory_value" in measured:
        row.mem_measured = int(measured["memory_value"] * UNITS[measured["memory_unit"]])
    row.tps_measured = measured.get("tokens_per_s_per_gpu")
    try:
        row.cfg = config_for(run, catalogue, row.gaps)
    except ValueError as e:  # a ConfigError: the run cannot be expressed at all
        row.failed = str(e)
        return row
    est = estimate(row.cfg)
    kind = measured.get("memory_kind")
    if kind is not None:  # the formula's figure of the same kind (formula/allocator.py)
        row.mem_predicted = {"allocated": est.memory.allocated_bytes, "reserved": est.memory.reserved_bytes,
                             "device": est.memory.device_bytes}[kind]
    row.fits = est.memory.fits
    row.tps_predicted = est.time.tokens_per_second / row.cfg.dp
    row.params = est.params.total
    if row.tps_measured:  # the fraction of the formula's peak the measured rate implies
        peak = row.cfg.device_spec.peak_flops(row.cfg.precision)
        row.implied_fraction = row.tps_measured * est.flops.model_flops_per_token / peak
    return row


def pct(e: float | None) -> str:
    return "-" if e is None else f"{e:+.1%}"


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def print_table(rows: list[Row]) -> None:
    print("| run | GPU x n | memory kind | measured GiB | predicted GiB | error | OOM verdict | measured tok/s/GPU "
          "| predicted | error | implied fraction |")
    print("|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        run = r.run
        verdict = "-" if r.fits is None else ("fits" if r.fits else "**OOM (false)**")
        frac = "-" if r.implied_fraction is None else f"{r.implied_fraction:.2f}"
        mark = " (held out)" if run.get("holdout") else ""
        print(f"| {run['id']}{mark} | {run['gpu']} x {run['gpu_count']} | {run['measured'].get('memory_kind', '-')} | "
              f"{gib(r.mem_measured)} | {gib(r.mem_predicted) if r.mem_measured else '-'} | "
              f"{pct(r.mem_error) if r.mem_measured else '-'} | {verdict} | {num(r.tps_measured)} | "
              f"{num(r.tps_predicted)} | {pct(r.tps_error)} | {frac} |")
    print()


def print_readme_table(rows: list[Row]) -> None:
    """The summary table (--readme): one line per run, memory of the measured kind, tokens/s per GPU."""
    print("| run | GPU × n | measured memory (kind) | formula | error | verdict | tok/s/GPU measured | formula | error |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        run = r.run
        mark = (" †" if run.get("holdout") else "") + (" (low conf.)" if "confidence" in run else "")
        kind = run["measured"].get("memory_kind")
        measured = f"{gib(r.mem_measured)} GiB ({kind})" if r.mem_measured else "-"
        verdict = "-" if r.fits is None else ("fits" if r.fits else "**OOM (false)**")
        print(f"| {run['id']}{mark} | {run['gpu']} × {run['gpu_count']} | {measured} | "
              f"{gib(r.mem_predicted) if r.mem_measured else '-'} | {pct(r.mem_error) if r.mem_measured else '-'} | "
              f"{verdict} | {num(r.tps_measured)} | {num(r.tps_predicted)} | {pct(r.tps_error)} |")


def summary(rows: list[Row], key: str, what: str) -> None:
    errs = [(abs(getattr(r, key)), r.run["id"]) for r in rows if getattr(r, key) is not None]
    if not errs:
        print(f"- {what}: no runs")
        return
    worst = max(errs)
    print(f"- {what}: mean |error| {statistics.fmean(e for e, _ in errs):.1%}, median "
          f"{statistics.median(e for e, _ in errs):.1%}, worst {worst[0]:.1%} ({worst[1]}), over {len(errs)} runs")


def print_summary(rows: list[Row]) -> None:
    low = [r.run["id"] for r in rows if "confidence" in r.run]
    if low:
        print(f"Low-confidence runs (a configuration field or the figure is inferred; see `confidence`): "
              f"{', '.join(low)}. Summaries over all runs, then without them:")
        print()
    confident = [r for r in rows if "confidence" not in r.run]
    held = [r for r in confident if r.run.get("holdout")]
    tuned = [r for r in confident if not r.run.get("holdout")]
    for label, subset in (("all runs", rows), ("without low-confidence runs", confident),
                          ("held-out runs (chosen before tuning), confident", held),
                          ("the other runs, confident", tuned)):
        if label == "without low-confidence runs" and not low:
            continue
        print(f"{label}:")
        print_errors(subset)
        print()


def print_errors(rows: list[Row]) -> None:
    summary(rows, "mem_error", "memory (matched to the measured kind)")
    for kind in ("allocated", "reserved", "device"):
        summary([r for r in rows if r.run["measured"].get("memory_kind") == kind], "mem_error", f"  memory, {kind}")
    summary(rows, "tps_error", "tokens/s per GPU")
    false_oom = [r.run["id"] for r in rows if r.fits is False]
    print(f"- false OOM verdicts (the run ran): {len(false_oom)}" + (f": {', '.join(false_oom)}" if false_oom else ""))
    for r in rows:  # a source that reports an OOM at a larger micro-batch: the formula must say OOM there too
        if r.run["measured"].get("oom_at_micro_batch_2") and r.cfg is not None:
            m = estimate(r.cfg.replace(micro_batch=2)).memory
            print(f"- true OOM check, {r.run['id']} at micro-batch 2 (the source: OOM): reserved "
                  f"{m.reserved_bytes / 2**30:.1f} GiB of {m.capacity_bytes / 2**30:.2f} -> "
                  f"{'OOM (agrees)' if not m.fits else 'fits (DISAGREES)'}")
    fracs = [r.implied_fraction for r in rows if r.implied_fraction is not None]
    if fracs:
        print(f"- implied achievable fraction (measured tok/s x formula model FLOPs/token / formula peak): "
              f"{min(fracs):.2f}-{max(fracs):.2f}, median {statistics.median(fracs):.2f} (batchlab's defaults per device "
              f"and precision: formula/efficiency.py, HFU of the runs not held out)")


def print_details(rows: list[Row]) -> None:
    print("What RunConfig cannot express yet (mapped to the nearest setting), and parameter counts:")
    print()
    for r in rows:
        lines = list(r.gaps)
        published = r.run["measured"].get("published_params")
        if published and r.params:
            lines.append(f"parameters: formula {r.params:,} vs published {published:,} "
                         f"({pct(relative_to(r.params, published))})")
        if r.failed:
            lines.append(f"NOT EVALUATED: {r.failed}")
        if lines:
            print(f"- {r.run['id']}:")
            for line in lines:
                print(f"  - {line}")
    print()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=Path, default=HERE / "published_runs.toml")
    p.add_argument("--gpus", type=Path, default=HERE / "gpu_catalogue.toml")
    p.add_argument("--only", default="", help="comma-separated run ids")
    p.add_argument("--readme", action="store_true", help="only the summary table (one line per run)")
    args = p.parse_args(argv)
    runs = load(args.runs)["run"]
    catalogue = {g["key"]: g for g in load(args.gpus)["gpu"]}
    if args.only:
        wanted = set(args.only.split(","))
        runs = [r for r in runs if r["id"] in wanted]
        if not runs:
            print(f"--only: no run named {args.only!r}", file=sys.stderr)
            return 2
    rows = [evaluate(r, catalogue) for r in runs]
    if args.readme:
        print_readme_table(rows)
        return 0
    print(f"batchlab formula vs {len(rows)} published GPU runs ({args.runs.name}); "
          "error = (predicted - measured) / measured; tokens/s per GPU.")
    print()
    print_table(rows)
    print_summary(rows)
    print_details(rows)
    return 0


if __name__ == "__main__":
    import page  # benchmarks/page.py: this script's page of the docs

    page.publish(main, page.variant("published", {"--readme": "table"}), "Predicted vs published GPU runs")
