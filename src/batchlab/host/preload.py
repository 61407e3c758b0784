"""Libraries a measurement imports beyond warm.PRELOAD (a Hugging Face model's: transformers and its model
classes; measure/runner.py's ``preloaded`` names them), imported once in the pre-imported process on the first
request that names them, so that every later fork inherits them.  Importing them was most of a Hugging Face
model's fork's CPU time (docs/cpu.md); a compare forks six.

A fork must still see what a fresh process would, so once they are imported a request is refused (the runner
then starts a fresh process) when:
- its variables that these libraries read once, at import (``IMPORT_TIME_ENV``: HF_HOME, from XDG_CACHE_HOME by
  default, HF_HUB_OFFLINE, TRANSFORMERS_VERBOSITY ...), differ from the pre-imported process's own;
- a folder its PYTHONPATH adds holds another copy of a package they brought in.
No import happens for a request of the first kind either.
"""
from __future__ import annotations

import gc
import importlib
import importlib.machinery
import sys

IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "SAFETENSORS_", "XDG_CACHE_HOME")
def _import_env(env) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


def _packages() -> set[str]:
    return {name.partition(".")[0] for name in sys.modules}


class Loaded:
    """In the pre-imported process: the top-level packages imported on request (empty until one is)."""

    def __init__(self) -> None:
        self.packages: set[str] = set()

    def load(self, names, own_env, run_env) -> None:
        """Import ``names`` not imported yet, where the run's import-time variables are this process's own."""
        todo = [n for n in names if n not in sys.modules]
        if not todo or _import_env(own_env) != _import_env(run_env):
            return
        before = _packages()
        gc.disable()  # as warm.serve imports PRELOAD: nothing to collect, then out of the forks' collections
        try:
            for name in todo:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 — not installed or broken: the fork imports it and says why
                    pass
        finally:
            gc.freeze()
            gc.enable()
        self.packages |= _packages() - before

    def refusal(self, own_env, run_env, added_paths: list[str]) -> str | None:
        """Why a fork of this process would not see what a fresh process of the run would; None if it would."""
        if not self.packages:
            return None
        if _import_env(own_env) != _import_env(run_env):
            return "libraries imported here under other HF_/TRANSFORMERS_ settings than the run's"
        finder = importlib.machinery.PathFinder
        shadowed = sorted(p for p in self.packages if added_paths and finder.find_spec(p, added_paths) is not None)
        return f"the run's PYTHONPATH has its own {shadowed[0]}" if shadowed else None
