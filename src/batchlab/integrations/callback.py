"""What the framework callbacks share: their options, the Watch of the run, and the record it leaves.

Framework-free (each callback module imports its own framework and mixes this in first).
"""
from __future__ import annotations

from typing import Any

from batchlab.experiment.observed import Settings, Source
from batchlab.integrations.watch import Watch


class NotebookCallback:
    def __init__(self, notebook=None, predict: bool = True, warmup: int = 2, note: str = "",
                 memory_every: int | None = None):
        super().__init__()
        self.notebook, self.predict, self.warmup, self.note = notebook, predict, warmup, note
        self.memory_every = memory_every  # None: memory from update 2 only; N: also 2 + N, 2 + 2N, ... (untimed)
        self.watch: Watch | None = None
        self.record = None
        self.notebook_id: int | None = None
        self._seq: int | None = None

    def _watch(self, model, optimizer, device) -> Watch:
        return Watch(model, optimizer, warmup=self.warmup, device=device, memory_every=self.memory_every)

    def _finish(self, source: Source, settings: Settings, cfg, unmapped) -> None:
        """The observed record written (to the notebook when one was given); the watch is done."""
        self.record, self.notebook_id = self.watch.finish(source, settings, cfg, unmapped, notebook=self.notebook,
                                                          predict=self.predict, note=self.note)
        self.watch = None

    def summary(self) -> dict[str, Any] | None:
        return self.record.to_dict() if self.record is not None else None
