"""Live tensor-storage tracking: the peak tensor bytes of an update, its phase and breakdown.

Works with real tensors (CPU, where there is no caching allocator to ask) and under FakeTensorMode (the
trace), with identical numbers.  Every storage an op creates is counted until its finalizer runs;
storages that exist before tracking starts (parameters, optimizer state) are registered explicitly, since
an op returning a view of a parameter would otherwise look like a new storage.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from batchlab.config.phase import Phase
from batchlab.measure.shards import local_shard

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries", "data")
_CREATED_AS = {Phase.DATA: "data", Phase.FORWARD: "activations", Phase.BACKWARD: "temporaries",
               Phase.OPTIMIZER: "temporaries"}
# FSDP2's flat buffers, classified by what they hold whatever the phase: the copy-in and all-gather output
# are (working copies of) parameters; the reduce-scatter input and output are gradients.
_RELABEL = {"all_gather_copy_in": "parameters", "_allgather_base_": "parameters", "chunk_cat": "gradients",
            "_reduce_scatter_base_": "gradients"}
_TO_COPY = torch.ops.aten._to_copy.default
_DEVICE = torch.ops.prim.device.default
try:
    from torch.distributed.tensor import DTensor as _DTENSOR
except ImportError:  # a build without torch.distributed
    _DTENSOR = None


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank stores); a plain tensor itself; a wrapper subclass's one inner
    tensor (a functional collective's AsyncCollectiveTensor wraps its result): the wrapper's own storage holds no
    memory (an invalid python storage that still reports the wrapped size)."""
    if type(t) is torch.Tensor:
        return t
    local = local_shard(t)
    if local is not t:
        return local
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        if len(names) == 1:
            return _local(getattr(t, names[0]))
    return t


# leaves of an op's arguments that hold no tensor (pytree leaves too, so skipping them keeps its order)
_ATOMS = frozenset({type(None), bool, int, float, complex, str, torch.device, torch.dtype, torch.layout,
                    torch.memory_format})


def _collect(x, out: list) -> bool:
    for v in x.values() if type(x) is dict else x:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif type(v) in (tuple, list, dict):
            if not _collect(v, out):
                return False
        elif type(v) not in _ATOMS:
            return False
    return True


def tensors_in(x) -> list[torch.Tensor]:
    """The tensors in an op's arguments or output in ``tree_flatten``'s order.  Plain tuples, lists and dicts of
    tensors and scalars (every aten op's) are walked directly: building a pytree spec per op cost ~8% of a
    fake-tensor trace's CPU time; anything else (a namedtuple, a registered node) goes through ``tree_flatten``."""
    if isinstance(x, torch.Tensor):
        return [x]
    if type(x) in _ATOMS:
        return []
    out: list[torch.Tensor] = []
    if type(x) in (tuple, list, dict) and _collect(x, out):
        return out
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


@dataclass
class MemorySnapshot:
    peak_bytes: int
    peak_phase: Phase
    breakdown: dict[str, int]  # category -> bytes live at the peak; sums to peak_bytes
    activations_bytes: int  # bytes created by the last forward and still held when backward starts
    baseline_bytes: int  # live at start (parameters + optimizer state)
    phase_peaks: dict[str, int] = field(default_factory=dict)  # highest live bytes seen in each phase
    # activations_bytes by the label ``owner()`` gave when each storage was created (trackers given an owner)
    activations_by_owner: dict[str, int] = field(default_factory=dict)


class StorageListener(Protocol):
    """Sees every storage event of a tracker (the memory timeline records them; batchlab.timeline)."""

    def added(self, key: int, nbytes: int, category: str) -> None: ...
    def freed(self, key: int) -> None: ...
    def relabelled(self, key: int, category: str) -> None: ...  # a backward output that became a .grad
    def op_done(self, func, args) -> None: ...  # after an op's outputs are counted (live bytes as of now)


class BudgetExceeded(MemoryError):
    """Tracked tensor bytes went over the memory budget (CPU stand-in for a device with less memory).

    Raised right after the op whose output crossed the budget, so at most that op's output is allocated
    past it; a MemoryError so that code handling real out-of-memory handles this too.
    """

    def __init__(self, live_bytes: int, budget: int, phase: Phase):
        self.live_bytes, self.budget, self.phase = live_bytes, budget, phase
        super().__init__(f"tracked tensor bytes {live_bytes:,} exceed the memory budget {budget:,}")


class StorageTracker(TorchDispatchMode):
    """Use as ``with tracker:`` around one or more updates; call ``mark(phase)`` between phases."""

    def __init__(self, budget: int | None = None, owner: Callable[[], str] | None = None,
                 listener: StorageListener | None = None, observer: Callable | None = None, fake: bool = True):
        super().__init__()
        self.fake = fake  # the update runs on fake tensors (the trace): count their storages
        self.listener = listener
        # observer(func, args, kwargs, out) sees each op as it returns, before its storages are counted: the
        # trace's op recorder (trace/ops.py) rides on this mode, as a second mode it cost a Python call and a
        # re-dispatch per op, most of them prim.device queries fake tensors make
        self.observer = observer
        self._relabels: dict = {}  # op overload -> the FSDP2 buffer category its outputs get (_RELABEL), or None
        # owner() labels each new storage (the trace passes the module running now: "what keeps what")
        self._owner = owner
        self._owners: dict[int, str] = {}
        self._activations_by_owner: dict[str, int] = {}
        self.budget = budget  # bytes; an op whose output takes live bytes past it raises BudgetExceeded
        self.exceeded: BudgetExceeded | None = None
        self._live: dict[int, tuple[int, str]] = {}  # id(storage) -> (bytes, created-as category)
        self._current = 0
        self.phase = Phase.DATA
        self._peak = -1
        self._peak_phase = Phase.DATA
        self._peak_keys: dict[int, tuple[int, str]] = {}
        self._phase_peaks: dict[str, int] = {}
        self._param_keys: set[int] = set()
        self._hooks: list = []
        self._forward_start_keys: set[int] = set()
        self._resizable: dict[int, object] = {}  # id(storage) -> storage whose size changes in place
        self._activation_bytes = 0
        self._baseline = 0
        self._finalizers: dict[int, weakref.finalize] = {}  # id(storage) -> its finalizer (release() detaches)
        # storages that exist before tracking and are left out on purpose, held (their ids stay theirs) so that an
        # in-place op returning one does not count it as new: AdamW's 0-dim step counters (register_optimizer)
        self._uncounted: dict[int, object] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # True: torch.compile'd code runs compiled under the tracker (False makes dynamo fall back to eager), and
        # the tracker sees the compiled artifact's aten ops at run time: every op of the trace's partitioned
        # graphs (trace/compiled.py); inductor's own buffers bypass the dispatcher, so a measured compiled run
        # reads the allocator instead (measure/allocmem.py)
        return True

    @property
    def live_bytes(self) -> int:
        """Tracked bytes live now."""
        return self._current

    # -- registration of what exists before tracking
    def register(self, tensors, category: str) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                t = _local(t)
                self._add(t.untyped_storage(), category)
                if category == "parameters":
                    self._param_keys.add(id(t.untyped_storage()))

    def register_resizable(self, tensors, category: str) -> None:
        """Storages resized in place (FSDP2 gathers into a storage grown to full size and frees it by resizing
        to 0): no op creates or frees them, so their size is re-read after every op."""
        for t in tensors:
            st = t.untyped_storage()
            self._add(st, category)
            self._resizable[id(st)] = st

    def resync(self) -> None:
        for key, st in self._resizable.items():
            n = st.nbytes()
            entry = self._live.get(key)
            if entry is not None and entry[0] != n:
                self._current += n - entry[0]
                self._live[key] = (n, entry[1])
                if self.listener is not None:  # a resize is a free of the old bytes and a new storage
                    self.listener.freed(key)
                    self.listener.added(key, n, entry[1])
                self._note_peak()

    def _relabel(self, tensors, category: str) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                key = id(_local(t).untyped_storage())
                if key in self._live:
                    self._live[key] = (self._live[key][0], category)
                    if self.listener is not None:
                        self.listener.relabelled(key, category)

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Per-parameter state (AdamW's m and v) is counted; 0-dim state (AdamW's step counters, 4 B per parameter
        tensor, kept in host memory on CUDA, as the formula's 8 B per parameter has it) never is, even when
        ``step += 1`` returns it from an op (it was counted from that op on, so a peak late in the step held
        some counters and an earlier one none).  PyTorch's MemTracker counts them on CPU."""
        optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's shard
        for state in optimizer.state.values():
            tensors = [_local(v) for v in state.values() if isinstance(v, torch.Tensor)]
            self.register([t for t in tensors if t.dim() > 0], "optimizer")
            for t in tensors:
                if t.dim() == 0:
                    st = t.untyped_storage()
                    self._uncounted[id(st)] = st

    def watch_gradients(self, params) -> None:
        """Gradients are created by backward ops as ordinary storages; note which ones end up in .grad."""
        for p in params:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook))

    def _grad_hook(self, p: torch.Tensor) -> None:
        key = id(_local(p.grad).untyped_storage()) if p.grad is not None else None
        if key in self._live:
            self._live[key] = (self._live[key][0], "gradients")
            if self.listener is not None:
                self.listener.relabelled(key, "gradients")

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def release(self) -> None:
        """Done with it (take the snapshot first): the finalizers on storages still alive are detached and the
        bookkeeping freed, so nothing of the tracked update outlives it in the training process."""
        for f in self._finalizers.values():
            f.detach()
        for d in (self._finalizers, self._live, self._peak_keys, self._owners, self._resizable, self._uncounted):
            d.clear()
        self._forward_start_keys = set()
        self._param_keys = set()

    def __exit__(self, *exc):
        # leaving the tracked region also removes the gradient hooks put on the model's parameters
        try:
            return super().__exit__(*exc)
        finally:
            self.close()

    # -- bookkeeping
    def _add(self, st, category: str) -> None:
        key = id(st)
        if key in self._live or key in self._uncounted:
            return
        n = st.nbytes()
        self._live[key] = (n, category)
        self._current += n
        self._finalizers[key] = weakref.finalize(st, self._free, key)
        if self.listener is not None:
            self.listener.added(key, n, category)
        if self._owner is not None:
            self._owners[key] = self._owner()
        self._note_peak()

    def _note_peak(self) -> None:
        if self._current > self._phase_peaks.get(self.phase, -1):
            self._phase_peaks[self.phase] = self._current
        if self._current > self._peak:
            self._peak = self._current
            self._peak_phase = self.phase
            self._peak_keys = dict(self._live)

    def _free(self, key: int) -> None:
        self._finalizers.pop(key, None)
        entry = self._live.pop(key, None)
        self._owners.pop(key, None)
        if entry is not None:
            self._current -= entry[0]
            if self.listener is not None:
                self.listener.freed(key)

    def mark(self, phase: Phase | str) -> None:
        phase = Phase(phase)
        if phase is Phase.FORWARD and self.phase is not Phase.FORWARD:
            self._forward_start_keys = set(self._live)
        if phase is Phase.BACKWARD:
            # what forward made and backward will read, in the breakdown's own vocabulary: autocast's 16-bit
            # weight copies are created in forward too, but they are "parameters" (as the formula counts them)
            kept = {k: n for k, (n, cat) in self._live.items() if k not in self._forward_start_keys
                    and cat == "activations"}
            self._activation_bytes = sum(kept.values())
            if self._owner is not None:
                by_owner: dict[str, int] = {}
                for k, n in kept.items():
                    by_owner[self._owners[k]] = by_owner.get(self._owners[k], 0) + n
                self._activations_by_owner = by_owner
        self.phase = phase

    def reset(self) -> None:
        """Start a new measurement window (what is live now becomes the baseline)."""
        self._peak = self._current
        self._peak_phase = self.phase
        self._peak_keys = dict(self._live)
        self._phase_peaks = {}
        self._baseline = self._current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE and type(args[0]) is FakeTensor:
            # a fake tensor's device query (half to two thirds of the calls a fake update makes here), answered
            # as FakeTensorMode answers it (fake_tensor._device_handler: the fake device, meta inside a kernel)
            # without dispatching it again; a mode entered before this one does not see it (no tensor work)
            out = args[0].device
        elif _DTENSOR is not None and _DTENSOR in types:
            # a DTensor op: handed on to DTensor's own dispatch with this mode still on, so that every local op
            # it runs is seen (a mode is off while its own handler runs: the storages of a redistribution's
            # buffers or of loss_parallel's working set would go unseen); its output is one of those
            return NotImplemented
        else:
            out = func(*args, **kwargs)
        if self.observer is not None:
            self.observer(func, args, kwargs, out)
        if self._resizable:
            self.resync()
        relabel = self._relabels.get(func, False)
        if relabel is False:  # per overload: ``namespace`` splits the schema name on every read
            relabel = self._relabels[func] = _RELABEL.get(func._opname) if func.namespace in ("fsdp", "c10d") else None
        category = relabel or _CREATED_AS.get(self.phase, "temporaries")
        if (func is _TO_COPY and isinstance(args[0], torch.Tensor)
                and id(_local(args[0]).untyped_storage()) in self._param_keys):
            category = "parameters"  # autocast's low-precision working copy of a weight
        for t in tensors_in(out):
            if type(t) is FakeTensor and not self.fake:
                continue  # DTensor's sharding propagation on fake tensors (no memory) during a real update
            # a mode sees a DTensor op before DTensor does: the storage is the output's local shard
            self._add(_local(t).untyped_storage(), category)
        if relabel:
            self._relabel(tensors_in((args, out)), relabel)
        if self.listener is not None:
            self.listener.op_done(func, args)
        if self.budget is not None and self._current > self.budget:
            # every allocation that leaves live bytes over the budget is refused, like a real allocator
            self.exceeded = BudgetExceeded(self._current, self.budget, self.phase)
            raise self.exceeded
        return out

    def snapshot(self) -> MemorySnapshot:
        breakdown = dict.fromkeys(CATEGORIES, 0)
        for n, category in self._peak_keys.values():
            breakdown[category] += n
        assert sum(breakdown.values()) == max(self._peak, 0)
        return MemorySnapshot(peak_bytes=max(self._peak, 0), peak_phase=self._peak_phase, breakdown=breakdown,
                              activations_bytes=self._activation_bytes, baseline_bytes=self._baseline,
                              phase_peaks=dict(self._phase_peaks),
                              activations_by_owner=dict(self._activations_by_owner))


def tracker_for(trainer, budget: int | None = None, owner: Callable[[], str] | None = None,
                listener: StorageListener | None = None, observer: Callable | None = None) -> StorageTracker:
    """A tracker for ``trainer``'s next update: parameters, buffers and optimizer state registered (they
    exist before tracking starts), gradients watched, baseline set.  Call ``close()`` when done."""
    params = list(trainer.raw_model.parameters())
    fake = any(isinstance(_local(p), FakeTensor) for p in params) or not params  # a DTensor: its shard
    tracker = StorageTracker(budget=budget, owner=owner, listener=listener, observer=observer, fake=fake)
    tracker.register(params, "parameters")
    tracker.register([b for b in trainer.raw_model.buffers()], "parameters")
    tracker.register_optimizer(trainer.optimizer)
    # gradients still alive from the previous update: kept between updates (zeroed in place, not set to
    # None; DDP's buckets) or zeroed late by a framework (e.g. Lightning)
    tracker.register([p.grad for p in params if p.grad is not None], "gradients")
    tracker.watch_gradients(params)
    tracker.reset()
    return tracker


def track_update(trainer, steady: bool = True, budget: int | None = None) -> MemorySnapshot:
    """Peak tensor memory of one update of ``trainer`` (after one untracked update when ``steady``:
    AdamW creates its state lazily, so the first update lacks it).  With ``budget`` (bytes), raises
    BudgetExceeded as soon as live tensor bytes go over it (the steadying update is tracked too)."""
    if steady and trainer.updates_done == 0:
        track_update(trainer, steady=False, budget=budget) if budget is not None else trainer.update()
    tracker = tracker_for(trainer, budget)
    with tracker:
        trainer.update(listener=tracker)
    return tracker.snapshot()


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors``: views and tied weights share one and count once
    (a tensor's storage object is preserved, so its identity is the key; fake tensors included)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[id(st)] = st.nbytes()
    return sum(seen.values())
