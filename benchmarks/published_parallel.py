"""batchlab's formula beside published tensor / pipeline-parallel and DeepSpeed ZeRO GPU runs, typed as users type.

Reads benchmarks/published_parallel.toml (each run with its source, quote and what the source leaves unstated),
types every run as the ``batchlab estimate`` command its ``cli`` field gives (the device named by the run's GPU
key, benchmarks/published.py's catalogue map), parses it with the CLI's own option parsing
(published.typed_config: cli/common.py ``config_from_command``), calls batchlab.formula.estimate (no torch)
and writes docs/accuracy/published-parallel.md: predicted vs measured memory (the kind and the rank the source
measured: allocated, reserved or device; a source that measured only the last rank is compared with the last
pipeline stage), tokens/s per GPU (or the iteration rate where that is what was published), the error
(predicted - measured) / measured, and the mean and worst |error| for all rows, the rows not held out and the
hold-outs; the DeepSpeed ZeRO rows on their own; and the full-versus-selective recompute time ratios of
Korthikanti et al. 2022.

A row whose source omits an input the prediction needs (``not_typed``) is no point: it says how each figure of
its command bounds the published one (``bound``: "upper", "lower", or "none" where it bounds nothing; one for both
figures or one each, benchmarks/published.py ``bound_of``), is checked as that bound under *Bounds* and stays out
of the means.  A row retyped since its first figures (``retyped``: the command it had and why) shows its figures
under the old command beside today's.

Each row's figures as first recorded, before any mechanism was fixed against these rows, are kept in
benchmarks/published_parallel_first.toml (``--record-first`` appends the rows it does not hold yet and never
rewrites one: the code moves, that column does not).  Hold-outs (every third row, fixed in the runs file before any prediction) are
never tuned against.

    PYTHONPATH=src python benchmarks/published_parallel.py            # -> docs/accuracy/published-parallel.md
    PYTHONPATH=src python benchmarks/published_parallel.py --only mg-h100-gpt7b-tp4-dp2   # prints only
    PYTHONPATH=src python benchmarks/published_parallel.py --record-first   # new rows' first figures, appended
"""
from __future__ import annotations

import argparse
import functools
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from click import ClickException

from batchlab.config import RunConfig
from batchlab.formula import estimate, fp8, implementation_line
from batchlab.formula.flops import flops
from batchlab.util.units import relative_to
from published import (NO_BOUND, PRECISION_GAP, UNITS, bound_cells, bound_of, bounds_table, detail_lines, device_for, gib, load,
                       num, pct, points, range_error, rate_text, summary, typed_config)

HERE = Path(__file__).resolve().parent
FIRST = HERE / "published_parallel_first.toml"
BEFORE_OVERLAP = HERE / "published_parallel_overlap_before.toml"  # each row's rate before formula/overlap.py

# a memory figure whose reading the source does not give is compared with the allocator's reserved bytes, the
# middle of the three readings (allocated <= reserved <= device)
KIND = {"allocated": "allocated", "reserved": "reserved", "device": "device", "unstated": "reserved"}


@dataclass
class ParRow:
    run: dict
    cfg: RunConfig | None = None
    command: str = ""
    gaps: list[str] = field(default_factory=list)
    mem_measured: int | None = None
    mem_predicted: int | None = None
    rate_what: str = "tokens/s per GPU"  # or iterations/s, where that is what the source published
    rate_measured: float | None = None
    rate_predicted: float | None = None
    mem_first: int | None = None
    rate_first: float | None = None
    rate_low: float | None = None  # a card whose peak is known only as a range: the rate at its low end
    rank: str = ""  # which rank's prediction is compared
    layer_terms: str = ""
    failed: str | None = None
    peak_share: float | None = None  # the least share of the card's peak the published rate needs (``least_share``)

    @property
    def impossible(self) -> bool:
        """The published rate needs more than the card's peak under the typed shape: the source's model, sequence or
        timing differs from what the row types, so neither of its figures tests the formula."""
        return self.peak_share is not None and self.peak_share > 1.0

    @property
    def mem_error(self):
        return relative_to(self.mem_predicted, self.mem_measured)

    @property
    def rate_error(self):
        return range_error(self.rate_predicted, self.rate_low, self.rate_measured)

    @property
    def rate_error_high(self):
        """At the card's catalogue peak alone (the high end where the peak is known only as a range)."""
        return relative_to(self.rate_predicted, self.rate_measured)

    @property
    def mem_error_first(self):
        return relative_to(self.mem_first, self.mem_measured)

    @property
    def rate_error_first(self):
        return relative_to(self.rate_first, self.rate_measured)


def _set(argv: list[str], flag: str, value: str | None) -> None:
    """Give ``flag`` the value (added if absent); None removes the flag and its value."""
    if flag in argv:
        i = argv.index(flag)
        del argv[i:i + 2]
    if value is not None:
        argv += [flag, value]


def megatron_code(run: dict) -> bool:
    """Megatron-LM's model code trains the run (Megatron-LM, Megatron-Core, NeMo, Megatron-DeepSpeed)."""
    return "Megatron" in run["engine"] or "NeMo" in run["engine"]


def command_for(run: dict, gaps: list[str], typed: bool = True) -> list[str]:
    """The run's ``cli``, with the flags the runs file's fields decide typed from them: ``--device`` the catalogue
    entry of the run's GPU key; ``--attention``, ``--dropout`` and a fused ``--loss`` from the run's fields; for
    Megatron's code ``--impl megatron``, and for Megatron's own engine its ``--sharding`` (megatron, or megatron-distopt for its
    distributed optimizer) with ``--precision bf16`` (Megatron --bf16 trains the bf16 weights); torchtitan's FSDP
    under a pipeline as ``--zero 2``.  ``typed=False``: the ``cli`` as first recorded (device only).
    What no flag expresses goes to ``gaps``."""
    argv = shlex.split(run["cli"])
    _set(argv, "--device", device_for(run["gpu"]))
    if typed:  # the attention path and dropout the run's fields give (flash attention is the fused, sdpa, path)
        _set(argv, "--attention", "sdpa" if run["attention"] == "flash" else run["attention"])
        if "dropout" in run["model"]:
            _set(argv, "--dropout", f"{run['model']['dropout']:g}")
        if run.get("loss") == "causal-lm-fused-ce":  # Megatron's --cross-entropy-loss-fusion, Liger's fused loss
            _set(argv, "--loss", "fused")
    if typed and megatron_code(run):
        _set(argv, "--impl", "megatron")
        if not run["sharding"].startswith("deepspeed"):
            _set(argv, "--zero", None)
            _set(argv, "--sharding", {"zero1": "megatron-distopt", "ddp": "megatron"}[run["sharding"]])
            if run["precision"] in ("megatron-bf16", "te-fp8"):
                _set(argv, "--precision", "bf16")
    if typed and "torchtitan" in run["engine"] and run["pp"] > 1 and run["sharding"] == "fsdp":
        # torchtitan's apply_fsdp under a pipeline: reshard_after_forward=False ("to avoid per-microbatch
        # all-gathers", torchtitan/parallelisms/parallelize_llama.py @ 9dec370): FSDP2 at ZeRO-2
        _set(argv, "--zero", "2")
    fp8 = "--fp8" in argv and typed  # the run's FP8 recipe typed in its cli (config/fp8.py)
    if not typed:
        _set(argv, "--fp8", None)
    if run["precision"] in PRECISION_GAP and not fp8:
        gaps.append(PRECISION_GAP[run["precision"]])
    if run["precision"] == "te-fp8" and not fp8:
        gaps.append("Transformer Engine FP8 GEMMs (bf16 elsewhere): fp8 matmul rates and the fp8 weight copies not "
                    "modelled; typed as Megatron's bf16")
    if fp8 and run["precision"] == "fp8-float8-linear" and run["tp"] > 1:
        gaps.append("torchao's Float8 tensor parallelism (Float8ColwiseParallel: the sequence-parallel inputs "
                    "all-gathered in fp8) has no flag: the TP collectives are priced in bf16")
    sp = run.get("ulysses_sp", 1)
    if sp > 1 and typed:  # no flag: each of dp x sp ranks holds seq/sp tokens of every activation, ZeRO spans them
        _set(argv, "--dp", str(run["dp"] * sp))
        _set(argv, "--seq", str(run["seq"] // sp))
        gaps.append(f"DeepSpeed-Ulysses sequence parallelism {sp} (all-to-all over heads; each rank holds 1/{sp} "
                    "of the sequence outside attention, and in its fused attention the whole sequence for 1/"
                    f"{sp} of the heads: the same bytes; ZeRO partitions over data x sequence parallel ranks) has "
                    f"no flag: typed as --dp {run['dp'] * sp} --seq {run['seq'] // sp} (the attention's s^2 FLOPs "
                    f"are then {sp}x too few, and the all-to-alls are not priced)")
    elif sp > 1:
        gaps.append(f"DeepSpeed-Ulysses sequence parallelism {sp} has no flag: typed as dp {run['dp']} alone")
    chunks = run["pp"] * run.get("pp_virtual", 1)
    layers = run["model"]["layers"]
    if layers % chunks:  # no flag splits the layers unevenly: type the most loaded stage's share on every stage
        even = -(-layers // chunks) * chunks
        if "--layers" in argv:
            argv[argv.index("--layers") + 1] = str(even)
        else:
            argv += ["--layers", str(even)]
        gaps.append(f"{layers} layers split unevenly over pp x virtual = {chunks} chunks (at most "
                    f"{even // chunks} per chunk); no flag splits unevenly: typed as --layers {even}, every chunk "
                    "holding the most loaded one's layers (the source's memory is the max over ranks; the slowest "
                    "stage paces the pipeline)")
    gaps.extend(run.get("not_expressed", ()))  # what the runs file says the command leaves out
    if typed and (run.get("async_tp") or run.get("tp_overlap") == "async"):  # AsyncTP, NeMo's tp_comm_overlap
        _set(argv, "--tp-overlap", "async")
    if run["sharding"].startswith("deepspeed") and "deepspeed" not in run and "--deepspeed" not in argv:
        gaps.append(f"DeepSpeed config: {run['deepspeed_config']}" if "deepspeed_config" in run
                    else "DeepSpeed config not published: zero_optimization defaults assumed")
    return ["estimate", *argv]


def config_for(run: dict, gaps: list[str]) -> tuple[RunConfig, str]:
    return typed_config(command_for(run, gaps), run, gaps)


def predicted_memory(est, kind: str, last_rank: bool) -> tuple[int, str]:
    """The formula's figure of the source's kind, for the last pipeline stage when the source read only the last
    rank (Megatron logs from rank world-1), else the most loaded rank."""
    m = est.memory
    whole = {"allocated": m.allocated_bytes, "reserved": m.reserved_bytes, "device": m.device_bytes}[kind]
    if not last_rank or len(m.ranks) < 2:
        return whole, "most loaded rank"
    r = m.ranks[-1]
    reserved = r.peak_bytes
    by_kind = {"allocated": reserved - r.parts.get("allocator", 0), "reserved": reserved,
               "device": reserved + m.device_bytes - m.reserved_bytes}
    return by_kind[kind], "last pipeline stage"


def predict(run: dict, cfg: RunConfig) -> tuple[int | None, float | None, str, float | None]:
    """Memory of the measured kind, the rate the source published, the rank compared, and the rate at the low end
    of the card's peak where its source gives the peak only as a range (else None)."""
    est = estimate(cfg)
    measured = run["measured"]
    mem, rank = None, ""
    if "memory_value" in measured:
        mem, rank = predicted_memory(est, KIND[measured["memory_kind"]], "last" in measured.get("memory_rank", ""))
    its = measured.get("tokens_per_s_per_gpu") is None and "iterations_per_s" in measured
    rate_of = (lambda t: 1 / t.update_seconds) if its else (lambda t: t.tokens_per_second / cfg.parallel.world_size)
    low = None if est.low_peak_time is None else rate_of(est.low_peak_time)
    return mem, rate_of(est.time), rank, low


def evaluate(run: dict, first: dict[str, dict]) -> ParRow:
    row = ParRow(run)
    measured = run["measured"]
    if "memory_value" in measured:
        row.mem_measured = int(measured["memory_value"] * UNITS[measured["memory_unit"]])
    row.rate_measured = measured.get("tokens_per_s_per_gpu")
    if row.rate_measured is None and "iterations_per_s" in measured:
        row.rate_what, row.rate_measured = "iterations/s", measured["iterations_per_s"]
    old = first.get(run["id"], {})
    row.mem_first, row.rate_first = old.get("memory_bytes"), old.get("rate")
    try:
        row.cfg, row.command = config_for(run, row.gaps)
    except (ValueError, ClickException) as e:  # a ConfigError or a usage error: the run cannot be typed
        row.failed = str(e)
        return row
    row.mem_predicted, row.rate_predicted, row.rank, row.rate_low = predict(run, row.cfg)
    row.layer_terms = implementation_line(row.cfg)
    row.peak_share = least_share(run, row.cfg)
    return row


def least_share(run: dict, cfg: RunConfig) -> float | None:
    """The least share of one card's dense peak (FP8's where the run's GEMMs are FP8) that the published tokens/s
    per GPU needs: its hardware FLOPs per token at the run's own sequence length (recompute included, PaLM's
    12·L·h·s attention term halved: a causal kernel skips the masked half, the fewest FLOPs any kernel does) times the
    rate.  None where the source published no tokens/s."""
    rate = run["measured"].get("tokens_per_s_per_gpu")
    if rate is None:
        return None
    true = cfg.replace(seq=run["seq"]) if run["seq"] != cfg.seq else cfg  # a typed stand-in (Ulysses) keeps its seq
    f, m = flops(true), true.model
    per_token = f.hardware_flops_per_update / true.tokens_per_update - 6 * m.layers * m.hidden * true.seq
    dev = cfg.device_spec
    peak = dev.peak_flops_fp8 if fp8.active(cfg) is not None else dev.peak_flops(cfg.precision)
    return per_token * rate / peak if peak else None


# ---------------------------------------------------------------- Korthikanti et al. 2022: full vs selective


@dataclass
class Ratio:
    ratio: dict  # the runs file's [[ratio]] entry
    predicted: float | None = None
    first: float | None = None

    @property
    def measured(self) -> float:
        return self.ratio["full_s"] / self.ratio["selective_s"]

    @property
    def error(self):
        return relative_to(self.predicted, self.measured)

    @property
    def error_first(self):
        return relative_to(self.first, self.measured)

    @property
    def run(self) -> dict:  # summary() reads run["id"]
        return {"id": self.ratio["id"]}


def ratio_of(runs: dict[str, dict], entry: dict) -> float:
    """Update time of the paper's baseline (the run's command with ``--ac full --no-sequence-parallel``: Megatron's
    tensor parallelism with full recompute) over the run's own command (sequence parallelism + selective)."""
    run = runs[entry["run"]]
    argv = command_for(run, [])
    base = [a for a in argv if a != "--sequence-parallel"]
    base[base.index("--ac") + 1] = "full"
    full = estimate(typed_config(base + ["--no-sequence-parallel"], run, [])[0]).time.update_seconds
    return full / estimate(typed_config(argv, run, [])[0]).time.update_seconds


# ---------------------------------------------------------------- the page


def mark(run: dict) -> str:
    return " †" if run.get("holdout") else ""


def bound_mark(run: dict) -> str:
    """The runs table's note for a row that is no point (``bound_of``)."""
    bound = bound_of(run)
    return "" if bound is None else " (bound)" if bound != NO_BOUND else " (no point)"


def table(rows: list[ParRow]) -> list[str]:
    out = ["| run | GPU × n | layout | memory measured (kind, rank) | first | error | now | error "
           "| rate measured | first | error | now | error |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r.run["measured"]
        lay = (f"dp{r.run['dp']} tp{r.run['tp']}{'+sp' if r.run.get('sequence_parallel') else ''} pp{r.run['pp']}"
               + (f" {r.run['pp_schedule']}" + (f"×{r.run['pp_virtual']}" if r.run['pp_virtual'] > 1 else "")
                  if r.run["pp"] > 1 else "") + f" {r.run['sharding']}")
        mem = (f"{gib(r.mem_measured)} GiB ({m['memory_kind']}, {r.rank})" if r.mem_measured else "-")
        rate = "-" if r.rate_measured is None else (f"{r.rate_measured:.2f} it/s" if r.rate_what == "iterations/s"
                                                    else f"{num(r.rate_measured)} tok/s")
        f = functools.partial(rate_cell, r)
        out.append(f"| {r.run['id']}{mark(r.run)}{bound_mark(r.run)} | {r.run['gpu']} × {r.run['gpu_count']} | "
                   f"{lay} | {mem} | "
                   f"{gib(r.mem_first) if r.mem_measured else '-'} | {pct(r.mem_error_first)} | "
                   f"{gib(r.mem_predicted) if r.mem_measured else '-'} | {pct(r.mem_error)} | {rate} | "
                   f"{f(r.rate_first)} | {pct(r.rate_error_first)} | "
                   f"{f(r.rate_predicted) if r.rate_low is None else rate_text(r.rate_predicted, r.rate_low)} | "
                   f"{pct(r.rate_error)} |")
    return out


def ratio_table(ratios: list[Ratio]) -> list[str]:
    out = ["| configuration | full recompute s | selective s | measured ratio | first | error | now | error |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for q in ratios:
        first = "-" if q.first is None else f"{q.first:.3f}"
        out.append(f"| {q.ratio['id']}{mark(q.ratio)} | {q.ratio['full_s']} | {q.ratio['selective_s']} | "
                   f"{q.measured:.3f} | {first} | {pct(q.error_first)} | {q.predicted:.3f} | {pct(q.error)} |")
    return out


def subsets(rows):
    return (("all rows", rows), ("rows not held out", [r for r in rows if not r.run.get("holdout")]),
            ("hold-outs (†)", [r for r in rows if r.run.get("holdout")]))


def summaries(rows: list[ParRow], ratios: list[Ratio]) -> list[str]:
    out = []
    deepspeed = [r for r in rows if r.run["sharding"].startswith("deepspeed")]
    groups = (("", rows), ("DeepSpeed ZeRO rows (`--sharding deepspeed-zero*`), ", deepspeed),
              ("other rows (Megatron, NeMo, Megatron-Bridge, torchtitan), ", [r for r in rows if r not in deepspeed]))
    for prefix, group in groups:
        for label, subset in subsets(group):
            mem, rate = points(subset, "memory"), points(subset, "rate")  # each figure's means over its points
            out += [f"{prefix}{label}:", ""]  # Markdown needs the blank line before a list
            out.append(summary(mem, "mem_error", "memory now (the kind and rank each source measured)"))
            out.append(summary(mem, "mem_error_first", "memory as first recorded"))
            out.append(summary(rate, "rate_error", "throughput now"))
            if any(r.rate_low is not None for r in rate):
                out.append(summary(rate, "rate_error_high", "throughput now, at the catalogue's peak only"))
            out.append(summary(rate, "rate_error_first", "throughput as first recorded"))
            if any(r.impossible for r in mem + rate):
                out.append(summary([r for r in mem if not r.impossible], "mem_error",
                                   "memory now, rows whose rate the card can reach"))
                out.append(summary([r for r in rate if not r.impossible], "rate_error",
                                   "throughput now, rows whose rate the card can reach"))
            out.append("")
    for label, subset in (("Korthikanti full/selective time ratio, all", ratios),
                          ("not held out", [q for q in ratios if not q.ratio.get("holdout")]),
                          ("hold-outs (†)", [q for q in ratios if q.ratio.get("holdout")])):
        out += [f"{label}:", "", summary(subset, "error", "ratio now"),
                summary(subset, "error_first", "ratio as first recorded"), ""]
    return out


def _mean(rows: list[ParRow], key: str) -> str:
    errs = [abs(getattr(r, key)) for r in rows if getattr(r, key) is not None]
    return "-" if not errs else f"{sum(errs) / len(errs):.1%} ({len(errs)})"


def family_table(rows: list[ParRow]) -> list[str]:
    """Mean |error| (rows) per source family (the id's first word), first recorded and now, hold-outs apart."""
    out = ["| family | rows | memory first | memory now | throughput first | throughput now |",
           "|---|---|---:|---:|---:|---:|"]
    mem, rate = points(rows, "memory"), points(rows, "rate")
    for family in dict.fromkeys(r.run["id"].split("-")[0] for r in mem + rate):
        for held, label in ((False, "not held out"), (True, "hold-outs †")):
            pick = lambda rs: [r for r in rs if r.run["id"].split("-")[0] == family  # noqa: E731
                               and bool(r.run.get("holdout")) == held]
            m, t = pick(mem), pick(rate)
            if m or t:
                out.append(f"| {family} | {label} | {_mean(m, 'mem_error_first')} | {_mean(m, 'mem_error')} | "
                           f"{_mean(t, 'rate_error_first')} | {_mean(t, 'rate_error')} |")
    return out


def parts_table(rows: list[ParRow]) -> list[str]:
    """Where each row's predicted update time goes, beside the update time the source's rate implies: the slowest
    stage's compute, its tensor-parallel collectives and pipeline sends, the bubble, the data-parallel traffic left
    exposed, and the optimizer step with the rest; the matmul and launch shares of the replica's priced ops."""
    out = ["| run | measured s | predicted s | compute | TP comm | PP sends | bubble | DP exposed | step + rest "
           "| matmul share | launch-bound share | published rate's least share of peak |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.failed or r.rate_measured is None:
            continue
        t = estimate(r.cfg).time
        tokens = r.cfg.tokens_per_update
        measured = (1 / r.rate_measured if r.rate_what == "iterations/s"
                    else tokens / (r.rate_measured * r.cfg.parallel.world_size))
        ops = t.ops
        launch = ops.by_class.get("dispatch", 0.0) / ops.seconds if ops and ops.seconds else 0.0
        matmul = ops.by_class.get("matmul", 0.0) / ops.seconds if ops and ops.seconds else 0.0
        cells = [t.compute_seconds, t.tp_comm_seconds, t.pp_comm_seconds, t.bubble_seconds, t.exposed_comm_seconds,
                 t.optimizer_seconds]
        least = "-" if r.peak_share is None else f"{r.peak_share:.0%}" + (" (above the peak)" if r.impossible else "")
        out.append(f"| {r.run['id']}{mark(r.run)} | {measured:.3g} | {t.update_seconds:.3g} | "
                   + " | ".join(f"{c:.3g}" for c in cells) + f" | {matmul:.0%} | {launch:.0%} | {least} |")
    return out


def rate_cell(r: ParRow, x: float | None) -> str:
    return ("-" if x is None else f"{x:.2f}") if r.rate_what == "iterations/s" else num(x)


def bounds(rows: list[ParRow]) -> list[str]:
    """Each row that is no point: the check each of its figures must pass and whether it holds, then why."""
    def cell(r: ParRow, x: float | None, measured: bool) -> str:
        unit = "" if x is None or not measured else " it/s" if r.rate_what == "iterations/s" else " tok/s"
        return rate_cell(r, x) + unit

    return bounds_table(rows, lambda r: (r.rate_predicted, r.rate_measured), cell, "rate")


def retypes(rows: list[ParRow], first: dict[str, dict]) -> list[str]:
    """Rows retyped since their first figures: the old command's figures (as a point) beside today's."""
    out = ["| run | what changed | memory measured GiB | before | error | now | error or check "
           "| rate measured | before | error | now | error or check |",
           "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]

    def now(r: ParRow, figure: str, predicted, measured, error) -> str:
        if bound_of(r.run) is None:
            return pct(error)
        check, held = bound_cells(r.run, figure, predicted, measured)
        return "no point" if check == "-" else f"{check}: {held}"

    for r in rows:
        if "retyped" not in r.run:
            continue
        old_run = {k: v for k, v in r.run.items() if k not in ("not_typed", "bound", "retyped")}
        old = evaluate(dict(old_run, cli=r.run["retyped"].get("cli", r.run["cli"])), first)  # no cli: the same command
        out.append(f"| {r.run['id']}{mark(r.run)} | {r.run['retyped']['why']} | {gib(r.mem_measured)} | "
                   f"{gib(old.mem_predicted)} | {pct(old.mem_error)} | {gib(r.mem_predicted)} | "
                   f"{now(r, 'memory', r.mem_predicted, r.mem_measured, r.mem_error)} | "
                   f"{rate_cell(r, r.rate_measured)} | {rate_cell(r, old.rate_predicted)} | {pct(old.rate_error)} | "
                   f"{rate_cell(r, r.rate_predicted)} | {now(r, 'rate', r.rate_predicted, r.rate_measured, r.rate_error)} |")
    return out if len(out) > 2 else ["No row was retyped."]


def overlap_section(rows: list[ParRow]) -> list[str]:
    """The rows whose predicted rate moved when the formula learned what the runs overlap (``--tp-overlap async``
    typed where the source sets it; pipeline sends hidden where the schedule's runtime posts them asynchronously):
    each row's error before (benchmarks/published_parallel_overlap_before.toml, written once) and after."""
    before = {r["id"]: r["rate"] for r in load(BEFORE_OVERLAP).get("run", [])} if BEFORE_OVERLAP.exists() else {}
    out = ["Rows whose predicted rate moved (by more than 0.1%) when the command learned `--tp-overlap async` "
           "(typed where the source sets TP communication overlap: NeMo's `tp_comm_overlap=True`, torchtitan's "
           "AsyncTP) and the formula the pipeline sends a schedule's runtime overlaps (Megatron's interleaved "
           "`overlap_p2p_comm`, torch's GPipe and interleaved runtime; formula/overlap.py). *Before*: the same "
           "command's prediction just before (without the flag), from benchmarks/published_parallel_overlap_before"
           ".toml; the *first* column of the runs table stays as first recorded.", "",
           "| run | what moved it | rate measured | before | error | after | error |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        old = before.get(r.run["id"])
        if not old or r.rate_predicted is None or abs(r.rate_predicted / old - 1) <= 1e-3:
            continue
        why = ["retyped: --tp-overlap async"] if "--tp-overlap" in r.command else []
        if r.cfg.parallel.pipelined and r.cfg.parallel.schedule_spec.overlaps_sends:
            why.append(f"{r.cfg.parallel.schedule.value} sends overlapped")
        out.append(f"| {r.run['id']}{mark(r.run)} | {'; '.join(why) or 'formula'} | {rate_cell(r, r.rate_measured)} | "
                   f"{rate_cell(r, old)} | {pct(relative_to(old, r.rate_measured))} | {rate_cell(r, r.rate_predicted)} | "
                   f"{pct(r.rate_error)} |")
    pairs = [(a, b) for a in rows for b in rows if a.run["cli"] == b.run["cli"] and a.rate_predicted and b.rate_predicted
             and "--tp-overlap" not in a.command and "--tp-overlap" in b.command]
    if pairs:  # the same run measured with and without the overlap: the gain itself, apart from the rest of the time
        out += ["", "The same run measured without and with the overlap (the source's own pair, everything else equal): "
                "the measured gain beside the predicted one.", "",
                "| without | with | measured with / without | predicted with / without |", "|---|---|---:|---:|"]
        out += [f"| {a.run['id']} | {b.run['id']} | {b.rate_measured / a.rate_measured:.3f} | "
                f"{b.rate_predicted / a.rate_predicted:.3f} |" for a, b in pairs]
    return out


def details(rows: list[ParRow]) -> list[str]:
    return [line for r in rows for line in detail_lines(r, mark(r.run), r.run["source"])]


def document(rows: list[ParRow], ratios: list[Ratio], first: dict[str, dict] | None = None) -> str:
    lines = ["What `batchlab estimate` predicts for published runs with tensor, sequence and pipeline parallelism "
             "and with DeepSpeed ZeRO (benchmarks/published_parallel.toml), typed as a user types them (each "
             "command below is parsed by the CLI's own option parsing), beside what the sources measured. "
             "Error = (predicted - measured) / measured. Memory is compared with the kind the source measured "
             "(allocated, reserved, or nvidia-smi's device view; a figure whose reading the source does not give "
             "with reserved) and with the rank it measured (Megatron's logs come from the last rank: its last "
             "pipeline stage). Throughput is tokens/s per GPU (derived from the published iteration time or MFU, "
             "as each row's source says), or iterations/s where only that was published. † marks hold-outs: "
             "every third row, fixed before any prediction, never tuned against. *First*: each row as first "
             "recorded, before any mechanism was fixed against these rows (benchmarks/published_parallel_first.toml, "
             "never regenerated). A row whose source omits an input the prediction needs is no point: it is checked "
             "under *Bounds* as the bound its command gives (or as none) and left out of every mean; where what it "
             "omits moves one figure only (the Megatron functional tests' per-iteration logging moves their rate, "
             "not their memory), the other figure stays a point. Where a card's peak is known only as a range "
             "(torchtitan's H100 96GB: 'between SXM and NVL, and we don't know its exact value'), the predicted "
             "rate is that range and its error 0 inside it, else from its nearest end; the summary also gives the "
             "error at the catalogue's peak alone. Formula only: no GPU is needed to reproduce it.", "",
             "## Summary", "", *summaries(rows, ratios),
             "Mean |error| (rows) per source family: mg Megatron-LM's functional tests, tt torchtitan's benchmarks, "
             "nemo NeMo's performance table, mb Megatron-Bridge's performance summary, qwen Qwen's fine-tuning "
             "profile and swift ms-swift's example scripts (DeepSpeed ZeRO-3), korthikanti and megatron the "
             "Megatron-LM README (rows that are points; the Megatron-DeepSpeed, BELLE and GLM-4 rows and four of the "
             "ms-swift ones are under *Bounds*).", "", *family_table(rows), "",
             "## Runs", "", *table(rows), "",
             "## Bounds", "", *bounds(rows), "",
             "## Retyped rows", "",
             "Rows whose command changed since their first figures: the figures the old command gives today (as a "
             "point: its error) beside the new command's (its error, or the check it passes as a bound).", "",
             *retypes(rows, first or {}), "",
             "## Communication the runs overlap: rows it moved", "", *overlap_section(rows), "",
             "## Where the predicted update time goes", "",
             "Seconds per update on the slowest pipeline stage's rank: its compute (forward, backward, recompute of "
             "all micro-batches; a tensor-parallel rank runs 1/t of each kernel's work but launches every kernel), its "
             "tensor-parallel collectives and pipeline sends (what the GEMMs and the schedule leave exposed: "
             "formula/overlap.py), the bubble, the data-parallel traffic "
             "the engine leaves exposed, and the optimizer step with the rest. *Measured*: the update time the "
             "source's rate implies. The shares are of the replica's priced ops: matmuls, and the host's launches "
             "beyond the kernels' work (GPU kernels are issued ahead of their work). *Least share of peak*: the "
             "published tokens/s per GPU times the fewest hardware FLOPs per token the typed shape needs at the "
             "run's own sequence length (recompute included, the causal half of attention skipped), over the card's "
             "dense peak (FP8's for FP8 GEMMs): above 100% no kernel could reach the published rate, so the source's "
             "model, sequence or timing is not what the row types and neither of its figures tests the formula; the "
             "summary gives the rows the card can reach apart.", "", *parts_table(rows), "",
             "## Full versus selective recompute (Korthikanti et al. 2022, Table 5)", "",
             "Update time of the paper's baseline (the run's command with `--ac full --no-sequence-parallel`: "
             "tensor parallelism with full recompute) over the run's own command (sequence parallelism + "
             "`--ac megatron-selective`, the paper's 'present work'). The measured times are the paper's Table 5, "
             "first recalled and then checked against an independent quote of the table: Calculon's validation "
             "(calculon-ai/calculon calculon/llm/validation.py @ 2dd9c5c8, `seqsel_tab5`) gives the same eight "
             "times. The paper's own text was not in the stored sources, nor was its Table 4 (per-layer forward, "
             "backward and recompute times), which is therefore not compared here. Calculon's execution files for "
             "these runs use micro-batch 4 for 22B and 3 interleaved stages for 175B and 530B where the commands "
             "here use micro-batch 1 and plain 1F1B: the paper's Table 3 decides, and it was not read.", "", *ratio_table(ratios), "",
             "## Commands, sources and what the command cannot express", "", *details(rows), ""]
    return "\n".join(lines)


def record_first(rows: list[ParRow], ratios: list[Ratio], path: Path) -> None:
    """Write each row's first figures once: a row (or ratio) already in ``path`` keeps its figures, rows added to
    the runs file since are appended (their first figures are recorded when they are first predicted)."""
    had_runs, had_ratios = load_first(path)
    rows = [r for r in rows if r.run["id"] not in had_runs]
    ratios = [q for q in ratios if q.ratio["id"] not in had_ratios]
    if not rows and not ratios:
        raise SystemExit(f"{path}: every row has its first figures already; they are never regenerated")
    lines = [""] if path.exists() else [
        "# Each row's figures as first recorded by benchmarks/published_parallel.py --record-first, before any",
        "# mechanism was fixed against benchmarks/published_parallel.toml (hold-outs included). Never regenerated;",
        "# rows added to the runs file later are appended when first predicted.", ""]
    for r in rows:
        lines += ["[[run]]", f'id = "{r.run["id"]}"']
        if r.mem_predicted is not None:
            lines.append(f"memory_bytes = {r.mem_predicted}")
            lines.append(f"memory_error = {r.mem_error:.4f}")
        if r.rate_predicted is not None:
            lines.append(f"rate = {r.rate_predicted:.6g}")
            if r.rate_error is not None:
                lines.append(f"rate_error = {r.rate_error:.4f}")
        lines.append("")
    for q in ratios:
        lines += ["[[ratio]]", f'id = "{q.ratio["id"]}"', f"ratio = {q.predicted:.6g}", f"error = {q.error:.4f}", ""]
    with path.open("a") as out:
        out.write("\n".join(lines))
    print(f"{path}: first figures of {len(rows)} run(s) and {len(ratios)} ratio(s) appended", file=sys.stderr)


def load_first(path: Path) -> tuple[dict[str, dict], dict[str, float]]:
    if not path.exists():
        return {}, {}
    data = load(path)
    return {r["id"]: r for r in data.get("run", [])}, {q["id"]: q["ratio"] for q in data.get("ratio", [])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=Path, default=HERE / "published_parallel.toml")
    p.add_argument("--first", type=Path, default=FIRST)
    p.add_argument("--only", default="", help="comma-separated run ids (prints; the page is not written)")
    p.add_argument("--record-first", action="store_true",
                   help="append to --first the rows it does not hold yet (never rewrites a recorded row)")
    args = p.parse_args(argv)
    data = load(args.runs)
    runs = data["run"]
    first, first_ratio = ({}, {}) if args.record_first else load_first(args.first)
    if args.only:
        wanted = set(args.only.split(","))
        runs = [r for r in runs if r["id"] in wanted]
        if not runs:
            print(f"--only: no run named {args.only!r}", file=sys.stderr)
            return 2
    by_id = {r["id"]: r for r in data["run"]}
    ratios = [] if args.only else [Ratio(q, ratio_of(by_id, q), first_ratio.get(q["id"]))
                                   for q in data.get("ratio", [])]
    rows = [evaluate(r, first) for r in runs]
    if args.record_first:
        record_first(rows, ratios, args.first)
    print(document(rows, ratios, first))
    return 0


if __name__ == "__main__":
    import page  # benchmarks/page.py: this script's page of the docs

    page.publish(main, "published-parallel", "Predicted vs published tensor / pipeline-parallel and DeepSpeed runs")
