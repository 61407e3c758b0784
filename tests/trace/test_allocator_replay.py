"""The caching-allocator replay (trace/replay.py) on hand-built allocation sequences, segments counted by hand from
CUDACachingAllocator.cpp's rules, and once on a trace."""
from __future__ import annotations

import pytest

from batchlab.trace.replay import AllocatorReplay, CachingAllocator

KiB, MiB = 2**10, 2**20


def test_small_requests_share_one_2mib_segment_rounded_to_512_bytes():
    a = CachingAllocator()
    for key in range(3):
        a.malloc(key, 100 * KiB + 1)  # 102401 B -> 102912 B (201 x 512)
    assert a.reserved == 2 * MiB and a.allocated == 3 * 102912
    a.malloc("tiny", 1)  # one byte still takes a 512 B block
    assert a.allocated == 3 * 102912 + 512 and a.reserved == 2 * MiB


def test_segment_sizes_by_request():
    a = CachingAllocator()
    a.malloc("big", 11 * MiB + 1)  # > 10 MiB: a segment of its own, rounded up to 2 MiB
    assert a.reserved == 12 * MiB
    b = CachingAllocator()
    b.malloc("mid", 3 * MiB)  # 1-10 MiB: a 20 MiB segment, which the next mid-sized request shares
    b.malloc("mid2", 5 * MiB)
    assert b.reserved == 20 * MiB
    b.malloc("big", 11 * MiB + 1)  # one large pool: the 12 MiB left there fit, < 1 MiB would remain, not split
    assert b.reserved == 20 * MiB and b.allocated == 20 * MiB
    b.malloc("over", 16 * MiB)  # nothing free: a new 16 MiB segment
    assert b.reserved == 36 * MiB


def test_best_fit_split_and_merge():
    a = CachingAllocator()
    a.malloc("A", 100 * MiB)
    a.malloc("B", 60 * MiB)
    a.free("A")
    a.free("B")
    a.malloc("C", 50 * MiB)  # the smallest free block that fits is B's 60 MiB segment: split, 10 MiB left there
    assert a.reserved == 160 * MiB and a.allocated == 50 * MiB
    a.malloc("D", 70 * MiB)  # 100 MiB block split: 30 MiB left
    a.malloc("E", 30 * MiB)  # exactly the 30 MiB remainder
    assert a.reserved == 160 * MiB and a.allocated == 150 * MiB
    a.free("D")
    a.free("E")  # D's and E's blocks merge back into the whole 100 MiB segment
    a.malloc("F", 100 * MiB)
    assert a.reserved == 160 * MiB


def test_a_large_block_is_not_split_for_a_remainder_of_1mib_or_less():
    a = CachingAllocator()
    a.malloc("A", 22 * MiB)  # a segment of its own, already a multiple of 2 MiB
    a.free("A")
    a.malloc("B", 21 * MiB + 512)  # 1 MiB - 512 B would remain: the whole 22 MiB block is used and counted
    assert a.allocated == 22 * MiB
    a.free("B")
    a.malloc("C", 19 * MiB)  # 2 MiB would remain (> 1 MiB): split
    assert a.allocated == 19 * MiB


def test_a_live_block_in_a_segment_keeps_the_rest_from_a_larger_request():
    """The fragmentation the replay sizes: a 200 MiB segment with 20 MiB pinned in its middle has 180 MiB free in
    two pieces, neither of which holds 150 MiB."""
    a = CachingAllocator()
    a.malloc("whole", 200 * MiB)
    a.free("whole")
    a.malloc("a", 100 * MiB)
    a.malloc("pin", 20 * MiB)
    a.malloc("c", 80 * MiB)
    assert a.reserved == 200 * MiB
    a.free("a")
    a.free("c")
    a.malloc("big", 150 * MiB)
    assert a.reserved == 350 * MiB and a.allocated == 170 * MiB
    assert a.cached_free() == {"compute": 180 * MiB}


def test_streams_keep_their_own_blocks():
    a = CachingAllocator()
    a.malloc("gathered", 100 * MiB, stream="all-gather")
    a.free("gathered")
    a.malloc("act", 100 * MiB)  # a block freed on another stream is not reused
    assert a.reserved == 200 * MiB
    a.malloc("gathered again", 100 * MiB, stream="all-gather")
    assert a.reserved == 200 * MiB


def test_cached_segments_go_back_only_when_the_device_is_full():
    a = CachingAllocator(capacity=150 * MiB)
    a.malloc("A", 100 * MiB)
    a.free("A")
    a.malloc("B", 120 * MiB)  # 100 + 120 > 150: the empty 100 MiB segment is released first
    assert a.reserved == 120 * MiB and a.peak_reserved == 120 * MiB and not a.out_of_memory
    a.malloc("C", 40 * MiB)  # nothing cached to release: over the device
    assert a.out_of_memory


def test_a_fake_wait_tensor_output_is_its_input_block():
    """A real _c10d_functional.wait_tensor returns its input; a fake one a new storage, which the replay folds back."""
    import torch

    gathered = torch.empty(4)
    key = id(gathered.untyped_storage())
    r = AllocatorReplay()
    r.added(key, 100 * MiB, "activations")
    r.op_done(torch.ops._c10d_functional.all_gather_into_tensor.default, ())
    r.added(7, 100 * MiB, "activations")  # the fake wait's output
    r.op_done(torch.ops._c10d_functional.wait_tensor.default, (gathered,))
    assert r.allocator.allocated == 100 * MiB and r.result().peak_reserved_bytes == 100 * MiB
    r.freed(key)
    assert r.allocator.allocated == 100 * MiB  # the wait's output still holds the block
    r.freed(7)
    assert r.allocator.allocated == 0


def test_the_free_blocks_at_the_peak_of_allocated_largest_first():
    r = AllocatorReplay()
    r.added(1, 30 * MiB, "activations")  # a 30 MiB segment of its own (a multiple of 2 MiB)
    r.added(2, 50 * MiB, "activations")
    r.added(3, 512, "activations")  # a 2 MiB small segment: 2 MiB - 512 B left free in it
    r.freed(1)
    r.added(4, 60 * MiB, "activations")  # the 30 MiB block is too small: a new segment, allocated at its peak
    r.freed(4)
    r.added(5, 10 * MiB, "activations")  # below the peak: the record stays the one taken at the 60 MiB malloc
    result = r.result()
    assert result.blocks_at_peak == {"compute": (30 * MiB, 2 * MiB - 512)}  # the large pool's, then the small's
    assert result.free_at_peak == {"compute": 32 * MiB - 512}


@pytest.mark.parametrize("device, replayed", [("h100-80gb", True), ("cpu", False)])
def test_a_trace_on_a_cuda_device_takes_its_reserved_view_from_the_replay(device, replayed):
    from batchlab.config import RunConfig
    from batchlab.config.model import preset
    from batchlab.trace import estimate

    t = estimate(RunConfig(model=preset("tiny", layers=2), seq=64, micro_batch=2, device=device))
    m = t.memory
    assert m.margin_source == ("replay" if replayed else "none")
    if replayed:  # at least the cuBLAS workspace, and the tiny model's tensors all fit in small segments
        assert 32 * MiB <= m.margin_bytes
        assert any(n.startswith("reserved: the traced update's storages replayed") for n in t.notes)
    else:
        assert m.margin_bytes == 0


def test_a_small_block_is_split_when_exactly_512_bytes_would_remain():
    # CUDACachingAllocator.cpp should_split: the small pool splits when remaining >= kMinBlockSize (512 B)
    a = CachingAllocator()
    a.malloc("A", MiB)  # a 2 MiB small segment: 1 MiB used, 1 MiB left
    a.malloc("B", MiB - 512)  # 512 B left in it: split off
    a.malloc("C", 512)  # exactly that remainder: no new segment
    assert a.reserved == 2 * MiB and a.allocated == 2 * MiB


def test_withdrawing_a_malloc_gives_back_only_a_segment_made_for_it():
    a = CachingAllocator()
    a.malloc("A", 100 * MiB)
    a.free("A")  # 100 MiB cached
    peaks = (a.peak_allocated, a.peak_reserved)
    a.malloc("B", 100 * MiB)  # reuses the cached segment
    a.withdraw("B", peaks)
    assert a.reserved == 100 * MiB and a.allocated == 0  # the cached segment stays reserved
    a.malloc("C", 200 * MiB)  # a new segment made for it
    a.withdraw("C", (a.peak_allocated, 100 * MiB))
    assert a.reserved == 100 * MiB


def test_fsdp2s_side_pools_are_named_after_its_streams():
    # FSDP2 allocates the all-gather output on its copy-in stream and the reduce-scatter's buffers on its own
    # (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): each a pool of its own in the replay
    from batchlab.config import RunConfig
    from batchlab.config.model import preset
    from batchlab.trace import estimate

    t = estimate(RunConfig(model=preset("tiny", layers=2), seq=64, micro_batch=2, device="h100-80gb", dp=2, zero=3))
    note = next(n for n in t.notes if n.startswith("reserved: the traced update's storages replayed"))
    assert "all gather copy in stream" in note and "reduce scatter stream" in note and "side stream" not in note


def test_the_replay_changes_only_the_reserved_view():
    """The same TP+SP x FSDP2 trace with the replay and without it (a fixed margin turns it off): every tensor figure
    identical; the replayed reserved view at least the tensors plus the cuBLAS workspace."""
    import dataclasses

    from batchlab.config import RunConfig
    from batchlab.config.model import preset
    from batchlab.formula.allocator import cublas_workspace
    from batchlab.trace import estimate

    cfg = RunConfig(model=preset("tiny", layers=2), seq=64, micro_batch=2, device="h100-80gb", dp=2, tp=2,
                    sequence_parallel=True, zero=3)
    on = estimate(cfg)
    off = estimate(cfg.replace(assumptions=dataclasses.replace(cfg.assumptions, allocator_margin=0.1)))
    assert on.memory.margin_source == "replay" and off.memory.margin_source == "assumption"
    for field in ("peak_bytes", "peak_phase", "activations_bytes", "breakdown", "phase_peaks"):
        assert getattr(on.memory, field) == getattr(off.memory, field), field
    # what the allocator holds covers the tensors it holds: the margin never below the cuBLAS workspace
    assert on.memory.margin_bytes >= cublas_workspace(cfg.device_spec.arch)
