"""Recording the timeline from the live-storage tracker (CPU real tensors, and the trace's fake tensors).

A StorageListener mirrors every storage the tracker counts, refines two of its categories (the tracker
calls both "activations" / "temporaries") and takes a sample after each op that changes what is live:

- logits/loss: created in forward from the LM head on (the head's forward pre-hook sets the flag);
- recompute: created in backward while a module's forward runs (activation checkpointing re-running it).

Its total equals the tracker's at every event (same storages, same sizes), so the sample at its peak is
the tracker's peak state, byte for byte.
"""
from __future__ import annotations

import re
from typing import Callable

import torch
import torch.nn as nn

from batchlab.measure.memory import StorageTracker
from batchlab.timeline.data import CATEGORIES, PhaseSpan, Timeline

# Not counted in the op index, so a trace and a real run number the same ops alike: .item() (the trace reads
# no values) and prim ops (fake tensors answer .device through the dispatcher; real tensors do not).
_UNCOUNTED = {torch.ops.aten._local_scalar_dense.default}


def _counted(func, args) -> int:
    """Ops this dispatch counts as: a foreach op as one per tensor (fake tensors take the per-tensor path
    in clip_grad_norm_, real ones the foreach path), the uncounted ones as none."""
    if func in _UNCOUNTED or getattr(func, "namespace", "") == "prim":
        return 0
    if func.__name__.startswith("_foreach_") and args and isinstance(args[0], (list, tuple)):
        return len(args[0])
    return 1


def output_head(model: nn.Module, vocab: int) -> nn.Module | None:
    """The module that makes the logits: HF's get_output_embeddings(), else the last Linear to ``vocab``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is not None:
        return head
    heads = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == vocab]
    return heads[-1] if heads else None


def _phase_labels():
    micro = 0

    def label(phase: str) -> str:
        nonlocal micro
        if phase == "forward":
            micro += 1
        return f"{phase} {micro}" if phase in ("forward", "backward") else phase
    return label


class TimelineRecorder:
    """Pass as the tracker's ``listener``; ``start(tracker)`` after the tracker's reset, ``finish()`` after
    the update, then ``timeline(...)``."""

    def __init__(self, owner: Callable[[], str], outside: str, head: nn.Module | None):
        self._owner, self._outside = owner, outside
        self._live: dict[int, tuple[int, str, str]] = {}  # key -> (bytes, category, creating module)
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.tracker: StorageTracker | None = None
        self._op = 0
        self._after_head = False
        self._hook = head.register_forward_pre_hook(self._head_runs) if head is not None else None
        self._label = _phase_labels()
        self._phase, self._phase_label = None, ""
        self.spans: list[list] = []  # [label, phase, first_op, last_op]
        self.ops: list[int] = []
        self.phase_of: list[int] = []
        self.op_names: list[str] = []
        self.parts: dict[str, list[int]] = {c: [] for c in CATEGORIES}
        self._last: tuple[int, ...] | None = None
        self._best, self.peak_sample, self._peak_live = -1, 0, {}

    def _head_runs(self, module, args) -> None:
        if self.tracker is not None and self.tracker.phase == "forward":
            self._after_head = True

    # -- StorageListener
    def added(self, key: int, nbytes: int, category: str) -> None:
        phase = self.tracker.phase if self.tracker is not None else "setup"
        owner = self._owner()
        if category == "activations" and self._after_head:
            category = "logits"
        elif category == "temporaries" and phase == "backward" and owner != self._outside:
            category = "recompute"
        self._live[key] = (nbytes, category, owner)
        self.live[category] += nbytes

    def freed(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.live[entry[1]] -= entry[0]

    def relabelled(self, key: int, category: str) -> None:
        n, old, owner = self._live[key]
        self.live[old] -= n
        self.live[category] += n
        self._live[key] = (n, category, owner)

    def op_done(self, func, args) -> None:
        n = _counted(func, args)
        if not n:
            return
        self._op += n
        self._sample(str(func), first=self._op - n + 1)

    # -- sampling
    def start(self, tracker: StorageTracker) -> None:
        self.tracker = tracker
        self._sample("")

    def _sample(self, name: str, first: int | None = None) -> None:
        phase = self.tracker.phase
        if phase != self._phase:
            self._phase = phase
            if phase == "forward":
                self._after_head = False
            self.spans.append([self._label(phase), phase, self._op if first is None else first, self._op])
        self.spans[-1][3] = self._op
        now = tuple(self.live.values())
        if now == self._last:
            return
        self._last = now
        self.ops.append(self._op)
        self.phase_of.append(len(self.spans) - 1)
        self.op_names.append(name)
        for c in CATEGORIES:
            self.parts[c].append(self.live[c])
        total = sum(now)
        if total > self._best:
            self._best, self.peak_sample, self._peak_live = total, len(self.ops) - 1, dict(self._live)

    def finish(self) -> None:
        """After the update: what ops did not free (zero_grad(set_to_none) drops the gradients) is sampled."""
        self._sample("")
        if self._hook is not None:
            self._hook.remove()

    def by_module(self) -> dict[str, dict[str, int]]:
        """At the peak: bytes each block (the module label up to its layer number) created and still holds."""
        out: dict[str, dict[str, int]] = {}
        for n, category, owner in self._peak_live.values():
            if category in ("parameters", "optimizer", "gradients", "data"):
                continue  # model states and inputs: not created by a module's code
            block = block_of(owner)
            cats = out.setdefault(block, {})
            cats[category] = cats.get(category, 0) + n
        return out

    def timeline(self, *, provenance: str, method: str, title: str, peak_bytes: int, capacity_bytes: int = 0,
                 formula_phase_peaks: dict[str, int] | None = None, notes=(), overlaps=None) -> Timeline:
        return Timeline(provenance=provenance, method=method, title=title, ops=tuple(self.ops),
                        phase_of=tuple(self.phase_of), phases=tuple(PhaseSpan(*s) for s in self.spans),
                        parts={c: tuple(v) for c, v in self.parts.items()}, op_names=tuple(self.op_names),
                        peak_bytes=peak_bytes, peak_sample=self.peak_sample, at_peak_by_module=self.by_module(),
                        capacity_bytes=capacity_bytes, formula_phase_peaks=dict(formula_phase_peaks or {}),
                        notes=tuple(notes), overlaps=dict(overlaps or {}))


_LAYER = re.compile(r"^(.*?\.\d+)(\.|$)")


def block_of(label: str) -> str:
    """``blocks.3.attn.q`` -> ``blocks.3``; ``model.layers.0.mlp`` -> ``model.layers.0``; else unchanged."""
    m = _LAYER.match(label)
    return m.group(1) if m else label


class _Both:
    """Two storage listeners as one."""

    def __init__(self, first, second):
        self.pair = (first, second)

    def added(self, key, nbytes, category):
        for x in self.pair:
            x.added(key, nbytes, category)

    def freed(self, key):
        for x in self.pair:
            x.freed(key)

    def relabelled(self, key, category):
        for x in self.pair:
            x.relabelled(key, category)

    def op_done(self, func, args):
        for x in self.pair:
            x.op_done(func, args)


def recorded_update(trainer, owner: Callable[[], str], outside: str,
                    tree_owner: Callable[[], str] | None = None, register: Callable | None = None,
                    observer: Callable | None = None, listen: Callable | None = None, also=None):
    """One update of ``trainer`` tracked by the StorageTracker with a recorder listening: (snapshot, recorder).
    ``tree_owner``: the tracker's own owner labels (``--tree``), unchanged by the recording; ``register``:
    called with the tracker before the update (storages no op creates, e.g. a DP engine's buffers);
    ``observer``: the tracker's (sees every op's arguments and output); ``listen``: tracker -> the update's
    listener wrapping it (the harness's phase recorder, so a failure names its phase); ``also``: a second storage
    listener (the trace's allocator replay)."""
    from batchlab.measure.memory import tracker_for

    recorder = TimelineRecorder(owner, outside, output_head(trainer.raw_model, trainer.cfg.model.vocab))
    tracker = tracker_for(trainer, owner=tree_owner, listener=recorder if also is None else _Both(recorder, also),
                          observer=observer)
    if register is not None:
        register(tracker)
        tracker.reset()
    recorder.start(tracker)
    try:
        with tracker:
            trainer.update(listener=listen(tracker) if listen is not None else tracker)
    finally:
        recorder.finish()
    return tracker.snapshot(), recorder


def context(cfg) -> dict:
    """Title, device capacity and the formula's phase peaks (tensor bytes) for a timeline of ``cfg``."""
    from batchlab.config import ConfigError
    from batchlab.formula.memory import memory

    try:
        peaks = dict(memory(cfg).phase_peaks)
    except (ConfigError, ValueError, KeyError):  # a model the formula cannot describe: no markers
        peaks = {}
    title = (f"{cfg.model.name} ({cfg.model_source}), seq {cfg.seq}, micro-batch {cfg.micro_batch} x accum "
             f"{cfg.accum} x DP {cfg.dp} = global batch {cfg.global_batch}, ac={cfg.ac}, {cfg.precision}")
    notes, overlaps = [], {}
    layout = cfg.parallel
    if cfg.dp > 1 and not layout.fsdp:
        notes.append(f"rank 0 of a fake process group: the gradient all-reduce (DP = {cfg.dp}) is drawn where DDP "
                     "runs it (overlapped with the last micro-batch's backward, no_sync before); its buckets are "
                     "counted as the gradients kept between updates, its time is not")
        overlaps["gradient all-reduce (not run here)"] = f"backward {cfg.accum}"
    elif cfg.dp > 1:
        notes.append(f"rank 0 of a fake process group: FSDP2 (ZeRO-{layout.stage}) gathers and frees as on a real run; "
                     "its all-gathers and reduce-scatters run in every forward and backward, not drawn, not timed")
    return {"title": title, "capacity_bytes": cfg.memory_capacity, "formula_phase_peaks": peaks, "notes": notes,
            "overlaps": overlaps}
