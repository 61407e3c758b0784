"""``Observer`` driven by a framework's hooks (begin / mark / end) instead of a ``with`` block.

The Hugging Face and Lightning callbacks see an optimizer update as separate events (step begin, before
backward, before the optimizer step, step end); this enters and leaves ``Observer.update`` at those events,
so the warmup / memory-update / timed-update discipline is exactly ``batchlab.observe``'s.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from batchlab.config import RunConfig
from batchlab import host
from batchlab.experiment.notebook import open_notebook
from batchlab.experiment.observed import ObservedRecord, Settings, Source, finish
from batchlab.integrations.observe import FACTOR_INTERVAL, Observer
from batchlab.config.phase import Phase


class Watch:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, warmup: int = 2,
                 device: torch.device | str | None = None, memory_every: int | None = None):
        # what else uses the CPU: sampled between updates (never inside one, where a thread would compete with
        # the update for the CPU and the GIL) until finish
        self.before = host.LoadSampler(interval=FACTOR_INTERVAL, thread=False).start()
        self.observer = Observer(model, optimizer, warmup=warmup, device=device, memory_every=memory_every,
                                 after_update=self.before.poll)
        self._update = None
        self._tokens: list = []  # per micro-batch counts, tensors kept on the device until the update ends

    @property
    def in_update(self) -> bool:
        return self._update is not None

    def begin(self) -> None:
        if self._update is not None:
            self.end()
        self._tokens = []
        self._update = self.observer.update()
        self._update.__enter__()

    def mark(self, phase: Phase | str) -> None:
        if self._update is not None:
            self.observer.mark(phase)

    def count_tokens(self, n) -> None:
        """``n``: an int or a 0-d tensor (summed when the update ends: no device sync per micro-batch)."""
        if self._update is not None:
            self._tokens.append(n)

    def end(self) -> None:
        update, self._update = self._update, None
        if update is None:
            return
        if self._tokens:
            self.observer.count_tokens(int(sum(int(t) for t in self._tokens)))
        update.__exit__(None, None, None)

    def abort(self, exc: BaseException) -> None:
        """Leave an update that raised (records an OOM; leaves the memory tracker's dispatch mode)."""
        update, self._update = self._update, None
        if update is not None:
            try:
                update.__exit__(type(exc), exc, exc.__traceback__)
            except BaseException:  # noqa: BLE001 — the Observer re-raises; the framework already handles exc
                pass

    def finish(self, source: Source, settings: Settings, cfg: RunConfig | None, unmapped: list[str],
               notebook=None, predict: bool = True, note: str = "") -> tuple[ObservedRecord, int | None]:
        self.end()
        m = self.observer.finish()
        rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
        if rank != 0:
            notebook = None  # one row per run: rank 0's figures (every rank keeps its own record on the callback)
        book = open_notebook(notebook) if notebook is not None else None
        return finish(source, settings, m, cfg, unmapped, self.before, notebook=book, predict=predict,
                      note=note)
