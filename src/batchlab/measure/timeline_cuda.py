"""The timeline of a CUDA update from the caching allocator's own history.

``torch.cuda.memory._record_memory_history`` keeps every alloc/free of the update (no stack traces: cheap);
``_snapshot()`` hands them back.  Phases: at each harness mark the allocator's cumulative allocation count
(``memory_stats()["allocation.all.allocated"]`` and ``["allocation.all.freed"]``, host-side, no synchronise)
say which alloc and free-request events came before it.  Categories as the tracker's: what is live at the start is parameters / optimizer state by
address; allocations are activations (forward), temporaries (backward, optimizer) or data; the blocks the
parameters' .grad tensors occupy when the optimizer phase starts are gradients.  Block sizes are the
allocator's rounded ones, as in memory_allocated(); the x axis is the allocator event index, not an op index.
Private API (PyTorch 2.x): written against 2.13; a missing or changed history raises and the caller reports it.
"""
from __future__ import annotations

import torch

from batchlab.timeline.data import CATEGORIES, PhaseSpan, Timeline

_CREATED_AS = {"data": "data", "forward": "activations", "backward": "temporaries", "optimizer": "temporaries"}


class _Marks:
    """A phase listener: remembers (phase, allocations so far, frees so far) at every mark; the optimizer mark also
    notes the .grad blocks."""

    def __init__(self, trainer, device):
        self.trainer, self.device = trainer, device
        self.marks: list[tuple[str, int, int]] = []
        self.grad_addrs: set[int] = set()

    def count(self) -> tuple[int, int]:
        stats = torch.cuda.memory_stats(self.device)
        return stats.get("allocation.all.allocated", 0), stats.get("allocation.all.freed", 0)

    def mark(self, phase: str) -> None:
        self.marks.append((phase, *self.count()))
        if phase == "optimizer":
            self.grad_addrs = {p.grad.data_ptr() for p in self.trainer.raw_model.parameters() if p.grad is not None}


def _known(trainer) -> dict[int, str]:
    model = trainer.raw_model
    known = {t.data_ptr(): "parameters" for t in list(model.parameters()) + list(model.buffers())}
    for s in trainer.optimizer.state.values():
        known.update({v.data_ptr(): "optimizer" for v in s.values() if isinstance(v, torch.Tensor) and v.is_cuda})
    return known


def _baseline(trainer, device, start: int) -> dict[str, int]:
    from batchlab.measure.devmem import model_state_bytes

    parts = dict.fromkeys(CATEGORIES, 0)
    states = model_state_bytes(trainer)
    parts.update(states)
    parts["temporaries"] = max(start - sum(states.values()), 0)  # anything else live between updates
    return parts


def record_cuda(trainer, ctx: dict) -> Timeline:
    device = trainer.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    listener = _Marks(trainer, device)
    first = listener.count()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", clear_history=True,
                                             device=device)
    try:
        trainer.update(listener=listener)
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
    peak = torch.cuda.max_memory_allocated(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    events = snapshot["device_traces"][index]
    return _replay(events, listener, first, _baseline(trainer, device, start), _known(trainer), peak, ctx)


def _replay(events, listener: _Marks, first: tuple[int, int], parts: dict[str, int], known: dict[int, str],
            peak: int, ctx: dict) -> Timeline:
    """Live bytes by category after every alloc / free event (see the module docstring)."""
    live: dict[int, tuple[int, str]] = {}
    marks = [(phase, a - first[0], f - first[1]) for phase, a, f in listener.marks]
    spans: list[list] = [["data", "data", 0, 0]]
    micro, allocs, frees, m = 0, 0, 0, 0
    ops, phase_of, names, cols = [0], [0], [""], {c: [parts[c]] for c in CATEGORIES}
    best, peak_sample = sum(parts.values()), 0
    for i, e in enumerate(events, start=1):
        action = e.get("action")
        if action not in ("alloc", "free_requested"):
            continue  # free_completed follows a free_requested (deferred by stream use); segments: reserved memory
        while m < len(marks) and marks[m][1] <= allocs and marks[m][2] <= frees:  # the phase this event is in
            phase = marks[m][0]
            m += 1
            if phase == spans[-1][1]:  # the update's own "data" mark: the span is open already
                continue
            micro += phase == "forward"
            spans.append([f"{phase} {micro}" if phase in ("forward", "backward") else phase, phase, i, i])
        if action == "alloc":
            allocs += 1
            cat = "gradients" if e["addr"] in listener.grad_addrs and spans[-1][1] == "backward" else \
                _CREATED_AS.get(spans[-1][1], "temporaries")
            live[e["addr"]] = (e["size"], cat)
            parts[cat] += e["size"]
        else:
            frees += 1
            n, cat = live.pop(e["addr"], (e["size"], known.get(e["addr"], "temporaries")))
            parts[cat] -= n
        spans[-1][3] = i
        ops.append(i)
        phase_of.append(len(spans) - 1)
        names.append(action)
        for c in CATEGORIES:
            cols[c].append(parts[c])
        if sum(parts.values()) > best:
            best, peak_sample = sum(parts.values()), len(ops) - 1
    notes = list(ctx["notes"])
    if best != peak:
        notes.append(f"the allocator history's maximum ({best:,} B) differs from max_memory_allocated "
                     f"({peak:,} B): history entries were lost (ring buffer) or the API changed")
    return Timeline(provenance="allocator", method="CUDA caching allocator history (_record_memory_history)",
                    title=ctx["title"], ops=tuple(ops), phase_of=tuple(phase_of),
                    phases=tuple(PhaseSpan(*s) for s in spans), parts={c: tuple(v) for c, v in cols.items()},
                    op_names=tuple(names), peak_bytes=peak, peak_sample=peak_sample, capacity_bytes=ctx["capacity_bytes"],
                    formula_phase_peaks=ctx["formula_phase_peaks"], notes=tuple(notes), overlaps=ctx["overlaps"])
