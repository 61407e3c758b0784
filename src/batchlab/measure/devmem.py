"""Memory listeners for one update: the CUDA caching allocator's statistics, or the live-storage tracker
(CPU and MPS, which have no peak statistic).  Both give the same MeasuredMemory.
"""
from __future__ import annotations

import torch

from batchlab.measure.memory import MemorySnapshot, storage_bytes
from batchlab.config.phase import Phase
from batchlab.measure.result import MeasuredMemory
from batchlab.measure.shards import local_shards


class CudaMemoryListener:
    """A phase listener: per-phase peaks from ``max_memory_allocated`` (peak stats are reset at every mark, so each
    phase's own maximum is known and so is the phase of the overall peak); activations = allocated at the
    last micro-batch's backward start minus allocated at its forward start."""

    def __init__(self, device: torch.device):
        self.device = device
        self.phase = Phase.DATA
        self.phase_peaks: dict[str, int] = {}
        self.reserved_peak = 0
        self.activations_bytes = 0
        self._forward_start = 0
        self._stats0: dict[str, int] = {}

    def begin(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._stats0 = torch.cuda.memory_stats(self.device)
        self.phase, self.phase_peaks, self.reserved_peak = Phase.DATA, {}, 0

    def _close_phase(self) -> None:
        peak = torch.cuda.max_memory_allocated(self.device)
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), peak)
        self.reserved_peak = max(self.reserved_peak, torch.cuda.max_memory_reserved(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)

    def mark(self, phase: Phase | str) -> None:
        phase = Phase(phase)
        # allocator statistics are kept on the host at launch time: reading them needs no synchronise
        self._close_phase()
        if phase is Phase.FORWARD:
            self._forward_start = torch.cuda.memory_allocated(self.device)
        elif phase is Phase.BACKWARD:
            self.activations_bytes = torch.cuda.memory_allocated(self.device) - self._forward_start
        self.phase = phase

    def result(self, trainer) -> MeasuredMemory:
        stats = torch.cuda.memory_stats(self.device)
        peak_phase = max(self.phase_peaks, key=self.phase_peaks.get)
        return MeasuredMemory(
            peak_bytes=self.phase_peaks[peak_phase], activations_bytes=self.activations_bytes,
            peak_phase=peak_phase, breakdown=model_state_bytes(trainer), reserved_bytes=self.reserved_peak,
            alloc_retries=stats.get("num_alloc_retries", 0) - self._stats0.get("num_alloc_retries", 0),
            oom_count=stats.get("num_ooms", 0) - self._stats0.get("num_ooms", 0),
            method="cuda max_memory_allocated (peak stats reset at each phase)")


def model_state_bytes(trainer) -> dict[str, int]:
    """Parameters (and buffers) and optimizer state as they are now (between updates)."""
    model = trainer.raw_model
    optimizer = getattr(trainer.optimizer, "optim", trainer.optimizer)  # ZeroRedundancyOptimizer: this rank's
    opt = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"parameters": storage_bytes(local_shards(list(model.parameters()) + list(model.buffers()))),
            "optimizer": storage_bytes(local_shards(opt))}


def from_snapshot(snap: MemorySnapshot) -> MeasuredMemory:
    return MeasuredMemory(peak_bytes=snap.peak_bytes, activations_bytes=snap.activations_bytes,
                          peak_phase=snap.peak_phase, breakdown=dict(snap.breakdown),
                          method="live storage tracker (every tensor storage created, freed by finalizer)")
