"""The typer application every command module registers on (kept apart so that `batchlab X` imports
only command X's module: the calculator answers without loading the measuring side)."""
import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Predict, measure and explain what micro-batch, gradient accumulation, data-parallel size and "
         "activation checkpointing do to peak memory, update time and useful tokens/s.\n\n"
         "global batch = micro-batch x accum x DP.  'Activation checkpointing' (--ac) recomputes activations "
         "inside one step; it is not the training checkpoint saved to disk.  Every figure is labelled "
         "formula, trace, allocator or wall-clock.",
)


@app.callback()
def _group() -> None:
    """Keeps typer in sub-command mode even when only one command module is loaded."""
