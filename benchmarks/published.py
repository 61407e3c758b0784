"""batchlab's formula beside published GPU training runs, typed as a user types them: memory and tokens/s per GPU.

Reads benchmarks/published_runs.toml (each run with its source and quote), builds for every run the
``batchlab estimate`` command a user types (the run's ``cli`` model part, then its shape, parallelism,
precision, AC, loss and device flags), parses it with the CLI's own option parsing (cli/common.py
``config_from_command``: the RunConfig the command builds), calls batchlab.formula.estimate (no torch) and writes
docs/accuracy/published.md: each run with its command and source, predicted vs measured with
error = (predicted - measured) / measured, before the throughput revision (benchmarks/published_before.toml) and
now, the mean and worst |error|, and every false OOM verdict.  The rule-chosen hold-outs (``added_for = "round 3"``)
also show their figures as first recorded after the throughput revision (benchmarks/published_round3_first.toml,
never regenerated: the code moves, that column does not).  Memory is matched to what the source measured:

  allocated  ->  memory.allocated_bytes   (max_memory_allocated: tensor bytes at the peak)
  reserved   ->  memory.reserved_bytes    (max_memory_reserved: formula/allocator.py's caching-allocator model)
  device     ->  memory.device_bytes      (nvidia-smi: reserved + CUDA context + NCCL buffers)

Runs marked ``holdout = true`` were chosen before anything was tuned; their errors are summarised on their own.
What no flag expresses is listed under each run (mapped to the nearest setting).

    PYTHONPATH=src python benchmarks/published.py                 # the whole table -> docs/accuracy/published.md
    PYTHONPATH=src python benchmarks/published.py --only tt-h100-llama31-8b-fsdp8-sacop   # prints only
    PYTHONPATH=src python benchmarks/published.py --derive   # the fractions -> docs/accuracy/published-fractions.md

``--derive`` makes the achievable fraction (formula/efficiency.py FRACTIONS) a quantity of the current time model:
for each run *not* held out it solves for the matmul fraction f at which the model's update time equals the
published one (bisection: the predicted rate rises with f), and gives the median per (arch, 16-bit) class.
Hold-outs are skipped before anything is computed for them; runs whose matmuls no flag expresses (Float8) are
listed but not used.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from click import ClickException

from batchlab.cli.common import config_from_command
from batchlab.config import RunConfig
from batchlab.formula import estimate, implementation_line
from batchlab.formula.efficiency import FRACTIONS, fraction_class
from batchlab.util.units import relative_to

HERE = Path(__file__).resolve().parent
# the runs file's ``added_for`` tags -> how the page names each set of hold-outs
LABEL = {"issue 36": "hold-outs added before the throughput revision",
         "round 3": "rule-chosen hold-outs (chosen by a written rule after the throughput revision, recorded once)"}
ROOT = HERE.parent
UNITS = {"GiB": 2**30, "MiB": 2**20, "GB": 10**9, "MB": 10**6, "B": 1}

# published GPU key (the runs file's `gpu`, described in gpu_catalogue.toml) -> batchlab's entry (config/devices.py)
CATALOGUED = {"v100-sxm2-16gb": "v100-16gb", "v100-sxm2-32gb": "v100-32gb", "a10g": "a10g", "l4": "l4",
              "rtx-3090": "rtx-3090", "rtx-4090": "rtx-4090", "titan-rtx": "titan-rtx", "rtx-a6000": "rtx-a6000", "a100-sxm4-40gb": "a100-40gb",
              "a100-sxm4-80gb": "a100-80gb", "a100-pcie-80gb": "a100-pcie-80gb", "h100-sxm-80gb": "h100-sxm",
              "h100-pcie-80gb": "h100-pcie", "h100-nvl-94gb": "h100-nvl", "h100-sxm-96gb": "h100-96gb",
              "h200-sxm-141gb": "h200", "b200": "b200", "mi250x": "mi250x", "mi300x": "mi300x", "mi325x": "mi325x",
              "l40s": "l40s"}

PRECISION = {"fp32": "fp32", "fp16-amp": "fp16-mixed", "bf16-autocast": "bf16-mixed",
             "fsdp-mp-bf16": "bf16-fsdp", "composer-default-bf16": "bf16-mixed",
             "composer-pure-bf16": "bf16-fsdp", "fsdp1-pure-bf16": "bf16-fsdp", "fp8-float8-linear": "bf16-fsdp"}
PRECISION_GAP = {
    "composer-default-bf16": "Composer FSDP1 mixed_precision=DEFAULT (version-dependent param/reduce dtypes) + "
                             "amp_bf16 autocast; modelled as bf16-mixed (autocast: fp32 residual stream)",
    "composer-pure-bf16": "Composer FSDP1 mixed_precision=PURE (bf16 params, bf16 reduce, bf16 buffers); "
                          "modelled as bf16-fsdp (fp32 gradient shard where PURE keeps bf16: 2 B/param/dp high)",
    "fsdp1-pure-bf16": "FSDP1 MixedPrecision(param_dtype, reduce_dtype, buffer_dtype bf16); modelled as "
                       "bf16-fsdp (fp32 gradient shard and fp32 reduce where it keeps bf16)",
    "fp8-float8-linear": "torchao Float8Linear (fp8 matmuls, fp8 all-gather) has no precision mode; modelled as "
                         "bf16-fsdp (fp8 matmul time and the fp8 weight copies not modelled)",
}
AC = {"none": "none", "full": "full", "selective-op": "selective-op", "megatron-selective": "megatron-selective"}
LOSS = {"causal-lm-ce": "full", "causal-lm-compiled-ce": "compiled", "causal-lm-fused-ce": "fused", "sequence-classification-ce": "classifier"}
SHARDING_ZERO = {"none": 0, "ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3, "hsdp": 3}
SHARDING_GAP = {"hsdp": "FSDP1 HYBRID_SHARD (ZeRO-3 within each node of 8, replicated across nodes) has no flag; "
                        "modelled as ZeRO-3 over all ranks (its gathers and reduce-scatters span every rank, "
                        "where HSDP's span a node and add an all-reduce across nodes)"}


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
    command: str = ""
    layer_terms: str = ""
    tps_before: float | None = None  # the formula's figures before the throughput revision (published_before.toml)
    mem_before: int | None = None
    fits_before: bool | None = None
    tps_first: float | None = None  # rule-chosen hold-outs: as first recorded (published_round3_first.toml)
    fits_first: bool | None = None
    params: int | None = None
    failed: str | None = None
    tps_low: float | None = None  # a card whose peak is known only as a range: the rate at its low end

    @property
    def mem_error(self):
        return relative_to(self.mem_predicted, self.mem_measured)

    @property
    def tps_error(self):
        return range_error(self.tps_predicted, self.tps_low, self.tps_measured)

    @property
    def tps_error_high(self):
        """At the card's catalogue peak alone (the high end where the peak is known only as a range)."""
        return relative_to(self.tps_predicted, self.tps_measured)

    @property
    def tps_error_before(self):
        return relative_to(self.tps_before, self.tps_measured)

    @property
    def tps_error_first(self):
        return relative_to(self.tps_first, self.tps_measured)

    @property
    def mem_error_before(self):
        return relative_to(self.mem_before, self.mem_measured) if self.mem_measured else None


# a row's ``bound``: which way its command's prediction bounds the published figure -> the check it must pass
BOUNDS = {"upper": ("predicted >= measured", lambda predicted, measured: predicted >= measured),
          "lower": ("predicted <= measured", lambda predicted, measured: predicted <= measured)}
NO_BOUND = "none"  # the figure bounds nothing: the row is listed, checked against nothing, kept out of the means
POINT = "point"  # in a per-figure ``bound``: this figure is typed in full (the row's gap leaves it alone)
FIGURES = ("memory", "rate")  # a row's figures, each of which may bound its own way


def bound_of(run: dict, figure: str | None = None) -> str | None:
    """How a run its source does not pin down (``not_typed``) bounds the published ``figure``: "upper", "lower" or
    "none"; None for a point.  ``bound`` is one direction for every figure, or one per figure
    (``{memory = "upper", rate = "lower"}``: the longest possible sequence over-counts the memory and under-counts
    the rate; ``{memory = "point", rate = "upper"}``: what the source leaves out moves only the rate).  Without
    ``figure``: the run's one direction, "mixed" where its figures differ."""
    gap = run.get("not_typed")
    if gap is not None and not (isinstance(gap, list) and all(isinstance(g, str) for g in gap)):
        raise SystemExit(f"run {run['id']}: not_typed is a list of what the source leaves out (got {gap!r})")
    if not gap:
        if "bound" in run:
            raise SystemExit(f"run {run['id']}: a bound needs not_typed, the inputs the source leaves out")
        return None
    given = run.get("bound")
    per = given if isinstance(given, dict) else {f: given for f in FIGURES}
    allowed = (*BOUNDS, NO_BOUND) + ((POINT,) if isinstance(given, dict) else ())
    if set(per) != set(FIGURES) or any(v not in allowed for v in per.values()) or set(per.values()) == {POINT}:
        raise SystemExit(f"run {run['id']}: not_typed needs bound = one of {', '.join((*BOUNDS, NO_BOUND))}, or a "
                         f"table giving each of {', '.join(FIGURES)} one (or {POINT}, not all) (got {given!r})")
    if figure is not None:
        return None if per[figure] == POINT else per[figure]
    return per[FIGURES[0]] if len(set(per.values())) == 1 else "mixed"


def bound_cells(run: dict, figure: str, predicted, measured) -> tuple[str, str]:
    """The check a bound ``figure`` must pass and whether it holds ("yes", "**no**", "-" where nothing is checked)."""
    bound = bound_of(run, figure)
    if bound not in BOUNDS:
        return "-", "-"
    text, check = BOUNDS[bound]
    return text, "-" if predicted is None or measured is None else ("yes" if check(predicted, measured) else "**no**")


def bounds_table(rows: list, rate_of, rate_cell, rate_label: str) -> list[str]:
    """The page's *Bounds* section: each row that is no point, the check each of its figures must pass and whether
    it holds, a tally, then what each one's source does not give.  ``rate_of(row)``: its (predicted, measured)
    rate; ``rate_cell(row, value, measured)``: a rate as the page writes it (the measured one with its unit)."""
    out = [f"| run | memory: check | measured | predicted | holds | {rate_label}: check | measured | predicted | holds |",
           "|---|---|---:|---:|---|---|---:|---:|---|"]
    held: dict[str, list[str]] = {"memory": [], "rate": []}
    bound = [r for r in rows if bound_of(r.run) is not None]
    for r in bound:
        predicted, measured = rate_of(r)
        mem_check, mem_held = bound_cells(r.run, "memory", r.mem_predicted, r.mem_measured)
        rate_check, rate_held = bound_cells(r.run, "rate", predicted, measured)
        held["memory"].append(mem_held)
        held["rate"].append(rate_held)
        out.append(f"| {r.run['id']}{' †' if r.run.get('holdout') else ''} | {mem_check} | {gib(r.mem_measured)} GiB | "
                   f"{gib(r.mem_predicted)} | {mem_held} | {rate_check} | {rate_cell(r, measured, True)} | "
                   f"{rate_cell(r, predicted, False)} | {rate_held} |")
    if not bound:
        return ["No row is a bound."]
    tally = "; ".join(f"{figure} {v.count('yes')} of {len(v) - v.count('-')}" for figure, v in held.items())
    reasons = [f"- {r.run['id']}{' †' if r.run.get('holdout') else ''}: {'; '.join(r.run['not_typed'])}" for r in bound]
    return [f"Bounds that hold: {tally} (a figure that bounds nothing is not counted).", "", *out, "",
            "What each row's source does not give:", "", *reasons]


def points(rows: list, figure: str | None = None) -> list:
    """The rows whose command types every input the prediction of ``figure`` needs (every figure: None): the ones
    the means are over."""
    return [r for r in rows if bound_of(r.run, figure) is None]


def load(path: Path) -> dict:
    with path.open("rb") as f:
        return tomllib.load(f)


def load_recorded(before: Path, first: Path) -> dict[str, dict]:
    """Each run's recorded figures by id: before the throughput revision (published_before.toml's keys) and, for
    the rule-chosen hold-outs, their before and first-recorded figures (published_round3_first.toml; before_* read as before)."""
    out = {r["id"]: dict(r) for r in load(before)["run"]} if before.exists() else {}
    for r in load(first)["run"] if first.exists() else []:
        out.setdefault(r["id"], {}).update(tokens_per_s_per_gpu=r["before_tokens_per_s_per_gpu"], fits=r["before_fits"],
                                           first_tokens_per_s_per_gpu=r["first_tokens_per_s_per_gpu"],
                                           first_fits=r["first_fits"])
    return out


def device_for(gpu: str) -> str:
    """batchlab's catalogue entry for a published GPU key."""
    if gpu in CATALOGUED:
        return CATALOGUED[gpu]
    raise ValueError(f"GPU {gpu} of the runs file is not mapped to a batchlab catalogue entry")


def command_for(run: dict, gaps: list[str]) -> list[str]:
    """``batchlab estimate ...`` as a user types it for the run: the runs file's model part (``cli``), then the
    shape, parallelism, precision, AC, loss and device flags from its fields; what no flag expresses goes to
    ``gaps`` (mapped to the nearest setting)."""
    if run["precision"] in PRECISION_GAP and not run.get("fp8"):
        gaps.append(PRECISION_GAP[run["precision"]])
    if run["sharding"] in SHARDING_GAP:
        gaps.append(SHARDING_GAP[run["sharding"]])
    ac = run["ac"]
    if ac.startswith("selective-layer:"):
        ac = "every:" + ac.split(":", 1)[1]  # torchtitan checkpoints blocks with index % K == 0, as every:K
    else:
        ac = AC[ac]
    if run.get("compile"):
        gaps.append("torch.compile is not modelled (fused kernels: faster, fewer saved intermediates)")
    state = run.get("optimizer_bytes_per_param")  # the optimizer's own state size (derived in `assumed`)
    if run["optimizer"] != "adamw":
        gaps.append(f"optimizer {run['optimizer']}: AdamW's time"
                    + (f", its own state ({state} B/param)" if state is not None else " and state"))
    argv = ["estimate", *shlex.split(run["cli"]), "--seq", str(run["seq"]), "--micro-batch", str(run["micro_batch"]),
            "--accum", str(run["accum"]), "--dp", str(run["dp"]), "--zero", str(SHARDING_ZERO[run["sharding"]]),
            "--precision", PRECISION[run["precision"]], "--ac", ac, "--loss", LOSS[run["loss"]],
            "--device", device_for(run["gpu"])]
    if state is not None:
        argv += ["--optimizer-bytes", str(state)]
    if run.get("fp8"):  # the recipe (config/fp8.py) the run's Float8 converter names
        argv += ["--fp8", run["fp8"]]
    return argv


def model_gaps(cfg: RunConfig, run: dict) -> list[str]:
    """Fields of the run's model the command's model does not have (flash attention counts as sdpa)."""
    want = dict(run["model"], attention=run["model"].get("attention", run["attention"]))
    want["attention"] = "sdpa" if want["attention"] == "flash" else want["attention"]
    got = {k: getattr(cfg.model, k) for k in want if k != "name"}
    return [f"model {k}: the command gives {getattr(v, 'value', v)}, the run has {want[k]}"
            for k, v in got.items() if getattr(v, "value", v) != want[k]]


def typed_config(argv: list[str], run: dict, gaps: list[str]) -> tuple[RunConfig, str]:
    """The RunConfig ``argv`` builds through the CLI's own option parsing (a ``--config`` path read from the
    repository root, as the page's commands are run), with the model fields it misses added to ``gaps``, and the
    command."""
    parse = [str(ROOT / a) if prev == "--config" else a for prev, a in zip([""] + argv, argv)]
    cfg = config_from_command(parse)
    gaps.extend(model_gaps(cfg, run))
    return cfg, "batchlab " + shlex.join(argv)


def config_for(run: dict, gaps: list[str]) -> tuple[RunConfig, str]:
    """The RunConfig the run's command builds, and the command."""
    return typed_config(command_for(run, gaps), run, gaps)


def evaluate(run: dict, before: dict[str, dict] | None = None) -> Row:
    row = Row(run)
    measured = run["measured"]
    if "memory_value" in measured:
        row.mem_measured = int(measured["memory_value"] * UNITS[measured["memory_unit"]])
    row.tps_measured = measured.get("tokens_per_s_per_gpu")
    old = (before or {}).get(run["id"], {})
    row.tps_before, row.mem_before, row.fits_before = (old.get("tokens_per_s_per_gpu"), old.get("memory_bytes"),
                                                        old.get("fits"))
    row.tps_first, row.fits_first = old.get("first_tokens_per_s_per_gpu"), old.get("first_fits")
    try:
        row.cfg, row.command = config_for(run, row.gaps)
    except (ValueError, ClickException) as e:  # a ConfigError or a usage error: the run cannot be typed at all
        row.failed = str(e)
        return row
    est = estimate(row.cfg)
    kind = measured.get("memory_kind")
    if kind is not None:  # the formula's figure of the same kind (formula/allocator.py)
        row.mem_predicted = {"allocated": est.memory.allocated_bytes, "reserved": est.memory.reserved_bytes,
                             "device": est.memory.device_bytes}[kind]
    row.fits = est.memory.fits
    row.tps_predicted = est.time.tokens_per_second / row.cfg.dp
    if est.low_peak_time is not None:
        row.tps_low = est.low_peak_time.tokens_per_second / row.cfg.dp
    row.params = est.params.total
    row.layer_terms = implementation_line(row.cfg)
    return row


# runs whose matmuls the command cannot express: their rate says nothing of the class's 16-bit matmuls
NOT_DERIVED_FROM = {"fp8-float8-linear": "fp8 matmuls (Float8Linear), modelled as bf16"}


@dataclass(frozen=True)
class Derived:
    run_id: str
    key: tuple[str, bool] | None  # formula/efficiency.py's FRACTIONS class the run's command reads
    fraction: float | None  # None: excluded, or no f in (0, 1] reproduces the published rate
    excluded: str = ""  # why the run is not used ("" when it is)


def solve_fraction(cfg: RunConfig, tps_measured: float, lo: float = 0.01, hi: float = 1.0,
                   tol: float = 1e-5) -> float | None:
    """The matmul fraction f at which the model's tokens/s per GPU equals the published one (equivalently its
    update time), by bisection: the predicted rate rises monotonically with f.  None if no f in [lo, hi] does."""
    def rate(f: float) -> float:
        return estimate(cfg.replace(achievable_fraction=f)).time.tokens_per_second / cfg.dp

    if not rate(lo) <= tps_measured <= rate(hi):
        return None
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) < tps_measured else (lo, mid)
    return (lo + hi) / 2


def derive(runs: list[dict]) -> list[Derived]:
    """Each run not held out, with the fraction its published tokens/s implies; hold-outs are never evaluated."""
    out = []
    for run in runs:
        if run.get("holdout"):
            continue
        cfg, _ = config_for(run, [])
        tps = run["measured"].get("tokens_per_s_per_gpu")
        why = NOT_DERIVED_FROM.get(run["precision"], "" if tps else "no published tokens/s")
        f = None if why else solve_fraction(cfg, tps)
        out.append(Derived(run["id"], fraction_class(cfg), f, why or ("" if f is not None else "no f <= 1 reaches it")))
    return out


def class_medians(derived: list[Derived]) -> dict[tuple[str, bool], tuple[float, list[Derived]]]:
    """Per FRACTIONS class: the median of its used runs' fractions (to 2 decimals, as FRACTIONS holds it)."""
    used: dict[tuple[str, bool], list[Derived]] = {}
    for d in derived:
        if not d.excluded and d.key is not None:
            used.setdefault(d.key, []).append(d)
    return {k: (round(statistics.median(d.fraction for d in v), 2), v) for k, v in used.items()}


def derive_document(derived: list[Derived], held_out: int) -> str:
    """The page: each run's fraction, then each class's median beside what formula/efficiency.py holds."""
    name = lambda k: f"{k[0]} {'16-bit' if k[1] else 'fp32'}" if k else "-"  # noqa: E731
    lines = ["The achievable fraction f of formula/efficiency.py, derived from the published runs under the current "
             "time model: for each run not held out, the matmul fraction of the dense peak at which the per-op "
             "model (element-wise work, copies, the loss and the optimizer priced by bytes at HBM bandwidth) "
             f"predicts the published update time. {held_out} held-out runs are never evaluated here.", "",
             "| run | class | f | used |", "|---|---|---:|---|"]
    for d in derived:
        f = "-" if d.fraction is None else f"{d.fraction:.3f}"
        lines.append(f"| {d.run_id} | {name(d.key)} | {f} | {'yes' if not d.excluded else 'no: ' + d.excluded} |")
    lines += ["", "| class | runs | values | median | FRACTIONS |", "|---|---:|---|---:|---:|"]
    for k, (median, used) in sorted(class_medians(derived).items()):
        values = ", ".join(f"{d.fraction:.3f}" for d in sorted(used, key=lambda d: d.fraction))
        held = FRACTIONS[k].value if k in FRACTIONS else None
        lines.append(f"| {name(k)} | {len(used)} | {values} | {median:.2f} | {held if held is not None else '-'} |")
    none = sorted({d.key for d in derived if d.key} - set(class_medians(derived)))
    lines += [""] if none else []  # Markdown needs the blank line between the table and the list
    lines += [f"- {name(k)}: no run gives a fraction; FRACTIONS holds {FRACTIONS[k].value} ({FRACTIONS[k].source})"
              for k in none]
    return "\n".join(lines + [""])


def pct(e: float | None) -> str:
    return "-" if e is None else f"{e:+.1%}"


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def range_error(high: float | None, low: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured; where the card's peak is known only as a range (``low``: the rate at its
    low end), 0 inside [low, high] and the nearest end's error outside: no point inside the range is better
    founded than another."""
    if low is None or high is None or measured is None:
        return relative_to(high, measured)
    return 0.0 if low <= measured <= high else relative_to(high if measured > high else low, measured)


def rate_text(high: float | None, low: float | None) -> str:
    """A predicted rate, or its range where the card's peak is known only as one."""
    return num(high) if low is None or high is None else f"{num(low)}-{num(high)}"


def verdict(fits: bool | None) -> str:
    return "-" if fits is None else ("fits" if fits else "**OOM (false)**")


def mark(run: dict) -> str:
    return (" †" if run.get("holdout") else "") + (" (low conf.)" if "confidence" in run else "")


def table(rows: list[Row]) -> list[str]:
    """Memory of the kind the source measured and tokens/s per GPU, before the throughput revision and now."""
    out = ["| run | GPU × n | memory measured (kind) | before | error | now | error | verdict before → now "
           "| tok/s/GPU measured | before | error | now | error |",
           "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        kind = r.run["measured"].get("memory_kind")
        mem = f"{gib(r.mem_measured)} GiB ({kind})" if r.mem_measured else "-"
        now = gib(r.mem_predicted) if r.mem_measured else "-"
        before = gib(r.mem_before) if r.mem_measured else "-"
        out.append(f"| {r.run['id']}{mark(r.run)} | {r.run['gpu']} × {r.run['gpu_count']} | {mem} | {before} | "
                   f"{pct(r.mem_error_before)} | {now} | {pct(r.mem_error) if r.mem_measured else '-'} | "
                   f"{verdict(r.fits_before)} → {verdict(r.fits)} | {num(r.tps_measured)} | {num(r.tps_before)} | "
                   f"{pct(r.tps_error_before)} | {rate_text(r.tps_predicted, r.tps_low)} | {pct(r.tps_error)} |")
    return out


def round3_table(rows: list[Row]) -> list[str]:
    """The rule-chosen hold-outs: tokens/s per GPU before the throughput revision, as first recorded after it, and
    now."""
    out = ["| run | GPU × n | tok/s/GPU measured | before | error | first recorded | error | now | error "
           "| verdict before → first → now |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r.run['id']} | {r.run['gpu']} × {r.run['gpu_count']} | {num(r.tps_measured)} | "
                   f"{num(r.tps_before)} | {pct(r.tps_error_before)} | {num(r.tps_first)} | {pct(r.tps_error_first)} | "
                   f"{rate_text(r.tps_predicted, r.tps_low)} | {pct(r.tps_error)} | {verdict(r.fits_before)} → {verdict(r.fits_first)} "
                   f"→ {verdict(r.fits)} |")
    return out


def summary(rows: list[Row], key: str, what: str) -> str:
    errs = [(abs(getattr(r, key)), r.run["id"]) for r in rows if getattr(r, key) is not None]
    if not errs:
        return f"- {what}: no runs"
    worst = max(errs)
    return (f"- {what}: mean |error| {statistics.fmean(e for e, _ in errs):.1%}, median "
            f"{statistics.median(e for e, _ in errs):.1%}, worst {worst[0]:.1%} ({worst[1]}), over {len(errs)} runs")


def added_for(rows: list[Row], tag: str) -> list[Row]:
    """The runs added for ``tag``: the runs file's ``added_for`` (its values are the labels of LABEL)."""
    return [r for r in rows if r.run.get("added_for") == tag]


def headline(rows: list[Row]) -> list[str]:
    """The rule-chosen hold-outs' mean |error| as first recorded (the figure the code cannot move)."""
    errs = [abs(r.tps_error_first) for r in added_for(rows, "round 3") if r.tps_error_first is not None]
    if not errs:
        return []
    return [f"rule-chosen hold-outs: mean |error| as first recorded {statistics.fmean(errs):.1%} "
            f"(tokens/s per GPU, {len(errs)} runs chosen by a written rule after the throughput revision, "
            "recorded once before any tuning against them)", ""]


def summaries(rows: list[Row]) -> list[str]:
    out, r3 = headline(rows), added_for(rows, "round 3")
    subsets = (("all runs", rows), ("all held-out runs (†)", [r for r in rows if r.run.get("holdout")]),
               (LABEL["issue 36"], added_for(rows, "issue 36")), (LABEL["round 3"], r3),
               ("runs not held out", [r for r in rows if not r.run.get("holdout")]),
               ("without low-confidence runs", [r for r in rows if "confidence" not in r.run]))
    for label, subset in subsets:
        out += [f"{label}:", ""]  # Markdown needs the blank line before a list
        out.append(summary(subset, "mem_error", "memory now (the kind each source measured)"))
        out.append(summary(subset, "mem_error_before", "memory before"))
        out.append(summary(subset, "tps_error", "tokens/s per GPU now"))
        if any(r.tps_low is not None for r in subset):
            out.append(summary(subset, "tps_error_high", "tokens/s per GPU now, at the catalogue's peak only"))
        out.append(summary(subset, "tps_error_before", "tokens/s per GPU before"))
        if subset is r3:  # only these runs have figures as first recorded
            out.append(summary(subset, "tps_error_first", "tokens/s per GPU as first recorded"))
        false_now = [r.run["id"] for r in subset if r.fits is False]
        false_before = [r.run["id"] for r in subset if r.fits_before is False]
        out.append(f"- false OOM verdicts (the run ran): now {len(false_now)}" + (f" ({', '.join(false_now)})" if false_now else "")
                   + f", before {len(false_before)}" + (f" ({', '.join(false_before)})" if false_before else ""))
        out.append("")
    for r in rows:  # a source that reports an OOM at a larger micro-batch: the formula must say OOM there too
        if r.run["measured"].get("oom_at_micro_batch_2") and r.cfg is not None:
            m = estimate(r.cfg.replace(micro_batch=2)).memory
            out.append(f"- true OOM check, {r.run['id']} at micro-batch 2 (the source: OOM): reserved "
                       f"{m.reserved_bytes / 2**30:.1f} GiB of {m.capacity_bytes / 2**30:.2f} -> "
                       f"{'OOM (agrees)' if not m.fits else 'fits (DISAGREES)'}")
    return out


def range_line(cfg: RunConfig | None, low: float | None, high: float | None) -> list[str]:
    """A run on a card whose peak a source gives only as a range: what the predicted rate spans, and how its error
    is counted."""
    if cfg is None or low is None:
        return []
    return [f"  - peak known only as a range: predicted {num(low)} at {cfg.device_spec.peak_low}'s peak to "
            f"{num(high)} at {cfg.device}'s; error 0 inside the range, else from its nearest end"]


def detail_lines(r, marked: str, source: str, extra: list[str] = ()) -> list[str]:
    """One run's entry under "Commands": its command, source, layer terms, what the command cannot express,
    ``extra`` lines, and why it was not evaluated (any of this script's rows, or the parallel and compiled pages')."""
    out = [f"- **{r.run['id']}**{marked}: `{r.command or 'not typed'}`", f"  - source: {source}"]
    out += [f"  - {r.layer_terms}"] if r.layer_terms else []
    out += range_line(getattr(r, "cfg", None), getattr(r, "tps_low", getattr(r, "rate_low", None)),
                      getattr(r, "tps_predicted", getattr(r, "rate_predicted", None)))
    out += [f"  - not expressed: {g}" for g in r.gaps] + list(extra)
    return out + ([f"  - NOT EVALUATED: {r.failed}"] if r.failed else [])


def details(rows: list[Row]) -> list[str]:
    out = []
    for r in rows:
        published = r.run["measured"].get("published_params")
        extra = ([f"  - parameters: formula {r.params:,} vs published {published:,} "
                  f"({pct(relative_to(r.params, published))})"] if published and r.params else [])
        out += detail_lines(r, mark(r.run), r.run["source"], extra)
    return out


def document(rows: list[Row]) -> str:
    r3 = added_for(rows, "round 3")
    """The page's body (benchmarks/page.py puts the date, machine, torch version and command above it)."""
    lines = ["What `batchlab estimate` predicts for published GPU training runs, typed as a user types them "
             "(each run's command below is parsed by the CLI's own option parsing), beside what the sources "
             "measured. Error = (predicted - measured) / measured; memory is compared with the kind the source "
             "measured (allocated, reserved, or nvidia-smi's device view). *Before*: the same runs with the formula "
             "before its throughput revision (presets by implementation, fused and bandwidth-bound kernels "
             "priced; benchmarks/published_before.toml; torchtitan's runs then went through an hf:llama source). "
             "† marks runs held out (chosen before tuning; never tuned against). The rule-chosen hold-outs were "
             "chosen by a written rule (benchmarks/published_runs.toml) after the throughput revision, and their "
             "figures as first recorded are kept (benchmarks/published_round3_first.toml). Formula only: no GPU "
             "is needed to reproduce it.", "",
             "## Summary", "", *summaries(rows), "", "## Runs", "", *table(rows), "",
             *(["## Rule-chosen hold-outs: before, as first recorded, now", "", *round3_table(r3), ""] if r3 else []),
             "## Commands, sources and what the command cannot express", "", *details(rows), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=Path, default=HERE / "published_runs.toml")
    p.add_argument("--before", type=Path, default=HERE / "published_before.toml")
    p.add_argument("--first", type=Path, default=HERE / "published_round3_first.toml",
                   help="the rule-chosen hold-outs' figures as first recorded (and before the throughput revision)")
    p.add_argument("--only", default="", help="comma-separated run ids (prints; the page is not written)")
    p.add_argument("--derive", action="store_true", help="the achievable fractions the runs not held out imply")
    args = p.parse_args(argv)
    runs = load(args.runs)["run"]
    if args.derive:
        print(derive_document(derive(runs), sum(1 for r in runs if r.get("holdout"))))
        return 0
    before = load_recorded(args.before, args.first)
    if args.only:
        wanted = set(args.only.split(","))
        runs = [r for r in runs if r["id"] in wanted]
        if not runs:
            print(f"--only: no run named {args.only!r}", file=sys.stderr)
            return 2
    print(document([evaluate(r, before) for r in runs]))
    return 0


if __name__ == "__main__":
    import page  # benchmarks/page.py: this script's page of the docs

    if "--derive" in sys.argv:
        page.publish(main, "published-fractions", "Achievable fractions derived from published runs")
    else:
        page.publish(main, "published", "Predicted vs published GPU runs")
