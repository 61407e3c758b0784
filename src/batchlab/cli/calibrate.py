"""``batchlab calibrate``: measure what the per-op time model needs on a local device, and cache it."""
from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from batchlab.cli.base import app
from batchlab.cli.common import console, fail, print_json
from batchlab.cli.progress import progress
from batchlab.config import ConfigError
from batchlab.formula.calibration import loaded
from batchlab.formula.opcost import link_text
from batchlab.util.units import fmt_bytes, fmt_count


@app.command("calibrate", short_help="Measure the time model's per-op rates on a local device and cache them.")
def calibrate(
    torch_device: Annotated[str, typer.Option(help="Local torch device to measure: cpu, cuda, cuda:1, mps.")] = "cpu",
    seconds: Annotated[float, typer.Option(help="About how long to measure (>= 1 s; 10 s gives steady curves).")] = 10.0,
    threads: Annotated[Optional[int], typer.Option(help="CPU intra-op threads to measure at (CPU rates scale with them; compare measures at 1). Default: what a process here starts with.")] = None,
    save: Annotated[bool, typer.Option("--save/--no-save", help="Cache the result for the time model.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
):
    """Measure the per-op time model's parameters on a local device: matmul FLOP/s by call size (fp32, bf16),
    element-wise bandwidth by size, per-element kernels (activations, softmax, norms, dropout RNG) and the
    fixed cost per op (forward, backward, plain); cached per device, torch version and thread count.
    Estimates, measure and compare for that device then price their ops with these measured rates."""
    from batchlab import calibrate as cal_mod
    from batchlab.calibrate import calls
    from batchlab.calibrate.run import Rejected, checked, measuring_device

    if not 1 <= seconds <= 600:  # NaN fails this too; under 1 s the shape classes are not all measured
        fail(f"seconds: must be between 1 and 600, got {seconds:g}")
    if threads is not None and threads < 1:
        fail(f"threads: must be >= 1, got {threads}")
    try:
        with measuring_device(torch_device, threads), progress(
                "calibrate", f"matmul curves, bandwidth, kernels and dispatch on {torch_device}, about "
                             f"{2.4 * seconds:.0f} s", quiet=as_json):
            cal = checked(lambda: cal_mod.measure(torch_device, seconds=seconds, threads=threads))
            path = cal_mod.save(cal) if save else None
    except ConfigError as e:
        fail(str(e))
    except Rejected as e:  # not the user's input: the machine measured nonsense twice
        fail(f"the calibration failed its checks twice and was not cached: {e}", code=1)
    if as_json:
        print_json({**cal.to_dict(), "cache_path": str(path) if path else None})
        return
    out = console()
    out.print(f"[bold]batchlab calibrate[/]  {cal.hardware} ({cal.torch_device}), torch {cal.torch_version}, "
              f"{cal.threads} thread(s), measured in {cal.seconds:.1f} s ({_statistic(cal)})")
    table = Table(show_header=True, header_style="bold")
    for col in ("what the time model prices", "measured", "how"):
        table.add_column(col)
    for key, pts in cal.matmul_curve.items():
        kind, _, dtype = key.rpartition("-")
        rates = " · ".join(fmt_count(r, "FLOP/s") for _, r in pts)
        span = f"{fmt_count(pts[0][0], 'FLOP')} … {fmt_count(pts[-1][0], 'FLOP')}"
        if kind.startswith("sdpa"):  # per (batch, head) entry, plus its cost per call
            starts = " · ".join(f"{t * 1e6:.0f} µs" for _, t in cal.matmul_start.get(key, ()))
            table.add_row(f"fused attention {'backward' if kind.endswith('backward') else 'forward'}, {dtype}",
                          rates + (f"; + {starts} a call" if starts else ""),
                          f"per (batch, head) entry, by its forward FLOPs {span}")
            continue
        what = "attention's batched matmuls" if kind == "bmm" else "linear layers' matmuls"
        table.add_row(f"{what}, {dtype}", rates, f"by call size {span}")
    for tag, curve in (("fp32", cal.memory_curve), ("bf16", cal.memory_curve_bf16)):
        if curve:
            table.add_row(f"element-wise bandwidth, {tag}", " · ".join(fmt_count(r, "B/s") for _, r in curve),
                          "add, by bytes per call " + " · ".join(fmt_bytes(b) for b, _ in curve))
    table.add_row("strided copy", fmt_count(cal.strided_bytes_per_s, "B/s"), "a transposed activation made contiguous")
    for key, s in cal.element_seconds.items():
        table.add_row(f"per element: {key}", f"{s * 1e9:.2f} ns", "representative kernel")
    for kind, s in cal.dispatch_seconds.items():
        own = kind in (*calls.GRAPH, *calls.CHECKPOINT)  # a region's own call (calibrate/calls.py), not an op's
        table.add_row(f"per {'call' if own else 'op'}: {kind}", f"{s * 1e6:.1f} µs",
                      "a tiny graph or checkpointed chain against eager" if own else
                      "updates of a dispatch-bound 2-layer GPT")
    for kind, s in cal.dispatch_seconds_autocast.items():
        table.add_row(f"per op under autocast: {kind}", f"{s * 1e6:.1f} µs", "the same in bf16-mixed (mixed precisions)")
    for kind, f in cal.contention.items():
        table.add_row(f"local ranks at once: {kind}", f"x{f:.2f}",
                      f"CPU s per call, {cal.contention_processes} processes at once over one alone")
    if cal.loopback_bytes_per_s:
        table.add_row("local ranks' all-reduce", f"{link_text(cal.loopback_bytes_per_s)} + "
                      f"{cal.loopback_latency_s * 1e6:.0f} µs per message", cal.link + " (ring model fit)")
        table.add_row("local ranks' spread", f"{cal.rank_skew:+.1%}",
                      "the slower of 2 ranks over their mean, the same matmuls between all-reduces")
    if cal.probe_seconds:
        table.add_row("host speed probe", f"{cal.probe_seconds * 1e3:.2f} ms",
                      "the bundle measure and compare read before each timed update")
    out.print(table)
    out.print("Measured rates are what kernels of each size reach: no achievable fraction is applied on top.")
    if path:
        out.print(f"cached for device {cal.device!r} at {cal.threads} thread(s): {path}", markup=False, highlight=False)
    if loaded(cal):
        out.print(f"[yellow]warning:[/] other processes kept {cal.other_cores:.1f} core(s) busy while it was measured "
                  "(wall-clock at several threads): every rate carries that load; measure and compare will measure "
                  "again")


def _statistic(cal) -> str:
    # calibrate/kernels.py: CPU seconds at one CPU thread (medians), else wall-clock (upper quartiles)
    from batchlab.calibrate.run import ROUNDS

    if cal.torch_device.startswith("cpu") and cal.threads == 1:
        return f"thread CPU time, medians of the samples over {ROUNDS} rounds"
    return f"wall-clock, upper quartiles of the samples, medians over {ROUNDS} rounds"
