"""Each benchmark writes its own page of the documentation's accuracy section.

``publish(main, name)`` runs a benchmark's ``main`` with its Markdown (stdout) shown as before and also kept;
at the end the page ``docs/accuracy/<name>.md`` is written with a header that says when, where and how it was
produced (date, machine, torch version, the command that reproduces it), then the Markdown itself.  Smoke runs
(``--quick``, ``--tiny``, ``--only``) print only: a partial grid is not the page.  ``--no-page`` prints only too.
"""
from __future__ import annotations

import datetime
import io
import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "accuracy"
PARTIAL = ("--quick", "--tiny", "--only", "--no-page")


class _Tee(io.TextIOBase):
    def __init__(self, out):
        self.out, self.kept = out, io.StringIO()

    def write(self, s: str) -> int:
        self.kept.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


def machine() -> str:
    """The CPU model and core count, and the GPUs where there are any (nvidia-smi), as one line."""
    try:
        from batchlab.host import cpu_hardware, gpu_names  # torch-free

        gpus = gpu_names()
        return cpu_hardware() + (f"; GPU: {', '.join(gpus)}" if gpus else "; no GPU")
    except Exception:  # noqa: BLE001 — the page still says what it can
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def header(title: str, argv: list[str]) -> str:
    script = Path(sys.argv[0]).name
    command = " ".join(["python", f"benchmarks/{script}", *map(shlex.quote, argv)])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"# {title}\n\n"
            f"Written by `benchmarks/{script}`; edit the script, not this page.\n\n"
            "| | |\n|---|---|\n"
            f"| date | {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC |\n"
            f"| machine | {machine()}, load average {load:.1f} at the start |\n"
            f"| torch | {_version('torch')} |\n"
            f"| batchlab | {_version('batchlab')} |\n"
            f"| reproduce | `PYTHONPATH=src {command}` |\n\n")


def variant(name: str, flags: dict[str, str]) -> str:
    """The page's name: ``name`` plus a suffix per flag given: ``{"--families": "families"}`` for a switch,
    ``{"--reference=": ""}`` for an option, whose value is the suffix (``--reference trace`` -> ``-trace``)."""
    args = sys.argv[1:]
    for flag, suffix in flags.items():
        for i, a in enumerate(args):
            if not flag.endswith("="):
                name += f"-{suffix}" if a == flag else ""
            elif a.startswith(flag):
                name += f"-{a[len(flag):]}"
            elif a == flag[:-1] and i + 1 < len(args):
                name += f"-{args[i + 1]}"
    return name


def publish(main, name: str, title: str, fence: bool = False) -> None:
    """Run ``main()`` and write its stdout, under the header, to docs/accuracy/<name>.md (unless partial);
    ``fence``: the output is a terminal table, kept as text."""
    argv = sys.argv[1:]
    partial = any(a.split("=")[0] in PARTIAL for a in argv)
    if "--no-page" in argv:
        sys.argv.remove("--no-page")
    head = header(title, [a for a in argv if a != "--no-page"])
    tee = _Tee(sys.stdout)
    real, sys.stdout = sys.stdout, tee
    try:
        code = main()
    finally:
        sys.stdout = real
    if not partial:
        DOCS.mkdir(parents=True, exist_ok=True)
        path = DOCS / f"{name}.md"
        body = tee.kept.getvalue()
        path.write_text(head + (f"```text\n{body}```\n" if fence else body))
        print(f"wrote {path}", file=sys.stderr)
    if isinstance(code, int):
        sys.exit(code)
