"""Derive the formula's backward working set of a whole-model graph (``--compile model``, formula/compiled.py
``working_per_layer``): what each layer's stretch of the whole model's backward holds at its high points, as
monomials in b, s, k, g, d, f and v (the vocabulary).

One graph over every block lets inductor's scheduler do what no block's own graph can: start the next block's
recompute while this one's gradient kernels run (its fused q, k, v projection held beside this block's gradient),
keep the graph-level tensors a block never sees (the embedding's dropout mask, the causal mask, the positions) and
hold the head's tensors and its deferred gradient to the graph's end.  So the working set is read off inductor's
plan of a whole model, as trace/compiled_working.py reads a block's: the model is compiled at the derivation's prime
dimensions (trace/compiled_terms.py) with the vocabulary a prime of its own, its wrapper run on fake tensors with no
kernel built (trace/inductor_plan.py), and its backward followed: one graph's, or where the model compiles into
several graphs (transformers' GPT-2: the model's, then the loss's) each graph's in turn, as autograd calls them,
with what the other graphs' forwards saved held beside it.  Each high point belongs to the lowest
layer whose weight gradient exists by then (the top layer before any does), and is stated as the formula's walk
takes it (formula/memory.py ``_backward_peak``): the weight gradients of the layers above, the kept tensors of the
layers below (the block table's terms but a block graph's generator state: the whole graph has one seeds buffer)
and the embedding's mask are what the walk adds itself, so they are taken out; the rest (this layer's kept tensors
and its working set, the next layer's recompute, the head's tensors and its gradient, the graph-level masks)
factors into monomials, per storage.  Derived with five, three and two layers (the lowest three layers' stretches
each their own, the rest alike), whose three- and two-layer derivations also give those models every layer's stretch
of its own (formula/compiled.py ``own_stretch``, ``OWN_LAYERS``); checked with another number of KV heads (where
inductor's schedule moves with it, both schedules' high points are kept: a bound).  Inductor
reorders each graph for peak memory, choosing among a few topological orders by their peak at the real sizes, so
each order is derived and the formula chooses as inductor would at its shape.

    PYTHONPATH=src python -m batchlab.trace.compiled_model_working [--missing] [--only=KEY,...]
    # rewrites formula/compiled_model_working_table.py (sixteen inductor compiles per entry; --only: exact keys)
"""
from __future__ import annotations

import contextlib
import itertools
import re
import sys
from fractions import Fraction
from pathlib import Path

import torch

from batchlab.formula.compiled import OWN_LAYERS, own_stretch, scales, stretch
from batchlab.trace import compiled_terms as ct
from batchlab.trace import compiled_working as cw

SYMBOLS = (*ct.SYMBOLS, "v")
VOCAB = 1031  # a prime no other symbol uses
# derived with five layers: the dropout seeds buffer (3 per layer + 1) then holds 16, no symbol's prime (four
# layers' 13 would read as b; two and three layers' 7 and 10 are small factors: constants)
LAYERS = 5
MERGED = (LAYERS, 3, 2)  # the layer counts whose stretches merge by place from the bottom (formula/compiled.py stretch)
_LAYER = re.compile(r"(?:^|\.)(?:h|blocks|layers|layer)\.(\d+)\.")
UNCOMPILED = ("no compiled backward graph of the whole model makes the layers' weight gradients (the blocks run "
              "eagerly): each block's own plan is used")
UNCHECKED = ("a stretch of the whole-model graph's backward has no high point of its own: each block's own plan "
             "is used")


class _Stretches(cw._Window):
    """The window of trace/compiled_working.py that also keeps which storages are live at each high point and
    leaves the batch (the walk's data) out.  A model that compiles into several graphs (transformers' GPT-2: the
    model's, then the loss's) runs their backward graphs one after another, the last forward's first: the window
    opens at the first backward call with every storage the forwards left alive (each later graph's saved tensors
    are held through the earlier graphs' backward), stays open between the calls (what autograd passes from one to
    the next) and closes at ``finish``, so the high points are those of the whole sequence."""

    def __init__(self, skip: set[int]):
        super().__init__()
        self.skip = skip
        self.tops: list[list[tuple[int, int]]] = []  # (serial, bytes) live at each high point
        self._top_keys: list[tuple[int, int]] = []
        # a storage's id can be a later storage's once it is freed: each one added gets a serial of its own
        self.serial: dict[int, int] = {}
        self.made = 0

    def start(self, args) -> None:
        if torch._C._current_graph_task_id() == -1:  # a forward graph
            return
        self.calls += 1
        if not self.active:
            self.active = True
            for key, (nbytes, category) in self.tracker._live.items():
                if category != "parameters":
                    self._add(key, nbytes)
        for t in args:  # what no forward made: a generator's state
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self.tracker._live:
                self._add(id(t.untyped_storage()), t.untyped_storage().nbytes())
        self._note()

    def end(self) -> None:
        pass  # another graph's backward may follow: the sequence ends at ``finish``

    def finish(self) -> None:
        if self.active:
            self._commit()
            self.active = False

    def _add(self, key: int, nbytes: int) -> None:
        if key not in self.skip and key not in self.live:
            self.made += 1
            self.serial[key] = self.made
            super()._add(key, nbytes)

    def _note(self) -> None:
        if self.top is None or self.total > self.top[0]:
            self._top_keys = [(self.serial[k], n) for k, n in self.live.items()]
        super()._note()

    def _commit(self) -> None:
        if self.top is not None and self.top[0] >= self.total:
            self.tops.append(self._top_keys)
        super()._commit()


# the LM heads each family is derived with: the head is in the whole graph (tied: its gradient added to the
# embedding's at the graph's end)
TIED = {"builtin": (True, False), "hf-gpt2": (True,), "hf-llama": (False,), "torchtitan-llama": (False,)}


def key(family: str, gqa: bool, dropout: bool, attention: str, policy: str, precision: str, tied: bool) -> str:
    return ct._key(family, gqa, dropout, attention, policy, precision) + ("|tied" if tied else "|untied")


def derivation_config(family: str, gqa: bool, dropout: bool, attention: str, policy: str, precision: str,
                      tied: bool, layers: int, k: int | None = None):
    import dataclasses

    cfg = ct.derivation_config(family, gqa, dropout, attention, policy, precision, k)
    model = dataclasses.replace(cfg.model, layers=layers, vocab=VOCAB, tied_embeddings=tied)
    return dataclasses.replace(cfg, model=model, compile="model")


def monomial(count: int, primes: dict[str, int]) -> tuple[Fraction, tuple[int, ...]]:
    """ct.monomial with the vocabulary divided out first (its exponent last)."""
    v = 0
    while count and count % VOCAB == 0:
        count, v = count // VOCAB, v + 1
    coef, exps = ct.monomial(count, primes)
    return coef, (*exps, v)


# inductor's reordering for peak memory (torch/_inductor/memory.py ``reorder_for_peak_memory``) tries these
# topological orders and keeps the one whose peak, estimated with the graph's real sizes, is lowest: which one wins
# depends on the shape, so each is derived and the formula makes the same choice at its shape
ORDERS = ("baseline", "lpmf", "bfs", "dfs")


@contextlib.contextmanager
def _order(order: str):
    """Within: inductor schedules every graph in ``order`` (one of ORDERS) instead of choosing."""
    from torch._inductor import memory

    def forced(nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs, methods=None):
        if order == "baseline":
            return nodes
        _, freeable = memory.prepare_planning_info(nodes, name_to_buf, name_to_fused_node, graph_inputs,
                                                   graph_outputs)
        if order == "lpmf":
            return memory.topological_sort_lpmf(nodes, freeable, name_to_buf, graph_outputs)
        return getattr(memory, f"topological_sort_{order}")(nodes)

    chosen = memory.reorder_for_peak_memory
    memory.reorder_for_peak_memory = forced
    try:
        yield
    finally:
        memory.reorder_for_peak_memory = chosen


def derive(family: str, gqa: bool, dropout: bool, attention: str, policy: str, precision: str, tied: bool,
           layers: int, k: int | None = None, order: str = "baseline") -> dict[int, list[dict]]:
    """``derived`` in a process of its own: a whole-model compile leaves process-wide state behind that the next one
    reads (a three-layer GPT-2 derived after a five-layer one held 0.6 MB more per layer at a real shape than
    inductor's plan of it, which a fresh process reproduces to the byte)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(derived, (family, gqa, dropout, attention, policy, precision, tied, layers, k, order))


def derived(family: str, gqa: bool, dropout: bool, attention: str, policy: str, precision: str, tied: bool,
            layers: int, k: int | None = None, order: str = "baseline") -> dict[int, list[dict]]:
    """Each layer's high points in the whole-model backward scheduled in ``order`` as Terms (exponents over SYMBOLS
    -> bytes), with what the formula's walk adds itself taken out."""
    from batchlab.formula import activations as act, compiled_table

    cfg = derivation_config(family, gqa, dropout, attention, policy, precision, tied, layers, k)
    primes = ct.primes_of(gqa, k)
    batch_storages = lambda batch: _Stretches({id(t.untyped_storage()) for t in batch  # noqa: E731
                                               if isinstance(t, torch.Tensor)})
    with cw.planned_update(cfg, family, batch_storages, _order(order)) as (trainer, window):
        window.finish()
        layer_of = {}
        for name, p in trainer.model.named_parameters():
            found = _LAYER.search(name)
            if found is not None and p.grad is not None:
                layer_of[window.serial.get(id(p.grad.untyped_storage()))] = int(found.group(1))
    layer_of.pop(None, None)
    if not window.calls or not layer_of:
        raise ct.Uncompiled(f"{family} {policy}: no compiled backward call made the layers' weight gradients")
    # what the walk keeps per layer below (formula/compiled.py ``kept_per_layer``): the block's saved terms but a
    # block graph's generator state, which a whole-model graph replaces by its one seeds buffer (a constant here)
    kept = {(*e, 0): Fraction(n, d) for e, n, d in compiled_table.TERMS[ct._key(family, gqa, dropout, attention,
                                                                                 policy, precision)] if scales(e)}
    m = cfg.model
    mask = act.embedding_mask_bytes(m, cfg.seq, cfg.micro_batch, cfg.precision, cfg.device_spec.backend)
    out: dict[int, list[dict]] = {}
    for live in window.tops:
        done = [layer_of[key] for key, _ in live if key in layer_of]
        at = min(done, default=layers - 1)
        terms: dict = {}
        for key, nbytes in live:
            if layer_of.get(key, -1) > at:
                continue  # a layer above's weight gradient: the walk's
            coef, exps = monomial(nbytes, primes)
            terms[exps] = terms.get(exps, Fraction(0)) + coef
        if mask:
            coef, exps = monomial(mask, primes)
            terms[exps] = terms.get(exps, Fraction(0)) - coef
        for exps, c in kept.items():  # the layers below keep theirs in the walk's activations
            terms[exps] = terms.get(exps, Fraction(0)) - at * c
        out.setdefault(at, []).append({e: c for e, c in terms.items() if c})
    return out


def evaluate(terms: dict, primes: dict[str, int]) -> Fraction:
    return ct.evaluate({e[:-1]: c * Fraction(VOCAB) ** e[-1] for e, c in terms.items()}, primes)


def _scaling(terms: dict) -> dict:
    """The terms without the constant (generator seeds: one per dropout site, so their count follows the layers)."""
    return {e: c for e, c in terms.items() if scales(e)}


def _highest(highs: list[dict], primes: dict[str, int]) -> Fraction:
    return max(evaluate(_scaling(h), primes) for h in highs)


def checked(family: str, gqa: bool, dropout: bool, attention: str, policy: str, precision: str,
            tied: bool, order: str) -> tuple[dict[str, list[dict]], bool] | None:
    """The stretches' high points (formula/compiled.py ``stretch``) in ``order``: each stretch's from five, three
    and two layers together (a term as small as one per-row statistic of the top layer's is live at some layer
    counts and not at others: each stretch keeps every high point seen), and whether they are a bound: exact where
    five layers' with another number of KV heads reach, layer by layer, the same highest points (the constant terms
    aside).  Where they do not, inductor's schedule itself moved with the shape (its fusions are chosen by the bytes
    they save: the next block's recompute started a layer earlier at one width than at the other), so each stretch
    keeps the high points of both widths, and the formula's largest at its shape is the larger schedule's; None
    where a stretch has none."""
    at_k = ct.primes_of(gqa, ct.CHECK_K)
    regions: dict[str, list[dict]] = {}
    found = {}
    for layers in sorted({*MERGED, *OWN_LAYERS}, reverse=True):
        # a layer whose stretch rises to no high point of its own (its gradients made while the one above still
        # holds more) adds none
        found[layers] = derive(family, gqa, dropout, attention, policy, precision, tied, layers, order=order)
        for layer, highs in found[layers].items():
            if layers in MERGED:
                regions.setdefault(stretch(layer, layers), []).extend(highs)
            if layers in OWN_LAYERS:
                regions.setdefault(own_stretch(layer, layers), []).extend(highs)
    other = derive(family, gqa, dropout, attention, policy, precision, tied, LAYERS, k=ct.CHECK_K, order=order)
    # a layer with no high point of its own at one width (its gradients made while the one above still holds more)
    # is a schedule that moved as well
    bound = sorted(other) != sorted(found[LAYERS]) or any(
        _highest(highs, at_k) != _highest(found[LAYERS][layer], at_k) for layer, highs in other.items())
    if bound:
        print(f"  {order}: not the same with k {ct.CHECK_K}: both kept (a bound)", file=sys.stderr, flush=True)
        for layer, highs in other.items():
            regions[stretch(layer, LAYERS)].extend(highs)
    if {stretch(i, n) for n in MERGED for i in range(n)} - regions.keys():
        print(f"  {order}: a stretch with no high point", file=sys.stderr, flush=True)
        return None
    for n in OWN_LAYERS:  # a layer count with a layer of no high point of its own reads the merged stretches
        if {own_stretch(i, n) for i in range(n)} - regions.keys():
            for i in range(n):
                regions.pop(own_stretch(i, n), None)
    return {name: cw.pruned(highs) for name, highs in regions.items()}, bound


def _entry(regions: dict[str, list[dict]]) -> dict:
    return {name: tuple(tuple((e, c.numerator, c.denominator) for e, c in sorted(h.items())) for h in highs)
            for name, highs in regions.items()}


BOUND = "bound"  # an entry's key naming the orders whose stretches keep two schedules' high points (``checked``)


def ordered(family: str, gqa: bool, dropout: bool, attention: str, policy: str, precision: str,
            tied: bool) -> dict | str:
    """Each order's entry, or why it has none (its stretches fail the check: the formula then chooses among the
    others), and under ``BOUND`` the orders whose stretches are a bound; why there is no entry where the baseline or
    the least-peak-first order fails (the two inductor keeps at the shapes traced here)."""
    out: dict = {}
    bounds = []
    for order in ORDERS:
        found = checked(family, gqa, dropout, attention, policy, precision, tied, order)
        out[order] = UNCHECKED if found is None else _entry(found[0])
        if found is None and order in ("baseline", "lpmf"):
            return UNCHECKED
        if found is not None and found[1]:
            bounds.append(order)
    if bounds:
        out[BOUND] = tuple(bounds)
    return out


def write_table(path: Path, keep: dict | None = None, only: str | None = None) -> None:
    """Derive every entry the block table has terms for (``keep``: entries derived already; ``only``: just the keys
    containing one of its comma-separated parts), writing the table after each."""
    from batchlab.formula import compiled_table

    entries = dict(keep or {})
    for family in ct.FAMILIES:
        for (gqa, dropout, attention), policy, precision, tied in itertools.product(
                ct.VARIANTS[family], ct.POLICIES, ct.PRECISIONS[family], TIED[family]):
            name = key(family, gqa, dropout, attention, policy, precision, tied)
            block = compiled_table.TERMS.get(ct._key(family, gqa, dropout, attention, policy, precision))
            if not isinstance(block, tuple) or name in entries:
                continue
            if only is not None and not any(o in name for o in only.split(",")):
                continue
            print(f"deriving {name}", file=sys.stderr, flush=True)
            try:
                entries[name] = ordered(family, gqa, dropout, attention, policy, precision, tied)
            except ct.Uncompiled:
                entries[name] = UNCOMPILED
            _write(path, entries)
    _write(path, entries)


def _write(path: Path, entries: dict) -> None:
    ct.write_generated(path, "compiled_model_working", "HIGHS", entries,
                       "per family | heads | dropout | attention | layer policy | precision | head, per topological "
                       "order, the high points of each stretch of a whole-model graph's backward (a layer's: "
                       "formula/compiled.py stretch) as the formula's walk takes them (inductor's plan)", SYMBOLS)


if __name__ == "__main__":
    target, kept, only = ct.command_line("compiled_model_working_table", "HIGHS")
    with contextlib.suppress(KeyboardInterrupt):
        write_table(target, kept, only)
