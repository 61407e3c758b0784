"""The CUDA memory and timing path of batchlab.measure (skipped without a CUDA device)."""
from __future__ import annotations

import pytest
import torch

from batchlab.config import RunConfig, preset
from batchlab.measure import MeasureOptions, Outcome
from batchlab.run import measure as run
from batchlab.measure.device import torch_device
from batchlab.measure.devmem import CudaMemoryListener
from batchlab.measure.harness import Trainer
from batchlab.measure.memory import track_update

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CFG = RunConfig(model=preset("tiny"), seq=128, micro_batch=8, device="h100-sxm")


def test_cuda_memory_agrees_with_the_live_tensor_tracker():
    """The allocator's peak (CUDA) and the live-storage tracker (CPU, same model and data) count the same
    tensors; the caching allocator rounds blocks to 512 bytes and cuBLAS keeps its workspace (a few MiB)
    in allocated memory, so allow 15% on the tiny model's ~80 MiB."""
    m = run(CFG, MeasureOptions(warmup=2, steps=3))
    assert m.outcome is Outcome.OK, m.outcome_detail
    assert m.memory.method.startswith("cuda max_memory_allocated")
    tr = Trainer(CFG.replace(device="cpu"))
    cpu = track_update(tr)
    assert m.memory.peak_bytes == pytest.approx(cpu.peak_bytes, rel=0.15)
    assert m.memory.activations_bytes == pytest.approx(cpu.activations_bytes, rel=0.15)
    assert m.memory.peak_phase == cpu.peak_phase
    assert m.memory.reserved_bytes >= m.memory.peak_bytes
    assert m.memory.alloc_retries == 0 and m.memory.oom_count == 0
    # timing: whole updates timed without per-phase syncs; the split comes from separate synced updates
    assert len(m.time.samples) == 3 and not m.time.cpu_seconds
    assert set(m.time.phase_seconds) == {"data", "forward", "backward", "optimizer"}
    assert m.environment["device_name"] == torch.cuda.get_device_name()


def test_cuda_budget_is_an_oom_budget_outcome_and_the_process_goes_on():
    ok = run(CFG, MeasureOptions(warmup=1, steps=1))
    budget = ok.memory.peak_bytes // 2
    m = run(CFG.replace(memory_budget=budget), MeasureOptions(warmup=1, steps=1))
    assert m.outcome is Outcome.OOM_BUDGET and m.oom_phase in ("forward", "backward", "optimizer")
    again = run(CFG, MeasureOptions(warmup=1, steps=1))  # the fraction was restored, memory released
    assert again.outcome is Outcome.OK
    assert again.memory.peak_bytes == ok.memory.peak_bytes


def test_real_cuda_oom_is_recorded_with_its_phase():
    # eager attention keeps micro x heads x s^2 fp32 scores per layer: 200k x 4 x 256^2 x 4 B = 210 GB
    huge = RunConfig(model=preset("tiny"), seq=256, micro_batch=200_000, device="h100-sxm")
    m = run(huge, MeasureOptions(warmup=1, steps=1))
    assert m.outcome is Outcome.OOM
    assert m.oom_phase == "forward"
    assert "device allocator" in m.outcome_detail
    assert torch.cuda.memory_allocated() < 2**30  # nothing left behind


def test_the_allocators_peak_is_pytorchs_memtracker_peak_plus_what_no_tensor_holds():
    """One steady-state update on CUDA, measured as batchlab's memory update measures it (max_memory_allocated
    per phase) inside PyTorch's own MemTracker (torch.distributed._tools.mem_tracker: every live storage, rounded
    to the allocator's 512-byte blocks).  The allocator also holds memory no tensor owns (cuBLAS's workspace,
    allocated during warmup and kept): read before the update as allocated minus what MemTracker tracks, it is
    constant, so the two peaks differ by exactly it, within a few blocks.  A larger batch than CFG's, so the
    update's own memory dominates."""
    from torch.distributed._tools.mem_tracker import MemTracker

    cfg = CFG.replace(micro_batch=64)  # accum 1: MemTracker refuses a module's second forward
    trainer = Trainer(cfg, torch_device(cfg))
    for _ in range(2):
        trainer.update()  # AdamW's state made: the steady state
    torch.cuda.synchronize()
    listener, tracker = CudaMemoryListener(trainer.device), MemTracker()
    tracker.track_external(trainer.raw_model, trainer.optimizer)
    with tracker:
        current = tracker.get_tracker_snapshot("current")
        device = next(d for d in current if d.type == "cuda")
        untracked = torch.cuda.memory_allocated(device) - current[device]["Total"]
        listener.begin()
        trainer.update(listener=listener)
        listener.mark("end")
    measured = listener.result(trainer)
    reference = tracker.get_tracker_snapshot("peak")[device]["Total"]
    assert 0 <= untracked < 256 * 2**20, untracked
    assert reference > 64 * 2**20  # the update's tensors, not the workspace, make the peak
    assert measured.peak_bytes == pytest.approx(reference + untracked, rel=0.01, abs=4 * 2**20)
