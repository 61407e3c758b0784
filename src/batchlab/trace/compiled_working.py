"""Derive the formula's compiled backward working set (``formula/compiled.py`` ``working_bytes``): what one compiled
block's backward holds at its high points, as monomials in b, s, k, g, d, f.

A checkpointed block's compiled backward recomputes what its forward did not save inside the backward graph, and
inductor fuses most of that recompute into the gradient kernels: of the layer the eager formula restores whole,
only the buffers inductor realises exist, each freed at its last use.  So the working set is read off inductor's own
plan: one block is compiled by inductor at the derivation's prime dimensions (trace/compiled_terms.py), its wrapper
run on fake tensors with no kernel built (trace/inductor_plan.py), and while its backward runs the storages it holds
are followed: the saved tensors and the incoming gradient it is called with, and every buffer it allocates
(recomputed activations, activation gradients, the weight gradients it returns).  At each local high point the
live storages' sizes factor into monomials as the saved tensors' do, so each high point is a sum of monomials; the
formula takes the largest at its own shape (the schedule is the graph's, not the shape's; the min-cut's choice is
checked at another number of KV heads, as the saved terms are).

    PYTHONPATH=src python -m batchlab.trace.compiled_working [--missing] [--only=KEY,...]
    # rewrites formula/compiled_working_table.py (an inductor compile per derivation: about an hour for all)
"""
from __future__ import annotations

import contextlib
import itertools
import sys
from fractions import Fraction
from pathlib import Path

import torch

from batchlab.trace import compiled_terms as ct

Terms = dict  # exponents -> coefficient (bytes per unit monomial)
UNPAIRED = ("the backward's high points are no sums of monomials in the dimensions (checked at two values of g and "
            "with another number of KV heads): the eager working set is used")


class _Window:
    """A StorageListener that follows the storages one compiled backward call holds (``start``/``end`` around the
    call) and keeps the live sizes at each local high point."""

    def __init__(self):
        self.tracker = None
        self.active = False
        self.live: dict[int, int] = {}  # key -> bytes
        self.total = 0
        self.top: tuple[int, list[int]] | None = None  # (bytes, sizes in the order made) of the rise in progress
        self.highs: list[list[int]] = []
        self.calls = 0

    # -- inductor_plan's call hook
    def start(self, args) -> None:
        if torch._C._current_graph_task_id() == -1:  # a forward graph
            return
        self.calls += 1
        self.active, self.live, self.total, self.top = True, {}, 0, None
        known = self.tracker._live
        for t in args:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = id(st)
            entry = known.get(key)
            if entry is not None and entry[1] == "parameters":
                continue  # a weight the graph reads: resident, not the block's
            self._add(key, entry[0] if entry is not None else st.nbytes())  # not tracked: a generator's state
        self._note()

    def end(self) -> None:
        if self.active:
            self._commit()
            self.active = False

    # -- StorageListener
    def added(self, key: int, nbytes: int, category: str) -> None:
        if self.active and category != "parameters":
            self._add(key, nbytes)

    def freed(self, key: int) -> None:
        if self.active and key in self.live:
            self._commit()
            self.total -= self.live.pop(key)

    def relabelled(self, key: int, category: str) -> None:
        pass

    def op_done(self, func, args) -> None:
        if self.active:
            self._note()

    def _add(self, key: int, nbytes: int) -> None:
        if key not in self.live:
            self.live[key] = nbytes
            self.total += nbytes

    def _note(self) -> None:
        if self.top is None or self.total > self.top[0]:
            self.top = (self.total, list(self.live.values()))

    def _commit(self) -> None:
        """The rise in progress ends (a storage is freed): its high point is one candidate."""
        if self.top is not None and self.top[0] >= self.total:
            self.highs.append(self.top[1])
            self.top = None


def _dominated(a: Terms, b: Terms) -> bool:
    """a ≤ b at every shape: every coefficient of a at most b's (all are non-negative)."""
    return all(c <= b.get(e, 0) for e, c in a.items())


def pruned(highs: list[Terms]) -> list[Terms]:
    """The high points no other one bounds at every shape."""
    out: list[Terms] = []
    for i, h in enumerate(highs):
        if not any(_dominated(h, o) and (h != o or j < i) for j, o in enumerate(highs) if j != i):
            out.append(h)
    return out


@contextlib.contextmanager
def planned_update(cfg, family: str, window_of, order=contextlib.nullcontext()):
    """One update of ``cfg`` on fake tensors, compiled by inductor with no kernel built, its storages followed by
    the window ``window_of(batch)`` makes (inductor_plan.CALLS); yields (trainer, window) after backward, still on
    fake tensors.  ``order``: a patch of inductor's scheduling (trace/compiled_model_working.py)."""
    from batchlab.measure.memory import StorageTracker
    from batchlab.models.compiled import using_backend
    from batchlab.trace import inductor_plan
    from batchlab.trace.compiled import _tracker_rules
    from batchlab.trace.patches import eager_branches
    from batchlab.trace.run import FakeTrainer, fake_mode

    torch._dynamo.reset()
    _tracker_rules()
    # dynamo breaks the graph around a checkpointed block whose forward mutates state, unless told not to replay it
    replay = contextlib.nullcontext() if family not in ct.NO_REPLAY else \
        torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    with order, replay, inductor_plan.kernels_not_built(), using_backend(inductor_plan.inductor), eager_branches(), \
            fake_mode():
        trainer = FakeTrainer(cfg, torch.device("cpu"))
        batch = trainer.workload.make_batch(trainer.generator, cfg.micro_batch, cfg.seq, trainer.device)
        window = window_of(batch)
        inductor_plan.CALLS.append(window)
        try:
            tracker = StorageTracker(listener=window)
            window.tracker = tracker
            tracker.register(trainer.model.parameters(), "parameters")
            with tracker:
                with trainer._autocast():
                    loss = trainer.workload.loss_sum(trainer.model, *batch)
                loss.backward()
        finally:
            inductor_plan.CALLS.remove(window)
        yield trainer, window


def derive(family: str, gqa: bool, dropout: bool, attention: str, policy: str, precision: str,
           k: int | None = None, g: int | None = None) -> list[list[int]]:
    """The block's backward high points, each the sizes (bytes) of the storages it holds in the order they were
    made, from one inductor-planned update on fake tensors."""
    cfg = ct.derivation_config(family, gqa, dropout, attention, policy, precision, k, g)
    with planned_update(cfg, family, lambda batch: _Window()) as (_, window):
        pass
    if window.calls != 1:
        raise ct.Uncompiled(f"{family} {policy}: {window.calls} compiled backward calls, not one block's")
    return window.highs


def highest(highs: list[Terms], primes: dict[str, int]) -> Fraction:
    return max(ct.evaluate(h, primes) for h in highs)


def checked(family: str, gqa: bool, dropout: bool, attention: str, policy: str,
            precision: str) -> list[Terms] | None:
    """The high points as monomials (a grouped-query block's from two values of g, high point by high point and
    storage by storage, trace/compiled_terms.py ``combined``), if their largest at another number of KV heads is
    what the backward holds there; else None."""
    at = ct.primes_of(gqa)
    raw = derive(family, gqa, dropout, attention, policy, precision)
    if gqa:
        second = derive(family, gqa, dropout, attention, policy, precision, g=ct.SECOND_G)
        at2 = ct.primes_of(gqa, g=ct.SECOND_G)
        highs = [ct.combined([(n, 1) for n in h], [(n, 1) for n in h2], at, at2) for h, h2 in zip(raw, second)]
        if len(raw) != len(second) or any(h is None for h in highs):
            return None
    else:
        highs = [ct.product_terms([(n, 1) for n in h], at) for h in raw]
    highs = pruned(highs)
    other = derive(family, gqa, dropout, attention, policy, precision, k=ct.CHECK_K)
    return highs if highest(highs, ct.primes_of(gqa, ct.CHECK_K)) == max(sum(h) for h in other) else None


def _entry(highs: list[Terms]) -> tuple:
    return tuple(tuple((e, c.numerator, c.denominator) for e, c in sorted(h.items())) for h in highs)


def write_table(path: Path, keep: dict | None = None, only: str | None = None) -> None:
    """Derive every entry the saved-terms table has terms for (``keep``: entries derived already, by key, not
    derived again; ``only``: derive just the keys containing one of its comma-separated parts) and
    write the table after each."""
    from batchlab.formula import compiled_table

    entries = dict(keep or {})
    for family in ct.FAMILIES:
        for (gqa, dropout, attention), policy, precision in itertools.product(ct.VARIANTS[family], ct.POLICIES,
                                                                              ct.PRECISIONS[family]):
            key = ct._key(family, gqa, dropout, attention, policy, precision)
            if not isinstance(compiled_table.TERMS.get(key), tuple):
                continue  # no saved terms: the formula's eager terms apply, its eager working set with them
            asked = only is None or any(o in key for o in only.split(","))
            if not asked or key in entries:
                continue
            print(f"deriving {key}", file=sys.stderr, flush=True)
            try:
                found = checked(family, gqa, dropout, attention, policy, precision)
                entries[key] = UNPAIRED if found is None else _entry(found)
            except ct.Uncompiled:
                entries[key] = ct.UNCOMPILED
            _write(path, entries)
    _write(path, entries)


def _write(path: Path, entries: dict) -> None:
    ct.write_generated(path, "compiled_working", "HIGHS", entries,
                       "per family | heads | dropout | attention | layer policy | precision, the high points of one "
                       "compiled block's backward (inductor's plan)")


if __name__ == "__main__":
    target, kept, only = ct.command_line("compiled_working_table", "HIGHS")
    with contextlib.suppress(KeyboardInterrupt):
        write_table(target, kept, only)
