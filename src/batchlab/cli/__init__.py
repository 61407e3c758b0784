"""batchlab's command line: a thin typer layer; every command is a library call tests can make too."""
import importlib
import sys

import typer

from batchlab.util import lifeline
from batchlab.cli.base import app as _app
from batchlab.config import ConfigError

# command name -> module that registers it
COMMANDS = {"estimate": "estimate", "explain": "estimate", "measure": "measure", "compare": "compare",
            "notebook": "notebook", "fit": "fit", "calibrate": "calibrate"}


def load_commands(names=None) -> typer.Typer:
    for module in sorted({COMMANDS[n] for n in (names or COMMANDS)}):
        importlib.import_module(f"batchlab.cli.{module}")
    return _app


def __getattr__(name: str):
    if name == "app":  # `from batchlab.cli import app`: the application with every command
        return load_commands()
    if name == "click_command":  # the click command under the typer app: what the docs' CLI reference reads
        return typer.main.get_command(load_commands())
    raise AttributeError(name)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    load_commands([args[0]] if args and args[0] in COMMANDS else None)
    lifeline.terminate_as_interrupt()  # SIGTERM unwinds like Ctrl-C: rows marked interrupted, children killed
    try:
        _app()
    except SystemExit as e:
        if e.code == 130 and lifeline.terminated():
            sys.exit(lifeline.SIGTERM_EXIT)  # 143: the shell's code for SIGTERM (Ctrl-C stays 130)
        raise
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
