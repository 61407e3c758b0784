"""batchlab's command line: a thin typer layer; every command is a library call tests can make too."""
from __future__ import annotations

import importlib
import importlib.util
import sys

import typer

from batchlab.config import ConfigError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Predict, measure and explain what micro-batch, gradient accumulation, data-parallel size and "
         "activation checkpointing do to peak memory, update time and useful tokens/s.\n\n"
         "global batch = micro-batch x accum x DP.  'Activation checkpointing' (--ac) recomputes activations "
         "inside one step; it is not the training checkpoint saved to disk.",
)

# Each module registers its commands on `app` when imported.
COMMAND_MODULES = ("estimate", "measure", "compare", "notebook", "fit", "calibrate")
for _name in COMMAND_MODULES:
    if importlib.util.find_spec(f"batchlab.cli.{_name}") is not None:
        importlib.import_module(f"batchlab.cli.{_name}")


def main() -> None:
    try:
        app()
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
