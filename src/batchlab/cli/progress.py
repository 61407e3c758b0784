"""The progress display of every command that can run for more than a couple of seconds.

Shown on stderr only when a person watches: stdout and stderr both terminals (rich's ``Console.is_terminal``,
which also honours ``FORCE_COLOR`` / ``TTY_COMPATIBLE``), and never with ``--json``.  Piped or redirected
output stays exactly the result.  Transient: the display is erased when the work ends.

    with progress("fit", "trial 1 of at most 5", total=5, quiet=as_json) as bar:
        run(..., progress=bar)          # bar(done, total, label), or None when not shown

``Bar`` has the ``(done, total, label)`` call shape that ``batchlab.run.measure`` and
``batchlab.experiment.compare.run`` take as ``progress``.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


def shown(quiet: bool = False) -> bool:
    """Whether a progress display would be shown: not ``quiet`` (--json) and both streams are terminals."""
    return not quiet and Console().is_terminal and Console(stderr=True).is_terminal


class Bar:
    def __init__(self, bar: Progress, task):
        self._bar, self._task = bar, task

    def __call__(self, done: int, total: int | None, label: str) -> None:
        self._bar.update(self._task, completed=done, total=total, description=escape(label))

    def log(self, line: str) -> None:
        """A line kept above the display (it stays after the display is erased)."""
        self._bar.console.print(line, markup=False, highlight=False)


@contextmanager
def progress(name: str, label: str = "", total: int | None = None, *, quiet: bool = False,
             counted: bool | None = None) -> Iterator[Bar | None]:
    """A display for one piece of work named ``name``; yields None when not shown (see ``shown``).
    ``counted``: show a bar and k/n (default: when ``total`` is given; the work may give it later)."""
    if not shown(quiet):
        yield None
        return
    columns = [SpinnerColumn(), TextColumn(f"[bold]{escape(name)}[/]")]
    if total is not None if counted is None else counted:
        columns += [BarColumn(), MofNCompleteColumn()]
    columns += [TextColumn("{task.description}"), TimeElapsedColumn()]
    # the stream itself, not stderr=True: Live swaps sys.stderr for a proxy that would swallow Bar.log's lines
    with Progress(*columns, console=Console(file=sys.stderr), transient=True) as bar:
        yield Bar(bar, bar.add_task(escape(label), total=total))
