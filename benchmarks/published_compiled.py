"""batchlab's formula beside published GPU training runs with torch.compile (and their eager twins).

Reads benchmarks/published_compiled.toml, whose every run carries the full ``batchlab estimate`` flags (``cli``),
parses them with the CLI's own option parsing, calls batchlab.formula.estimate (no torch) and writes
docs/accuracy/published-compiled.md: each run's command, memory (the kind its source measured) and tokens/s per GPU
predicted vs published, and the mean |error| over all runs, the runs not held out and the hold-outs.  A run whose
source omits an input the prediction needs (``not_typed``) is typed at the setting that bounds it and says which way
(``bound = "upper"``: the command's run needs at least the memory and reaches at least the tokens/s of the real one);
it is no point and stays out of the means: the page checks its bound instead.  Hold-outs
(``holdout = true``: every third run in file order, fixed before any prediction) are never tuned against.  Each
run's errors as first computed are kept in benchmarks/published_compiled_first.toml (``--record-first`` appends
each new run's once; the page shows them beside today's).

    PYTHONPATH=src python benchmarks/published_compiled.py
"""
from __future__ import annotations

import argparse
import shlex
import statistics
from pathlib import Path

from click import ClickException

from published import (UNITS, Row, bound_of, bounds_table, detail_lines, gib, load, num, pct, points,
                       rate_text)  # benchmarks/published.py: the same rows, units and figures

from batchlab.cli.common import config_from_command
from batchlab.formula import compiled_note, estimate, implementation_line

HERE = Path(__file__).resolve().parent
RUNS, FIRST = HERE / "published_compiled.toml", HERE / "published_compiled_first.toml"
GAPS = {  # run fields (the toml's own vocabulary), the flag that expresses each, and the gap where a row lacks it
    "optimizer_in_backward": ("--optimizer-in-backward",
                              "optimizer step fused into backward (torchtune optimizer_in_bwd): not typed"),
    "activation_offloading": ("--offload-activations",
                              "activation offloading to CPU (torchtune enable_activation_offloading): not typed"),
}


def evaluate(run: dict) -> Row:
    row = Row(run)
    measured = run["measured"]
    if "memory_value" in measured:
        row.mem_measured = int(measured["memory_value"] * UNITS[measured["memory_unit"]])
    row.tps_measured = measured.get("tokens_per_s_per_gpu")
    flags = shlex.split(run["cli"])
    row.gaps += [text for field, (flag, text) in GAPS.items() if run.get(field) and flag not in flags]
    row.gaps += run.get("not_typed", [])  # what the source does not give, so no flag can say it
    row.gaps += run.get("not_expressed", [])  # what the source gives but no flag can say (the row stays a point)
    if run["optimizer"] != "adamw" and run["optimizer"] not in flags:
        row.gaps.append(f"optimizer {run['optimizer']}: not typed (AdamW's time)")
    argv = ["estimate", *shlex.split(run["cli"])]
    row.command = "batchlab " + shlex.join(argv)
    try:
        row.cfg = config_from_command(argv)
    except (ValueError, ClickException) as e:
        row.failed = str(e)
        return row
    if (note := compiled_note(row.cfg)) is not None:
        row.gaps.append(note)
    est = estimate(row.cfg)
    kind = measured.get("memory_kind")
    if kind is not None:
        row.mem_predicted = {"allocated": est.memory.allocated_bytes, "reserved": est.memory.reserved_bytes,
                             "device": est.memory.device_bytes}[kind]
    row.fits = est.memory.fits
    row.tps_predicted = est.time.tokens_per_second / row.cfg.parallel.world_size  # per GPU: TP and PP ranks too
    if est.low_peak_time is not None:  # the card's peak is known only as a range
        row.tps_low = est.low_peak_time.tokens_per_second / row.cfg.parallel.world_size
    row.layer_terms = implementation_line(row.cfg)
    return row


def first_errors() -> dict[str, dict]:
    return {r["id"]: r for r in load(FIRST)["run"]} if FIRST.exists() else {}


def record_first(rows: list[Row]) -> None:
    """The errors of every run not yet recorded, as first computed, before anything is changed against them:
    appended once per run, a recorded run never rewritten."""
    known = first_errors()
    new = [r for r in rows if r.run["id"] not in known]
    if not new:
        raise SystemExit(f"{FIRST.name}: every run's first errors are recorded already (they are recorded once)")
    lines = [""] if FIRST.exists() else [
        "# Each run's errors as first computed by benchmarks/published_compiled.py, before any change made against",
        "# the published figures; appended once per run (--record-first), never regenerated.", ""]
    for r in new:
        lines += ["[[run]]", f"id = {r.run['id']!r}", f"holdout = {str(bool(r.run.get('holdout'))).lower()}"]
        lines += [f"memory_error = {r.mem_error:.4f}"] if r.mem_error is not None else []
        lines += [f"tokens_per_s_error = {r.tps_error:.4f}"] if r.tps_error is not None else []
        lines.append("")
    with FIRST.open("a") as f:
        f.write("\n".join(lines) + "\n")


def mean_abs(values) -> str:
    v = [abs(x) for x in values if x is not None]
    return f"{statistics.fmean(v):.1%} over {len(v)} runs" if v else "no runs"


def summary(rows: list[Row]) -> list[str]:
    first = first_errors()
    rows = points(rows)
    subsets = (("all runs", rows), ("runs not held out", [r for r in rows if not r.run.get("holdout")]),
               ("hold-outs (†)", [r for r in rows if r.run.get("holdout")]))
    out = ["| runs | memory: mean \\|error\\| | as first computed | tokens/s per GPU: mean \\|error\\| | as first computed |",
           "|---|---|---|---|---|"]
    for label, subset in subsets:
        f = [first.get(r.run["id"], {}) for r in subset]
        out.append(f"| {label} | {mean_abs(r.mem_error for r in subset)} | "
                   f"{mean_abs(x.get('memory_error') for x in f)} | {mean_abs(r.tps_error for r in subset)} | "
                   f"{mean_abs(x.get('tokens_per_s_error') for x in f)} |")
    out += ["", "Where a card's peak is known only as a range (the H100 96GB of torchtitan's benchmarks: 'between SXM "
            "and NVL, and we don't know its exact value'), the prediction is the range between the two peaks and its "
            "error 0 inside it, else from its nearest end. At the catalogue's (SXM) peak alone, tokens/s per GPU: "
            + "; ".join(f"{label} {mean_abs(r.tps_error_high for r in subset)}" for label, subset in subsets) + "."]
    return out


def by_card(rows: list[Row]) -> list[str]:
    """Per published GPU, over the runs that are points: the mean signed error beside the mean |error|, so a
    bias the card shares across engines and models shows as one sign."""
    signed = lambda v: f"{statistics.fmean(v):+.1%}" if v else "-"  # noqa: E731
    out = ["| GPU | runs | memory: mean error | mean \\|error\\| | tokens/s: mean error | mean \\|error\\| |",
           "|---|---:|---:|---:|---:|---:|"]
    for gpu in dict.fromkeys(r.run["gpu"] for r in points(rows)):
        subset = [r for r in points(rows) if r.run["gpu"] == gpu]
        mem = [r.mem_error for r in subset if r.mem_error is not None]
        tps = [r.tps_error for r in subset if r.tps_error is not None]
        out.append(f"| {gpu} | {len(subset)} | {signed(mem)} | {mean_abs(mem).split(' over')[0]} | {signed(tps)} | "
                   f"{mean_abs(tps).split(' over')[0]} |")
    return out


def table(rows: list[Row]) -> list[str]:
    first = first_errors()
    out = ["| run | compile | GPU × n | memory measured (kind) | predicted | error | first | tok/s/GPU measured | "
           "predicted | error | first |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        kind = r.run["measured"].get("memory_kind")
        f = first.get(r.run["id"], {})
        mem = f"{gib(r.mem_measured)} GiB ({kind})" if r.mem_measured else "-"
        mark = (" †" if r.run.get("holdout") else "") + (" (bound)" if bound_of(r.run) else "")
        out.append(f"| {r.run['id']}{mark} | {r.run['compile']} | {r.run['gpu']} × "
                   f"{r.run['gpu_count']} | {mem} | {gib(r.mem_predicted) if r.mem_measured else '-'} | "
                   f"{pct(r.mem_error)} | {pct(f.get('memory_error'))} | {num(r.tps_measured)} | "
                   f"{rate_text(r.tps_predicted, r.tps_low)} | {pct(r.tps_error)} | {pct(f.get('tokens_per_s_error'))} |")
    return out


def bounds(rows: list[Row]) -> list[str]:
    """Each bound's check, memory and tokens/s, with what the source left out."""
    return bounds_table(rows, lambda r: (r.tps_predicted, r.tps_measured), lambda r, x, measured: num(x), "tok/s/GPU")


def twins(rows: list[Row]) -> list[str]:
    """Compiled vs eager pairs: the published ratio beside the predicted one."""
    by_id = {r.run["id"]: r for r in rows}
    out = ["| compiled run | eager twin | memory ratio published | predicted | tokens/s ratio published | predicted |",
           "|---|---|---:|---:|---:|---:|"]
    ratio = lambda a, b: f"{a / b:.3f}" if a and b else "-"  # noqa: E731
    for r in rows:
        t = by_id.get(r.run.get("twin", ""))
        if r.run["compile"] == "none" or t is None or t.run["compile"] != "none":
            continue
        out.append(f"| {r.run['id']} | {t.run['id']} | {ratio(r.mem_measured, t.mem_measured)} | "
                   f"{ratio(r.mem_predicted, t.mem_predicted)} | {ratio(r.tps_measured, t.tps_measured)} | "
                   f"{ratio(r.tps_predicted, t.tps_predicted)} |")
    return out


def details(rows: list[Row]) -> list[str]:
    return [line for r in rows
            for line in detail_lines(r, " †" if r.run.get("holdout") else "", f"{r.run['source']}: “{r.run['quote']}”")]


def document(rows: list[Row]) -> str:
    return "\n".join([
        "What `batchlab estimate` predicts for published GPU training runs with `torch.compile` (and their eager "
        "twins), typed as a user types them (each command below is parsed by the CLI's own option parsing), beside "
        "what the sources measured. Error = (predicted - measured) / measured; memory is compared with the kind the "
        "source measured. † marks the hold-outs: every third run in file order, fixed before any prediction and "
        "never tuned against. *First*: each run's error as first computed (benchmarks/published_compiled_first.toml). "
        "A run whose source omits an input the prediction needs is typed at the setting that bounds it: it is listed "
        "under *Bounds*, checked there, and left out of the means. Formula only: no GPU is needed to reproduce it.", "",
        "## Summary", "", *summary(rows), "", "By the GPU the source ran on (all runs that are points):", "",
        *by_card(rows), "", "## Runs", "", *table(rows), "",
        "## Bounds", "", *bounds(rows), "",
        "## Compiled against eager", "", *twins(rows), "",
        "## Commands, sources and what the command cannot express", "", *details(rows), ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--record-first", action="store_true",
                   help="append the first errors of runs not yet recorded (once per run, before any tuning)")
    args = p.parse_args(argv)
    rows = [evaluate(r) for r in load(RUNS)["run"]]
    if args.record_first:
        record_first(rows)
    print(document(rows))
    return 0


if __name__ == "__main__":
    import page  # benchmarks/page.py

    page.publish(main, "published-compiled", "Predicted vs published GPU runs with torch.compile")
