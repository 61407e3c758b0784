"""A whole-model graph's backward (--compile model) layer by layer, read off inductor's plan of a whole model
(trace/compiled_model_working.py): against a real compiled run and inductor's own plan of models no derivation
used, and the derivation's bookkeeping by hand."""
import json
from pathlib import Path

import pytest

from batchlab.config import RunConfig, preset
from batchlab.formula import compiled, estimate

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _derived(cfg: RunConfig) -> RunConfig:
    # the entries these tests check are generated ones (formula/compiled_model_working_table.py): one lost in a
    # regeneration fails here rather than skipping the checks
    assert compiled.whole_model_highs(cfg) is not None, "no whole-model stretches derived for this entry"
    return cfg


def test_a_whole_model_graph_under_full_recompute_lands_on_a_real_compiled_runs_peak():
    """GPT tiny, 2 layers, 128 x 4, measured with inductor on this CPU (benchmarks/compiled_measured.json).  At this
    shape inductor keeps its baseline order (its reordering estimates 13.5 MB for it, 15.8 MB for the
    least-peak-first order that wins at the derivation's shape): the formula has to make the same choice."""
    measured = json.loads((BENCH / "compiled_measured.json").read_text())["GPT tiny, 2 layers | full | model"]["peak"]
    cfg = _derived(RunConfig(model=preset("tiny", layers=2), seq=128, micro_batch=4, compile="model", ac="full"))
    assert estimate(cfg).memory.peak_tensor_bytes == pytest.approx(measured, rel=0.05)


def test_a_whole_model_graph_under_full_recompute_lands_on_inductors_plan_of_unlisted_models():
    """Inductor's plan of models no derivation used (benchmarks/compiled_model_traced.json, the trace that is exact on
    every measured whole-model row): two and three layers, other widths, heads and vocabularies."""
    traced = json.loads((BENCH / "compiled_model_traced.json").read_text())
    rows = {"GPT, 2 layers, h 80, 2 heads, V 520 | full": (dict(layers=2, hidden=80, heads=2, vocab=520), 56, 3),
            "GPT, 3 layers, h 96, 3 heads, V 600 | full": (dict(layers=3, hidden=96, heads=3, vocab=600), 64, 2)}
    for row, (over, seq, mb) in rows.items():
        cfg = _derived(RunConfig(model=preset("tiny", **over), seq=seq, micro_batch=mb, compile="model", ac="full"))
        assert estimate(cfg).memory.peak_tensor_bytes == pytest.approx(traced[row]["trace"], rel=0.05), row


def test_transformers_gpt2_read_as_its_two_graphs_lands_on_inductors_plan_of_unlisted_models():
    """transformers' GPT-2 compiles into the model's graph and the loss's: read as that sequence of backward graphs,
    against inductor's plan of models no derivation used (benchmarks/compiled_model_traced.json, rows that are not
    hold-outs): full recompute and selective-op, three layers, other widths and vocabularies."""
    traced = json.loads((BENCH / "compiled_model_traced.json").read_text())
    rows = {"hf:gpt2, 3 layers, h 96 | full": (dict(layers=3, hidden=96, heads=3, vocab=640), 96, 3),
            "hf:gpt2, 3 layers, h 64 | selective-op": (dict(layers=3, hidden=64, heads=2, vocab=768), 112, 2)}
    for row, (over, seq, mb) in rows.items():
        cfg = _derived(RunConfig(model=preset("gpt2", max_positions=256, **over), model_source="hf:gpt2", seq=seq,
                                 micro_batch=mb, compile="model", ac=row.split(" | ")[1]))
        assert estimate(cfg).memory.peak_tensor_bytes == pytest.approx(traced[row]["trace"], rel=0.05), row


def test_a_four_layer_model_reads_the_deeper_models_stretches():
    """transformers' GPT-2, 4 layers, h 80, 72 x 2, a shape no row has: inductor's plan of it (the trace, exact on
    every measured whole-model row: 7,506,632 B full, 7,885,960 B selective-op) against the formula, whose four-layer
    model reads the stretches of each layer's place from the bottom (``OWN_LAYERS``: its own, derived at prime sizes,
    overshoot by 7-8%)."""
    for ac, plan in (("full", 7_506_632), ("selective-op", 7_885_960)):
        cfg = _derived(RunConfig(model=preset("gpt2", layers=4, hidden=80, heads=4, vocab=1000, max_positions=128,
                                              dropout=0.0), model_source="hf:gpt2", seq=72, micro_batch=2,
                                 compile="model", ac=ac))
        assert estimate(cfg).memory.peak_tensor_bytes == pytest.approx(plan, rel=0.03), ac


def test_each_layer_reads_the_stretch_of_its_place_from_the_bottom():
    from batchlab.formula.compiled import stretch

    assert [stretch(i, 2) for i in range(2)] == ["2:0", "2:1"]  # a two-layer graph's own
    assert [stretch(i, 3) for i in range(3)] == ["0", "1", "2"]
    assert [stretch(i, 6) for i in range(6)] == ["0", "1", "2", "3+", "3+", "3+"]


def test_a_shallow_model_reads_its_own_layer_counts_stretches_where_an_entry_has_them(monkeypatch):
    """A three-layer model whose entry holds stretches derived with three layers reads those ("3:0" .. "3:2"), one
    without them the stretches of its place from the bottom: counted by hand from a table of constants."""
    from batchlab.formula import compiled

    one = lambda n: (((0, 0, 0, 0, 0, 0, 0), n, 1),)  # noqa: E731 - a high point of n bytes at every shape
    merged = {"0": (one(10),), "1": (one(20),), "2": (one(30),), "3+": (one(40),), "2:0": (one(1),), "2:1": (one(2),)}
    own = dict(merged, **{"3:0": (one(11),), "3:1": (one(21),), "3:2": (one(31),), "4:0": (one(0),),
                          "4:1": (one(0),), "4:2": (one(0),), "4:3": (one(0),)})
    cfg = RunConfig(model=preset("tiny", layers=3), seq=64, micro_batch=2, compile="model", ac="full")
    monkeypatch.setattr(compiled, "layer_bytes", lambda cfg, policy: 0)
    for orders, want in (({"baseline": merged}, (10, 20, 30)), ({"baseline": own, "bound": ("baseline",)}, (11, 21, 31))):
        monkeypatch.setattr(compiled, "whole_model_highs", lambda cfg, orders=orders: orders)
        assert compiled._whole_model_working(cfg) == want


def test_a_storage_made_where_a_freed_one_was_is_told_apart():
    """The derivation names each storage by a serial of its own: a freed storage's id can be the next one's, and a
    high point that held the first must not count it as the second (a layer's weight gradient, say)."""
    from batchlab.trace.compiled_model_working import _Stretches

    w = _Stretches(skip={99})
    w.active = True
    w.added(1, 100, "activations")
    w.added(99, 7, "activations")  # the batch: the walk's data, not the layer's
    w.op_done(None, ())
    w.freed(1)  # the rise ends: its high point holds the first storage at id 1
    w.added(1, 40, "gradients")
    w.op_done(None, ())
    w.finish()
    assert w.tops == [[(1, 100)], [(2, 40)]]
    assert w.serial[1] == 2


def test_several_backward_graphs_are_one_sequence_with_the_later_graphs_saved_tensors_held(monkeypatch):
    """A model that compiles into two graphs (the model's, then the loss's) runs the loss graph's backward first,
    while the model graph's saved tensors wait for their own: counted by hand, the sequence's high points are the
    loss backward's (its saved logits, their gradient, and the model's saved tensors beside them) and then the
    model backward's, never reset between the two calls; a generator state no forward made is added as its graph
    is called, a parameter never."""
    import torch

    from batchlab.trace.compiled_model_working import _Stretches

    class Tracker:  # what the forwards left alive: id -> (bytes, category)
        _live = {10: (1000, "parameters"), 1: (300, "activations"), 2: (500, "activations"), 3: (8, "activations")}

    monkeypatch.setattr(torch._C, "_current_graph_task_id", lambda: 1)  # inside a backward
    w = _Stretches(skip=set())
    w.tracker = Tracker()
    w.start([])  # the loss graph's backward: model graph's saved (1: 300) and the loss's (2: 500) and the loss (3)
    w.added(4, 500, "temporaries")  # the logits' gradient
    w.op_done(None, ())
    w.freed(2)  # the loss graph frees its logits: high point 300 + 500 + 8 + 500
    w.end()
    state = torch.empty(7, dtype=torch.uint8)  # the model graph's generator state: no forward made it
    w.start([state])
    w.added(5, 300, "gradients")  # a weight gradient, the logits' gradient still held
    w.op_done(None, ())
    w.freed(4)
    w.end()
    w.finish()
    assert [sum(n for _, n in top) for top in w.tops] == [1308, 1115]
    assert w.calls == 2


def test_only_an_order_kept_for_its_bound_is_called_a_bound():
    """The provenance line says "a bound" where the order the formula keeps at the row's shape is one whose stretches
    keep two schedules' high points, not wherever the entry has such an order."""
    cfg = _derived(RunConfig(model=preset("gpt2", layers=2, hidden=128, heads=4, vocab=1024, max_positions=256,
                                          dropout=0.0), model_source="hf:gpt2", seq=128, micro_batch=4,
                             compile="model", ac="full"))
    # at this shape the formula keeps inductor's baseline order; the entry's bound orders are the others
    assert "bound" in compiled.whole_model_highs(cfg) and "a bound" not in compiled.source(cfg)
