"""``batchlab calibrate``: measure this device's matmul FLOP/s and memory bandwidth, and cache them."""
from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from batchlab.cli.base import app
from batchlab.cli.common import console, fail, print_json
from batchlab.cli.progress import progress
from batchlab.config import ConfigError


@app.command("calibrate")
def calibrate(
    torch_device: Annotated[str, typer.Option(help="Local torch device to measure: cpu, cuda, cuda:1, mps.")] = "cpu",
    seconds: Annotated[float, typer.Option(help="About how long to measure (>= 0.1 s).")] = 3.0,
    save: Annotated[bool, typer.Option("--save/--no-save", help="Cache the result for the time model.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
):
    """Measure achievable matmul FLOP/s (fp32, and bf16 where supported) and memory bandwidth of a local
    device in a few seconds, and cache them per device: estimates for that device then use these measured
    ceilings instead of datasheet figures, and say so."""
    from batchlab import calibrate as cal_mod

    if not 0.1 <= seconds <= 600:  # NaN fails this too
        fail(f"seconds: must be between 0.1 and 600, got {seconds:g}")
    try:
        with progress("calibrate", f"matmul and copy on {torch_device}, about {seconds:g} s", quiet=as_json):
            cal = cal_mod.measure(torch_device, seconds=seconds)
    except ConfigError as e:
        fail(str(e))
    path = cal_mod.save(cal) if save else None
    if as_json:
        print_json({**cal.to_dict(), "cache_path": str(path) if path else None})
        return
    out = console()
    out.print(f"[bold]batchlab calibrate[/]  {cal.hardware} ({cal.torch_device}), torch {cal.torch_version}, "
              f"{cal.seconds:.1f} s")
    table = Table(show_header=True, header_style="bold")
    for col in ("ceiling", "measured", "how"):
        table.add_column(col, justify="right" if col == "measured" else "left")
    table.add_row("matmul fp32", f"{cal.matmul_flops_fp32 / 1e12:.3g} TFLOP/s",
                  f"median, {cal.matmul_size['fp32']}^2 matmul (wall-clock)")
    bf16 = cal.matmul_flops_bf16
    table.add_row("matmul bf16", f"{bf16 / 1e12:.3g} TFLOP/s" if bf16 else "not supported",
                  f"median, {cal.matmul_size['bf16']}^2 matmul (wall-clock)" if bf16 else "")
    table.add_row("memory bandwidth", f"{cal.memory_bytes_per_s / 1e9:.3g} GB/s",
                  f"median, copy of {cal.copy_bytes / 2**20:.0f} MiB, read + write (wall-clock)")
    out.print(table)
    if path:
        out.print(f"cached for device {cal.device!r}: {path}")
        out.print(f"estimates with --device {cal.device} now use these ceilings ({cal.source})")
