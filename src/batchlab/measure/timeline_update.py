"""The timeline of a real update on this machine (``batchlab measure --timeline``, compare records).

One untimed update after a steady-state one (AdamW makes its state lazily).  measure/session.py records it
in its memory update (CPU, MPS) or after warmup (CUDA, a CPU memory budget), so it runs in the measuring process (the isolated
subprocess with ``--isolate``): on CPU (and MPS) with the live-storage tracker, the same recording as the
trace, so the two agree op by op; on CUDA from the caching allocator's own history (batchlab.measure.timeline_cuda).
"""
from __future__ import annotations

import torch

from batchlab.config import RunConfig
from batchlab.measure.harness import Trainer, torch_device
from batchlab.timeline.data import Timeline
from batchlab.measure.timeline_tracker import context, recorded_update
from batchlab.models.owners import OUTSIDE, ModuleStack


def record(cfg: RunConfig, device: str | torch.device | None = None, trainer: Trainer | None = None) -> Timeline:
    """Timeline of one steady-state update of ``cfg`` on ``device`` (default: the config's backend)."""
    trainer = trainer or Trainer(cfg, torch_device(cfg, str(device) if device is not None else None))
    if trainer.updates_done == 0:
        trainer.update()
    if trainer.device.type == "cuda":
        from batchlab.measure.timeline_cuda import record_cuda

        return record_cuda(trainer, context(cfg))
    return recorded(cfg, trainer)[0]


def recorded(cfg: RunConfig, trainer: Trainer, listen=None):
    """(timeline, the live-storage tracker's snapshot) of ``trainer``'s next update on CPU or MPS (after a
    steady-state one: the caller's); the snapshot is what the memory update reports (measure/session.py), whose
    phase recorder ``listen`` wraps the tracker in (timeline_tracker.recorded_update)."""
    ctx = context(cfg)
    owners = ModuleStack(trainer.raw_model)
    try:
        snap, recorder = recorded_update(trainer, owners.current, OUTSIDE, listen=listen)
    finally:
        owners.close()
    return recorder.timeline(provenance="allocator", method=f"live storage tracker on {trainer.device.type} "
                             "(every tensor storage, freed by finalizer)", peak_bytes=snap.peak_bytes, **ctx), snap
