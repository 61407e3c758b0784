"""The trace's storage events replayed through the CUDA caching allocator's block rules: reserved, not a margin.

What a live-storage trace gives is tensor bytes (max_memory_allocated); what a CUDA run reports and runs out of is
reserved bytes (max_memory_reserved): the segments the allocator took from the device, some of which sit empty at
the peak because the tensors freed into them are too small for what is allocated there next (a layer's 2 GiB
gathered inputs, then the loss's vocabulary-sized tensors).  That depends on the order and sizes of every
allocation, which the trace has: ``AllocatorReplay`` listens to the trace's StorageTracker and ``CachingAllocator``
applies the rules of pytorch c10/cuda/CUDACachingAllocator.cpp to each creation and free:

- sizes round up to 512 B (``kMinBlockSize``, round_size);
- requests <= 1 MiB (``kSmallSize``) come from the small pool's 2 MiB segments (``kSmallBuffer``), requests below
  10 MiB (``kMinLargeAlloc``) from 20 MiB segments (``kLargeBuffer``), larger ones get a segment of their own
  rounded up to 2 MiB (``kRoundLarge``) (get_allocation_size);
- the smallest cached free block of the same pool and stream that fits is used (get_free_block: the pools are
  ordered by stream, size, address), split when at least 512 B (small pool) or more than 1 MiB (large pool) would remain
  (should_split); a freed block merges with free neighbours of its segment (free_block, try_merge_blocks);
- a block is reused only on the stream that allocated it (BlockComparatorSize compares the stream first): FSDP2's
  all-gather copy-in and reduce-scatter streams keep pools of their own, told apart by the ``stream(...)`` context
  its collectives enter (``streams``);
- segments go back to the device only when a new one would not fit on it (release_cached_blocks, then retry): with
  no capacity given, never (no empty_cache in a training step).

Fake tensors differ from the real run in one place the replay corrects: a fake ``_c10d_functional.wait_tensor``
returns a new storage, a real one its input (the collective's output), so its output is the input's block.

Not replayed: record_stream (formula/allocator.py: torchtitan avoids it), expandable segments, the cuBLAS workspace
(no op creates it; added by the caller), and what CUDA kernels allocate that the CPU kernels traced do not.  The
reverse is replayed as traced: CPU's rms_norm is the composite (x.float(), pow, mul: fp32 whole-sequence copies)
where CUDA's is one _fused_rms_norm kernel (trace/cuda_policy.py), so a torch.rms_norm model's replay holds blocks
a CUDA run does not make (three 4 GiB fp32 ones at Llama 3 70B's widths under TP without sequence parallelism).
"""
from __future__ import annotations

import bisect
import contextlib
import contextvars
import itertools
from dataclasses import dataclass

MiB = 2**20
MIN_BLOCK, SMALL_SIZE, SMALL_BUFFER, LARGE_BUFFER, MIN_LARGE_ALLOC, ROUND_LARGE = (
    512, MiB, 2 * MiB, 20 * MiB, 10 * MiB, 2 * MiB)  # CUDACachingAllocator.cpp's constants
COMPUTE = "compute"  # the stream no ``stream(...)`` context names: the default stream

_STREAM = contextvars.ContextVar("batchlab_replay_stream", default=COMPUTE)


def round_size(nbytes: int) -> int:
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """get_allocation_size: the segment a rounded request gets when no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("size", "addr", "stream", "small", "prev", "next", "owner")

    def __init__(self, size: int, addr: int, stream: str, small: bool):
        self.size, self.addr, self.stream, self.small = size, addr, stream, small
        self.prev = self.next = None
        self.owner = None  # the key holding it, None when free

    def sort_key(self) -> tuple:
        return self.stream, self.size, self.addr


class CachingAllocator:
    """Blocks and segments of one device; ``allocated`` and ``reserved`` bytes now and at their peaks."""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self._free: dict[bool, list[tuple]] = {True: [], False: []}  # small? -> sorted (stream, size, addr)
        self._blocks: dict[tuple, _Block] = {}
        self._live: dict[object, _Block] = {}
        self._addresses = itertools.count(0, 1 << 40)  # every segment its own address range
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.out_of_memory = False  # a segment did not fit even after the cache was released
        self._fresh = None

    def malloc(self, key, nbytes: int, stream: str = COMPUTE) -> None:
        if nbytes <= 0:  # a zero-byte storage takes no block (the allocator returns a null pointer)
            return
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(small, stream, size)
        self._fresh = key if block is None else None  # the latest malloc made its segment (``withdraw``)
        if block is None:
            block = self._segment(small, stream, segment_size(size))
        remaining = block.size - size
        if (remaining >= MIN_BLOCK) if small else (remaining > SMALL_SIZE):  # should_split
            rest = _Block(remaining, block.addr + size, stream, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._cache(rest)
        block.owner = key
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key) -> None:
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.owner = None
        for neighbour in (block.prev, block.next):  # try_merge_blocks
            if neighbour is not None and neighbour.owner is None:
                self._uncache(neighbour)
                if neighbour is block.prev:
                    block.addr, block.prev = neighbour.addr, neighbour.prev
                    if neighbour.prev is not None:
                        neighbour.prev.next = block
                else:
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
                block.size += neighbour.size
        self._cache(block)

    def withdraw(self, key, peaks: tuple[int, int]) -> None:
        """Undo the latest ``malloc`` (of ``key``) as if it never happened: its block freed, a segment made for it
        given back, the peaks (allocated, reserved) as they were before it."""
        block = self._live.get(key)
        if block is None:  # a zero-byte storage: no block
            return
        self.free(key)
        if (self._fresh == key and block.prev is None and block.next is None
                and self._blocks.get(block.sort_key()) is block):  # only a segment made for it: a cached one stays
            self._uncache(block)
            self.reserved -= block.size
        self.peak_allocated, self.peak_reserved = peaks

    def _best_fit(self, small: bool, stream: str, size: int) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (stream, size, -1))
        if i < len(pool) and pool[i][0] == stream:
            block = self._blocks[pool[i]]
            self._uncache(block)
            return block
        return None

    def _segment(self, small: bool, stream: str, size: int) -> _Block:
        if self.capacity is not None and self.reserved + size > self.capacity:
            self._release_cached()
            self.out_of_memory = self.out_of_memory or self.reserved + size > self.capacity
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return _Block(size, next(self._addresses), stream, small)

    def _release_cached(self) -> None:
        """release_cached_blocks: every cached segment with nothing allocated in it goes back to the device."""
        for pool in self._free.values():
            for k in [k for k in pool if self._blocks[k].prev is None and self._blocks[k].next is None]:
                self._uncache(self._blocks[k])
                self.reserved -= k[1]

    def _cache(self, block: _Block) -> None:
        k = block.sort_key()
        self._blocks[k] = block
        bisect.insort(self._free[block.small], k)

    def _uncache(self, block: _Block) -> None:
        k = block.sort_key()
        pool = self._free[block.small]
        del pool[bisect.bisect_left(pool, k)]
        del self._blocks[k]

    def cached_free(self) -> dict[str, int]:
        """Bytes of cached free blocks, by stream."""
        return {stream: sum(sizes) for stream, sizes in self.cached_sizes().items()}

    def cached_sizes(self) -> dict[str, list[int]]:
        """The sizes of the cached free blocks, by stream, in no set order (cheap enough to take at every peak)."""
        out: dict[str, list[int]] = {}
        for pool in self._free.values():
            for stream, size, _ in pool:
                out.setdefault(stream, []).append(size)
        return out


def _largest_first(sizes: dict[str, list[int]]) -> dict[str, tuple[int, ...]]:
    return {stream: tuple(sorted(v, reverse=True)) for stream, v in sizes.items()}


@dataclass(frozen=True)
class ReplayResult:
    peak_reserved_bytes: int  # max_memory_reserved
    out_of_memory: bool
    blocks_at_peak: dict  # stream -> sizes of the blocks cached and free when allocated reached its peak, largest first

    @property
    def free_at_peak(self) -> dict[str, int]:
        """Stream -> bytes cached and free at the peak of allocated."""
        return {k: sum(v) for k, v in self.blocks_at_peak.items()}


class AllocatorReplay:
    """A StorageTracker listener (measure/memory.py StorageListener) that replays each storage as it is created and
    freed.  Trackers of consecutive updates may share it (the segments an update leaves cached are the next one's
    to reuse): a storage registered again is the one it already holds."""

    def __init__(self, capacity: int | None = None):
        self.allocator = CachingAllocator(capacity)
        # tracker key (a storage's id, reused once it dies) -> the block it uses, by a number of the replay's own:
        # its own block, or the block of the collective output a fake wait_tensor returned a copy of
        self._block: dict[int, int] = {}
        self._refs: dict[int, int] = {}  # block -> keys using it
        self._blocks = itertools.count()
        self._new: list[tuple] = []  # (key, peaks before, free at the peak before) created by the op now running
        # stream -> free block sizes at the peak of allocated, unsorted: a new peak comes at nearly every malloc of
        # the forward pass, so they are sorted once, in result()
        self._free_at_peak: dict[str, list[int]] = {}

    def added(self, key: int, nbytes: int, category: str) -> None:
        if key in self._block:  # a storage the replay saw made, registered again by the next update's tracker
            return
        a = self.allocator
        peaks, free_at_peak = (a.peak_allocated, a.peak_reserved), self._free_at_peak
        block = self._block[key] = next(self._blocks)
        self._refs[block] = 1
        a.malloc(block, nbytes, _STREAM.get())
        self._new.append((key, peaks, free_at_peak))
        if a.peak_allocated > peaks[0]:
            self._free_at_peak = a.cached_sizes()

    def freed(self, key: int) -> None:
        block = self._block.pop(key, None)
        if block is None:
            return
        self._refs[block] -= 1
        if not self._refs[block]:
            del self._refs[block]
            self.allocator.free(block)

    def relabelled(self, key: int, category: str) -> None:
        pass

    def op_done(self, func, args) -> None:
        new, self._new = self._new, []
        if getattr(func, "__name__", "") == "wait_tensor.default" and func.namespace == "_c10d_functional":
            from batchlab.measure.memory import _local, tensors_in

            inputs = tensors_in(args)
            source = self._block.get(id(_local(inputs[0]).untyped_storage())) if inputs else None
            if source is not None and len(new) == 1:  # the real op returns its input: the fake output never was
                key, peaks, self._free_at_peak = new[0]
                block = self._block[key]
                self.allocator.withdraw(block, peaks)
                del self._refs[block]
                self._block[key] = source
                self._refs[source] += 1

    def result(self) -> ReplayResult:
        a = self.allocator
        return ReplayResult(peak_reserved_bytes=a.peak_reserved, out_of_memory=a.out_of_memory,
                            blocks_at_peak=_largest_first(self._free_at_peak))


def replays(cfg) -> AllocatorReplay | None:
    """The replay a trace of ``cfg`` runs: on a CUDA device (NVIDIA, and AMD's ROCm through the same allocator) unless
    the user fixed the allocator's margin; its capacity the one the trace's fit is judged against (reserved beside
    ``memory_capacity``, as the formula judges it), so a note never says the capacity was reached beside "fits"."""
    from batchlab.config import Backend

    if cfg.device_spec.backend is not Backend.CUDA or cfg.assumptions.allocator_margin is not None:
        return None
    return AllocatorReplay(cfg.memory_capacity)


def replay_note(r: ReplayResult, workspace: int) -> str:
    """The trace's note on its reserved view: the replay's peak, what sat cached and empty, and the ``workspace``
    (the cuBLAS workspace, formula/allocator.py) added to it."""
    from batchlab.util.units import fmt_bytes

    def largest(stream: str) -> str:  # its largest blocks: the sizes of the tensors that were freed there
        sizes = [s for s in r.blocks_at_peak.get(stream, ()) if s >= MiB]
        shown = ", ".join(fmt_bytes(s) for s in sizes[:6]) + (", ..." if len(sizes) > 6 else "")
        return f" (blocks {shown})" if len(sizes) > 1 else ""

    empty = ", ".join(f"{fmt_bytes(v)} on {k}{largest(k)}" for k, v in sorted(r.free_at_peak.items()) if v >= MiB)
    return (f"reserved: the traced update's storages replayed through CUDACachingAllocator's block rules "
            f"(trace/replay.py): peak reserved {fmt_bytes(r.peak_reserved_bytes)} (cached and empty at the peak of "
            f"allocated: {empty or 'none'}) + the cuBLAS workspace ({fmt_bytes(workspace)}, PyTorch #120925)"
            + ("; the device's capacity was reached even with the cache released" if r.out_of_memory else ""))


def _stream_name(s) -> str | None:
    """The attribute that holds stream ``s`` on its owner (FSDP2's comm context: ``all_gather_copy_in_stream``,
    ``reduce_scatter_stream``, ...), as the notes name its pool; None where no object names it so."""
    import gc

    for owner in gc.get_referrers(s):  # an instance's attributes (its own dict in Python 3.11+), or that dict
        table = owner if isinstance(owner, dict) else getattr(owner, "__dict__", None)
        for key, value in (table.items() if isinstance(table, dict) else ()):
            if value is s and isinstance(key, str) and key.endswith("stream"):
                return key.replace("_", " ")
    return None


@contextlib.contextmanager
def streams(device_type: str):
    """Within: ``torch.<device>.stream(s)`` (FSDP2's ``device_handle.stream``) makes storages created inside
    belong to ``s``'s pool; the current stream stays the default pool."""
    import torch

    module = torch.get_device_module(device_type)
    original = module.stream
    names: dict[int, str] = {}  # FSDP2's copy-in, all-gather and reduce-scatter streams, in order of first use

    @contextlib.contextmanager
    def stream(s):
        side = s is not None and s != module.current_stream()
        if side and id(s) not in names:
            names[id(s)] = _stream_name(s) or f"side stream {len(names) + 1}"
        token = _STREAM.set(names[id(s)] if side else COMPUTE)
        try:
            with original(s):
                yield
        finally:
            _STREAM.reset(token)

    module.stream = stream
    try:
        yield
    finally:
        module.stream = original
