"""The memory timeline against independent references: the live-storage tracker's own peak and breakdown
(its bookkeeping, not the timeline's), a real CPU run of the same config, and hand-counted storages."""
from __future__ import annotations

import json

import pytest
import torch
from batchlab.measure.harness import Trainer
from batchlab.measure.memory import StorageTracker, track_update
from batchlab.timeline.data import CATEGORIES, aligned, downsample, fold
from batchlab.measure.timeline_update import record
from batchlab.measure.timeline_tracker import TimelineRecorder, block_of
from batchlab.trace import estimate
from shapes import hf_gpt2, hf_llama, tiny

CASES = {"builtin": lambda: tiny(ac="full", accum=2),
         "builtin-bf16": lambda: tiny(ac="full", precision="bf16-mixed").replace(attention="sdpa", mlp="swiglu",
                                                                                  norm="rmsnorm"),
         "gpt2": lambda: hf_gpt2(accum=2), "llama": lambda: hf_llama(ac="full")}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    if not request.param.startswith("builtin"):
        pytest.importorskip("transformers")
    cfg = CASES[request.param]()
    traced = estimate(cfg, timeline=True)
    trainer = Trainer(cfg, "cpu")
    measured = record(cfg, "cpu", trainer=trainer)
    real = track_update(trainer)  # the tracker alone, a further steady-state update: the reference
    return cfg, traced, measured, real


def nonzero(d: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in d.items() if v}


def test_maximum_is_the_reported_peak_to_the_byte(case):
    _, traced, measured, real = case
    assert max(traced.timeline.totals) == traced.memory.peak_bytes == traced.timeline.peak_bytes
    assert max(measured.totals) == real.peak_bytes == measured.peak_bytes


def test_categories_at_the_peak_are_the_at_peak_breakdown(case):
    _, traced, measured, real = case
    assert nonzero(fold(traced.timeline.at_peak)) == nonzero(traced.memory.breakdown)
    assert nonzero(fold(measured.at_peak)) == nonzero(real.breakdown)
    assert traced.timeline.peak_phase.phase == traced.memory.peak_phase
    assert measured.peak_phase.phase == real.peak_phase


def test_trace_and_measured_agree_sample_by_sample(case):
    cfg, traced, measured, _ = case
    spans = lambda t: [(p.label, p.first_op, p.last_op) for p in t.phases]  # noqa: E731
    if cfg.model_source == "builtin":  # the same ops, numbered alike (foreach counted per tensor)
        assert spans(traced.timeline) == spans(measured)
    else:  # transformers' packed-sequence check runs only for real
        assert [s[0] for s in spans(traced.timeline)] == [s[0] for s in spans(measured)]
    for a, b in ((traced.timeline, measured), (measured, traced.timeline)):
        pairs = aligned(a, b)
        assert len(pairs) == len(a.ops)
        worst = max(abs(x - y) / x for _, x, y in pairs)
        assert worst < 0.01, worst


def test_phases_follow_the_update(case):
    cfg, traced, _, _ = case
    labels = [p.label for p in traced.timeline.phases if p.phase in ("forward", "backward", "optimizer")]
    expected = [f"{ph} {i}" for i in range(1, cfg.accum + 1) for ph in ("forward", "backward")] + ["optimizer"]
    assert labels == expected


@pytest.fixture(scope="module")
def traced():
    """The traced timelines of tiny() without and with full recompute, read by several tests (frozen)."""
    return {ac: estimate(tiny(ac=ac), timeline=True).timeline for ac in ("none", "full")}


def test_recompute_and_logits_are_split_out(traced):
    full, none = traced["full"], traced["none"]
    assert max(full.parts["recompute"]) > 0 and max(none.parts["recompute"]) == 0
    assert max(none.parts["logits"]) > 0
    # logits/loss are created from the LM head on: none before the first forward's head runs
    first_forward = next(p for p in none.phases if p.label == "forward 1")
    head_start = next(op for op, v in zip(none.ops, none.parts["logits"]) if v)
    assert first_forward.first_op < head_start <= first_forward.last_op


def test_per_module_attribution_adds_up_and_matches_the_tree():
    cfg = tiny(ac="none", accum=1).replace(micro_batch=8)
    traced = estimate(cfg, tree=True, timeline=True)
    t = traced.timeline
    for c in ("activations", "logits", "recompute", "temporaries"):
        assert sum(parts.get(c, 0) for parts in t.at_peak_by_module.values()) == t.at_peak[c]
    tree = {node.name: node.total_bytes for node in traced.tree.walk()}
    for block, parts in t.at_peak_by_module.items():
        if block.startswith("blocks."):
            # what a block created in forward and still holds at the peak is at most what it kept for backward
            assert parts.get("activations", 0) <= tree[block]
    assert any(b.startswith("blocks.") for b in t.at_peak_by_module)
    assert block_of("model.layers.3.mlp.up") == "model.layers.3" and block_of("lm_head") == "lm_head"


def test_hand_counted_storages():
    """Storages made by hand: the samples, their categories and the peak are known in advance."""
    rec = TimelineRecorder(owner=lambda: "x", outside="x", head=None)
    tracker = StorageTracker(listener=rec)
    w = torch.zeros(100)  # 400 B of "parameters"
    tracker.register([w], "parameters")
    tracker.reset()
    rec.start(tracker)
    with tracker:
        tracker.mark("forward")
        a = torch.ones(1000)  # +4000 activations
        b = torch.ones(500)  # +2000
        tracker.mark("backward")
        del a  # -4000, seen at the next op
        c = torch.ones(250)  # +1000 temporaries
        del b, c
    rec.finish()
    t = rec.timeline(provenance="allocator", method="test", title="hand", peak_bytes=tracker.snapshot().peak_bytes)
    assert t.totals == [400, 4400, 6400, 3400, 400]
    assert t.peak_bytes == 6400 and t.at_peak == dict.fromkeys(CATEGORIES, 0) | {"parameters": 400,
                                                                              "activations": 6000}
    assert t.parts["temporaries"] == (0, 0, 0, 1000, 0)
    assert t.ops == (0, 1, 2, 3, 3) and [p.label for p in t.phases] == ["data", "forward 1", "backward 1"]


def test_the_all_reduce_is_drawn_over_the_last_backward(tmp_path):
    from batchlab.timeline.output import write

    t = estimate(tiny(dp=2, accum=2), timeline=True).timeline
    assert list(t.overlaps.values()) == ["backward 2"] and any("all-reduce" in n for n in t.notes)
    assert "gradient all-reduce" in write(t, tmp_path / "t.html").read_text()
    write(t, tmp_path / "t.png")
    assert not estimate(tiny(accum=2), timeline=True).timeline.overlaps


def test_json_round_trip_keeps_the_exact_maximum(tmp_path, traced):
    from batchlab.timeline.output import load, write

    t = traced["none"]
    path = write(t, tmp_path / "t.json")
    d = json.loads(path.read_text())
    assert max(d["samples"]["total"]) == t.peak_bytes == d["samples"]["total"][d["peak_sample"]]
    assert set(d["samples"]) == {"op", "phase", "op_name", "bytes", "total"}
    assert load(path) == t
    keep = downsample(t, 50)
    assert t.peak_sample in keep and len(keep) <= 4 * 50 + len(t.phases)


def test_png_html_and_pair(tmp_path, traced):
    import matplotlib.image

    from batchlab.timeline.output import write
    from batchlab.timeline.pair import pair_series, pair_svg, write_pair_png

    a, b = traced["none"], traced["full"]
    png = write(a, tmp_path / "t.png")
    assert matplotlib.image.imread(png).shape[1] == 1400
    page = write(a, tmp_path / "t.html").read_text()
    assert "<svg" in page and "mousemove" in page and f"{a.peak_bytes:,} B" in page
    assert "src=" not in page and "<link" not in page  # self-contained: nothing fetched
    for t in (a, b):
        x, total, _ = pair_series(t)
        assert max(total) == t.peak_bytes and x[0] == 0 and x[-1] == 1
    write_pair_png(a, b, tmp_path / "pair.png", ("ac=none", "ac=full"))
    assert matplotlib.image.imread(tmp_path / "pair.png").shape[1] == 1400
    svg = pair_svg(a, b)
    assert svg.startswith("<svg") and "href=\"http" not in svg


def test_cuda_replay_by_hand():
    """The allocator-history replay on hand-made events (runs without a GPU)."""
    from batchlab.measure.timeline_cuda import _Marks, _replay

    listener = _Marks(trainer=None, device=None)
    # (phase, allocations, frees) as memory_stats counts them at each mark
    listener.marks = [("data", 10, 5), ("forward", 10, 5), ("backward", 11, 5), ("optimizer", 13, 6), ("end", 13, 7)]
    listener.grad_addrs = {300}
    events = [{"action": "alloc", "addr": 100, "size": 512},  # forward: activation
              {"action": "alloc", "addr": 200, "size": 1024},  # backward: temporary
              {"action": "free_requested", "addr": 100, "size": 512},
              {"action": "free_completed", "addr": 100, "size": 512},  # not counted twice
              {"action": "alloc", "addr": 300, "size": 2048},  # backward: becomes .grad
              {"action": "free_requested", "addr": 200, "size": 1024}]
    base = dict.fromkeys(CATEGORIES, 0) | {"parameters": 4096}
    ctx = {"title": "hand", "capacity_bytes": 0, "formula_phase_peaks": {}, "notes": [], "overlaps": {}}
    t = _replay(events, listener, first=(10, 5), parts=base, known={}, peak=4096 + 1024 + 2048, ctx=ctx)
    assert t.totals == [4096, 4608, 5632, 5120, 7168, 6144]
    assert t.peak_bytes == max(t.totals) and not t.notes
    assert t.at_peak["gradients"] == 2048 and t.at_peak["temporaries"] == 1024
    # the optimizer mark came after 3 allocations and 1 free: the last free is in the optimizer phase
    assert [p.label for p in t.phases] == ["data", "forward 1", "backward 1", "optimizer"]
    assert t.phases[t.phase_of[-1]].label == "optimizer" and t.phase_of[-2] == 2


def test_cli_writes_the_timeline(tmp_path):
    from typer.testing import CliRunner

    from batchlab.cli import app

    small = ["--layers", "2", "--seq", "32", "--micro-batch", "2"]
    out = tmp_path / "t.json"
    r = CliRunner().invoke(app, ["estimate", "--trace", "--timeline", str(out), *small], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["provenance"] == "trace" and max(d["samples"]["total"]) == d["peak_bytes"]
    bad = CliRunner().invoke(app, ["estimate", "--trace", "--timeline", str(tmp_path / "t.svg"), *small])
    assert bad.exit_code == 2 and "timeline" in bad.output


def test_measure_cli_writes_the_measured_timeline(tmp_path):
    """``measure --timeline``: the file holds the measurement's own timeline (recorded inside the measuring
    process, so --isolate records it in the subprocess: test_measure_models checks that path)."""
    from typer.testing import CliRunner

    from batchlab.cli import app

    # --no-calibrate: the time model's calibration (whichever test finds no cache pays it) is not under test
    r = CliRunner().invoke(app, ["measure", "--steps", "1", "--warmup", "1", "--json", "--no-calibrate", "--timeline",
                                 str(tmp_path / "m.json"), "--layers", "2", "--seq", "32", "--micro-batch", "2"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    d = json.loads((tmp_path / "m.json").read_text())
    printed = json.loads(r.stdout)
    assert d["provenance"] == "allocator" and "timeline" not in printed
    # the memory update records the timeline: its sampled maximum is the peak the tracker reports
    assert max(d["samples"]["total"]) == d["peak_bytes"] == printed["memory"]["peak_bytes"]


def test_a_measurement_asked_for_a_timeline_records_it_in_the_untimed_memory_update():
    from batchlab.measure.options import MeasureOptions
    from batchlab.measure.session import run_inprocess

    cfg = tiny(ac="full", accum=2)
    labels, plain = [], []
    m = run_inprocess(cfg, MeasureOptions(warmup=1, steps=1, timeline=True), lambda d, n, label: labels.append(label))
    t = m.timeline
    # the memory update's tracker records it: no update more than without a timeline, none of them timed
    alone = run_inprocess(cfg, MeasureOptions(warmup=1, steps=1), lambda d, n, label: plain.append(label))
    assert alone.timeline is None
    assert labels == plain and labels.index("memory") < labels.index("timed 1/1")
    # against another trainer's memory update, tracked without the recorder: the same peak to the byte
    assert max(t.totals) == t.peak_bytes == m.memory.peak_bytes == alone.memory.peak_bytes
    assert nonzero(fold(t.at_peak)) == nonzero(m.memory.breakdown)
    assert [p.label for p in t.phases if p.phase == "backward"] == ["backward 1", "backward 2"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_allocator_history_peak():
    cfg = tiny(ac="full", accum=2)
    t = record(cfg, "cuda")
    assert t.provenance == "allocator" and not t.notes, t.notes
    assert max(t.totals) == t.peak_bytes
    assert [p.label for p in t.phases if p.phase == "forward"] == ["forward 1", "forward 2"]
    assert t.at_peak["gradients"] > 0 or t.peak_phase.phase == "forward"
