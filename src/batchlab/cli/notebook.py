"""``batchlab notebook list | show ID | diff A B | export --format json|csv|md | import FILE``: the lab notebook."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from batchlab.util.text import for_rich as escape
from rich.table import Table

from batchlab.cli.base import app
from batchlab.cli.common import Verbose, console, fail, print_json
from batchlab.cli.render_experiment import show_record
from batchlab.cli.render_observed import render_diff, render_observed
from batchlab.config import ConfigError
from batchlab.experiment.notebook import DamagedRecord, Notebook
from batchlab.experiment.observed import ObservedRecord
from batchlab.experiment.observed_diff import observed_diff
from batchlab.report.export import export as export_records

notebook_app = typer.Typer(help="The lab notebook: every `batchlab compare` experiment and observed run, kept in SQLite.",
                           no_args_is_help=True)
app.add_typer(notebook_app, name="notebook")

NotebookOpt = Annotated[Optional[Path], typer.Option("--notebook", help="Lab notebook file (default: batchlab/notebook.sqlite in the user data directory).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


@notebook_app.command("list")
def list_(notebook: NotebookOpt = None, as_json: JsonOpt = False):
    """One line per experiment: id, date, status, the single variable, the verdict."""
    book = Notebook(notebook)
    try:
        rows = book.list()
    except ConfigError as e:
        fail(str(e))
    if as_json:
        print_json(rows)
        return
    out = console()
    if not rows:
        out.print(f"no experiments yet in {book.path}", markup=False, highlight=False)
        return
    t = Table(show_header=True, header_style="bold", title=escape(str(book.path)))
    for col in ("id", "date", "kind", "status", "variable", "observed (memory: allocator; time: wall-clock)"):
        t.add_column(col, overflow="fold")
    for r in rows:
        status = r["status"] if r["status"] == "complete" else f"[yellow]{r['status']}[/]"
        kind = " [dim](formula only: ratios are formula)[/]" if r["kind"] == "formula-only" else ""
        t.add_row(str(r["id"]), r["created_at"][:16].replace("T", " "), r["kind"], status, escape(r["variable"]) + kind,
                  r["short"] or "-")
    out.print(t)


@notebook_app.command("show")
def show(exp_id: Annotated[int, typer.Argument(metavar="ID", help="Experiment id (see `notebook list`).")],
         notebook: NotebookOpt = None, as_json: JsonOpt = False,
         report: Annotated[Optional[Path], typer.Option(help="Write the Markdown and HTML report into this directory.")] = None,
         verbose: Verbose = False):
    """The whole record of one experiment (and its report with --report DIR); --verbose: all of it on screen."""
    book = Notebook(notebook)
    try:
        record = book.get(exp_id)
    except DamagedRecord as e:  # what the row's columns still say, then the mark
        if as_json:
            print_json({**e.summary, "unreadable": e.reason})
        else:
            console().print(", ".join(f"{k}: {escape(str(v))}" for k, v in e.summary.items() if v not in (None, "")),
                            soft_wrap=True)
        fail(str(e), 1)
    except ConfigError as e:
        fail(str(e))
    if isinstance(record, ObservedRecord):
        if report is not None:
            console().print("[yellow]warning:[/] --report is ignored for observed runs (no report document yet); "
                            "notebook export --format md includes them")
        if as_json:
            print_json(record.to_dict())
        else:
            render_observed(console(), record.to_dict(), book.path)
        return
    show_record(record, book.path, report, as_json, verbose)


@notebook_app.command("diff")
def diff_(a_id: Annotated[int, typer.Argument(metavar="ID1", help="Observed run A (see `notebook list`).")],
          b_id: Annotated[int, typer.Argument(metavar="ID2", help="Observed run B, differing from A in one variable.")],
          notebook: NotebookOpt = None, as_json: JsonOpt = False,
          predict: Annotated[Optional[str], typer.Option(help="Your prediction, e.g. 'memory=up,time=same'.")] = None):
    """Two observed runs that differ in one variable, with compare's verdict, band and diagnosis."""
    try:
        d = observed_diff(Notebook(notebook), a_id, b_id, predict)
    except ConfigError as e:
        fail(str(e))
    if as_json:
        print_json(d.to_dict())
        return
    render_diff(console(), d)


@notebook_app.command("export")
def export(fmt: Annotated[str, typer.Option("--format", help="json, csv or md.")] = "json",
           notebook: NotebookOpt = None,
           output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write here instead of stdout.")] = None):
    """Every experiment as JSON (whole records), CSV (one row each, one column group per metric) or Markdown."""
    damaged: list[DamagedRecord] = []
    try:
        text = export_records(Notebook(notebook).records(damaged), fmt)
    except ConfigError as e:
        fail(str(e))
    for d in damaged:
        typer.echo(f"warning: {d} (left out of the export)", err=True)
    if output is None:
        sys.stdout.write(text)
        return
    from batchlab.util.files import write_atomic

    try:
        write_atomic(output, text)
    except ConfigError as e:
        fail(str(e))


@notebook_app.command("import")
def import_(file: Annotated[Path, typer.Argument(metavar="FILE", help="A fallback file written when a save failed.")],
            notebook: NotebookOpt = None):
    """Load a record that could not be saved (the fallback JSON file the error message named)."""
    book = Notebook(notebook)
    try:
        exp_id = book.import_file(file)
    except ConfigError as e:
        fail(str(e))
    console().print(f"imported {escape(str(file))} as experiment {exp_id} in {escape(str(book.path))}")
