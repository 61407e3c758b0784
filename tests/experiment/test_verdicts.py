"""The compare protocol and its verdicts, driven by an injected measure function with known figures.

The fake returns the numbers a real run would, chosen so that the paired ratios are known by hand; the
protocol (order, fresh call per side per round, OOM handling), the verdict rule, the predictions and the
diagnosis are then checked against those hand-computed values.
"""
from __future__ import annotations

import pytest

from batchlab.config import ConfigError, RunConfig
from batchlab.experiment.change import build_sides, parse_change
from batchlab.experiment.compare import make_plan, run
from batchlab.experiment.predict import Direction, Metric, parse_predictions
from batchlab.experiment.protocol import interleave
from batchlab.experiment.verdict import MEMORY_SAME_TOLERANCE, paired_direction
from batchlab.measure.options import MeasureOptions
from batchlab.measure.result import Outcome
from fake_measure import BASE, FakeMeasure, plan_for

def test_sides_are_measured_interleaved_in_fresh_calls():
    s = build_sides(BASE, [parse_change("micro_batch=1:2", BASE)])
    fake = FakeMeasure((s.a, s.b), times=((1.0, 1.0),) * 4)
    seen = []
    r = interleave(s.a, s.b, 4, MeasureOptions(isolate=True), fake, lambda d, t, label: seen.append((d, t)))
    assert fake.calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3), ("b", 3)]
    assert len(r.a) == len(r.b) == 4 and seen[-1] == (8, 8)


@pytest.mark.parametrize("rounds", [0, 2, "3"])
def test_fewer_than_three_rounds_are_refused(rounds):
    with pytest.raises(ConfigError) as e:
        plan_for(rounds=rounds)
    assert e.value.field == "rounds"


def test_ratio_band_and_direction_come_from_the_paired_rounds():
    # round medians chosen so the paired ratios B/A are 1.2, 1.5, 1.3 although A itself drifts 2x
    times = ((1.0, 1.2), (2.0, 3.0), (1.5, 1.95))
    p = plan_for("ac=none:full", "memory=down,time=up,tokens_per_second=down")
    fake = FakeMeasure((p.sides.a, p.sides.b), peak=(4000, 1000), times=times)
    rec = run(p, measure=fake, verify=False).to_dict()
    t = rec["metrics"]["update_time"]
    assert t["paired_ratios"] == pytest.approx([1.2, 1.5, 1.3])
    assert t["ratio"] == pytest.approx(1.3) and t["band"] == pytest.approx([1.2, 1.5])
    assert t["observed"] == "up" and t["held"] == {"user": True, "formula": True}
    assert t["a"] == pytest.approx(1.5) and t["b"] == pytest.approx(1.95)  # medians over rounds
    tps = rec["metrics"]["tokens_per_second"]
    assert tps["paired_ratios"] == pytest.approx([1 / 1.2, 1 / 1.5, 1 / 1.3]) and tps["observed"] == "down"
    # same global batch and sequence: time to a token budget moves exactly like update time
    ttb = rec["metrics"]["time_to_budget"]
    assert ttb["ratio"] == pytest.approx(1.3) and ttb["a"] == pytest.approx(p.token_budget / (p.sides.a.tokens_per_update / 1.5))
    mem = rec["metrics"]["peak_memory"]
    assert mem["ratio"] == 0.25 and mem["band"] == [0.25, 0.25] and mem["observed"] == "down"
    assert mem["provenance"] == "allocator" and t["provenance"] == "wall-clock"
    assert rec["diagnosis"] == {"contradictions": [], "checks": []}


def test_a_band_that_reaches_one_is_same_even_when_the_median_moved():
    ratio, band, d = paired_direction([0.8, 1.1, 0.9], Metric.UPDATE_TIME)
    assert (ratio, band, d) == (0.9, (0.8, 1.1), Direction.SAME)
    assert paired_direction([0.8, 0.95, 0.9], Metric.UPDATE_TIME)[2] is Direction.DOWN


def test_memory_within_the_tolerance_is_same_and_outside_it_is_not():
    small = 1 + MEMORY_SAME_TOLERANCE / 2
    assert paired_direction([small] * 3, Metric.PEAK_MEMORY)[2] is Direction.SAME
    assert paired_direction([small] * 3, Metric.UPDATE_TIME)[2] is Direction.UP  # timing has no such tolerance
    assert paired_direction([1.05] * 3, Metric.PEAK_MEMORY)[2] is Direction.UP


def test_a_contradiction_gets_the_diagnosis_in_order_with_findings():
    # the person says time goes down; it goes up, with a peak at the optimizer step and 20% data share
    p = plan_for("micro_batch=1:2", "memory=up,time=down", steps=3)
    fake = FakeMeasure((p.sides.a, p.sides.b), peak=(1000, 1000), times=((1.0, 1.1),) * 3, phase="optimizer",
                       data_share=0.2)
    rec = run(p, measure=fake, verify=False).to_dict()
    assert {"metric": "update_time", "who": "you", "predicted": "down", "observed": "up"} in rec["diagnosis"]["contradictions"]
    assert {"metric": "peak_memory", "who": "you", "predicted": "up", "observed": "same"} in rec["diagnosis"]["contradictions"]
    checks = rec["diagnosis"]["checks"]
    assert [c["name"] for c in checks] == ["warmup", "spread", "data_loading", "synchronisation", "window",
                                           "peak_phase", "kernel_size", "time_model"]
    by = {c["name"]: c for c in checks}
    assert by["peak_phase"]["flagged"] and "A optimizer, B optimizer" in by["peak_phase"]["found"]
    assert by["data_loading"]["flagged"] and "20.0%" in by["data_loading"]["found"]
    assert by["window"]["flagged"] and "3 timed updates" in by["window"]["found"]  # fewer than 5
    assert not by["warmup"]["flagged"] and not by["synchronisation"]["flagged"]
    assert by["kernel_size"]["flagged"] and "A 16, B 32" in by["kernel_size"]["found"]  # b x s tokens
    # the formula's own account of the change: a statement, not a suspect
    assert not by["time_model"]["flagged"] and by["time_model"]["found"].startswith("the time model predicts B/A")
    assert "dispatch is" in by["time_model"]["found"]
    assert rec["formula"]["time_attribution"]["ratio"] == pytest.approx(
        rec["formula"]["b"]["time"]["update_seconds"] / rec["formula"]["a"]["time"]["update_seconds"])
    assert rec["metrics"]["peak_memory"]["held"]["user"] is False


def test_the_formula_side_of_the_record_holds_hand_checked_figures():
    p = plan_for("ac=none:full")
    rec = run(p, measure=FakeMeasure((p.sides.a, p.sides.b)), verify=False)
    mem = rec.metrics[Metric.PEAK_MEMORY].formula
    # tiny GPT (4 layers, h 128, s 16, b 2, fp32): full AC keeps one layer input per layer, s*b*h*4 bytes,
    # instead of the 320 256 bytes each layer keeps without it, and adds one layer's recompute working set
    # (303 872 bytes) during backward: B = A - 4 x (320 256 - 16 x 2 x 128 x 4) + 303 872
    assert mem.a == 16_187_392 and mem.b == 16_187_392 - 4 * (320_256 - 16 * 2 * 128 * 4) + 303_872
    assert mem.ratio == pytest.approx(15_275_776 / 16_187_392)
    assert rec.predictions.formula[Metric.PEAK_MEMORY] is Direction.DOWN
    assert rec.predictions.formula[Metric.UPDATE_TIME] is Direction.UP  # recompute adds one forward
    assert rec.formula.a["provenance"] == "formula"


def test_an_oom_side_is_not_run_again_and_other_metrics_stay_undecided():
    p = plan_for("micro_batch=1:2", "oom=up")
    fake = FakeMeasure((p.sides.a, p.sides.b), fail={("b", 0): Outcome.OOM_BUDGET})
    rec = run(p, measure=fake, verify=False).to_dict()
    assert fake.calls == [("a", 0), ("b", 0), ("a", 1), ("a", 2)]
    oom = rec["metrics"]["oom"]
    assert (oom["a"], oom["b"], oom["observed"], oom["held"]["user"]) == (False, True, "up", True)
    assert rec["metrics"]["update_time"]["observed"] is None
    assert any("not run again" in w for w in rec["warnings"])


def test_formula_only_measures_nothing_and_says_so():
    p = plan_for("ac=none:full", "memory=down", formula_only=True)
    fake = FakeMeasure((p.sides.a, p.sides.b))
    rec = run(p, measure=fake).to_dict()
    assert fake.calls == [] and rec["kind"] == "formula-only"
    m = rec["metrics"]["peak_memory"]
    assert m["observed"] is None and m["held"]["user"] is None and m["predicted_by_formula"] == "down"
    assert rec["scope"][0].startswith("Formula only")
    assert rec["semantics"]["gradient_check"]["ran"] is False


def test_the_real_gradient_check_runs_for_an_accumulation_split():
    p = plan_for("micro_batch=1:2")
    rec = run(p, measure=FakeMeasure((p.sides.a, p.sides.b))).to_dict()
    check = rec["semantics"]["gradient_check"]
    assert check["kind"] == "split" and check["ran"] and check["passed"]
    assert check["max_rel_diff"] <= 1e-5
    touched = {i["name"]: i for i in rec["semantics"]["items"]}
    assert not touched["global batch"]["touched"] and touched["global batch"]["verified"].startswith("verified")
    assert touched["RNG under recompute"]["touched"] is False


def test_the_semantics_of_a_global_batch_change_are_flagged_and_not_claimed_verified():
    p = plan_for("micro_batch=1:2", keep="accum")
    rec = run(p, measure=FakeMeasure((p.sides.a, p.sides.b))).to_dict()
    items = {i["name"]: i for i in rec["semantics"]["items"]}
    for name in ("global batch", "learning-rate scaling", "scheduler step count"):
        assert items[name]["touched"] and not items[name]["verified"]
    assert rec["semantics"]["gradient_check"]["ran"] is False


def test_only_checks_that_can_explain_the_contradiction_are_flagged():
    # memory alone goes against the predictions: timing checks are reported but cannot explain it (the
    # update time falls by 20%, as the person and the formula's time model both predicted)
    base = BASE
    p = make_plan(base, [parse_change("micro_batch=1:2", base)],
                  predictions=parse_predictions("memory=down,time=down"), steps=3)
    fake = FakeMeasure((p.sides.a, p.sides.b), peak=(1000, 1200), times=((1.0, 0.8),) * 3, phase="optimizer",
                       data_share=0.2)
    rec = run(p, measure=fake, verify=False).to_dict()
    assert [c["metric"] for c in rec["diagnosis"]["contradictions"] if c["who"] == "you"] == ["peak_memory"]
    by = {c["name"]: c for c in rec["diagnosis"]["checks"]}
    assert by["peak_phase"]["flagged"]
    for name in ("data_loading", "window", "kernel_size"):
        assert not by[name]["flagged"] and by[name]["found"].endswith("(cannot explain the contradictions here)")


def test_cpu_measurements_pin_one_thread_unless_told_otherwise():
    import os

    from batchlab.experiment.compare import DEFAULT_CPU_THREADS
    from batchlab.experiment.protocol import threads_env

    assert plan_for().threads == DEFAULT_CPU_THREADS == 1
    assert plan_for(threads=0).threads is None and plan_for(threads=3).threads == 3
    gpu = RunConfig(seq=16, micro_batch=2, accum=2, device="h100-sxm")
    assert make_plan(gpu, [parse_change("ac=none:full", gpu)]).threads is None
    with pytest.raises(ConfigError) as e:
        plan_for(threads=-1)
    assert e.value.field == "threads"
    before = os.environ.get("OMP_NUM_THREADS")
    with threads_env(3):
        assert os.environ["OMP_NUM_THREADS"] == "3"
    assert os.environ.get("OMP_NUM_THREADS") == before


def test_a_side_that_fails_leaves_every_metric_undecided_with_a_reason():
    p = plan_for("micro_batch=1:2", "memory=up")
    fake = FakeMeasure((p.sides.a, p.sides.b), fail={("b", 0): Outcome.FAILED})
    rec = run(p, measure=fake, verify=False).to_dict()
    assert all(m["observed"] is None and m["held"]["user"] is None for m in rec["metrics"].values())
    assert rec["metrics"]["oom"]["note"] == "side B failed; OOM not decided"
    assert rec["diagnosis"]["contradictions"] == []


def test_side_medians_against_paired_ratios_in_opposite_directions_is_inconclusive_noise():
    # the pattern: rounds drift so much that the side medians say B is faster (A 836 ms, B 660 ms,
    # B/A 0.79) while two of three pairs say B is slower (paired ratios 1.1, 1.1, 0.42: median 1.1)
    times = ((0.6, 0.66), (0.836, 0.9196), (1.2, 0.5))
    p = plan_for("micro_batch=1:2", "time=up")
    fake = FakeMeasure((p.sides.a, p.sides.b), times=times)
    rec = run(p, measure=fake, verify=False)
    t = rec.metrics[Metric.UPDATE_TIME]
    assert t.a == pytest.approx(0.836) and t.b == pytest.approx(0.66) and t.ratio == pytest.approx(1.1)
    assert t.inconclusive and t.observed is None and t.held_user is None  # noise judges nobody's prediction
    assert "noise" in t.note and "0.789" in t.note and "1.1" in t.note
    assert not any(c.metric is Metric.UPDATE_TIME for c in rec.diagnosis.contradictions)
    assert "update time ? (inconclusive: noise)" in rec.verdict
    # stored and read back; printed as inconclusive in the terminal and the report, never as a direction
    from batchlab.experiment.record import Record
    back = Record.from_dict(rec.to_dict())
    assert back.metrics[Metric.UPDATE_TIME].inconclusive
    from rich.console import Console
    from batchlab.cli.render_experiment import render
    from batchlab.report.document import blocks, to_markdown

    out = Console(width=250, record=True)
    render(out, back)
    text = out.export_text()
    assert "inconclusive (noise)" in text and "A (median)" in text and "B/A paired" in text
    assert "inconclusive (noise)" in to_markdown(blocks(back), [], {})
    # consistent sides: no noise note
    fake = FakeMeasure((p.sides.a, p.sides.b), times=((1.0, 1.2), (2.0, 3.0), (1.5, 1.95)))
    assert not run(p, measure=fake, verify=False).metrics[Metric.UPDATE_TIME].inconclusive


def test_a_compile_change_keeps_its_time_direction_only_beyond_the_margin():
    from batchlab.experiment.predict import COMPILED_TIME_MARGIN, Metric, compiled_time_prediction

    def pred(ratio):
        return {Metric.PEAK_MEMORY: {"ratio": 0.9, "direction": "down"},
                Metric.UPDATE_TIME: {"ratio": ratio, "direction": "down" if ratio < 1 else "up"},
                Metric.TOKENS_PER_SECOND: {"ratio": 1 / ratio, "direction": "up" if ratio < 1 else "down"}}

    kept, reason = compiled_time_prediction(pred(1 - 2 * COMPILED_TIME_MARGIN))
    assert Metric.UPDATE_TIME in kept and Metric.TOKENS_PER_SECOND in kept and not reason
    kept, reason = compiled_time_prediction(pred(1 - COMPILED_TIME_MARGIN / 2))
    assert set(kept) == {Metric.PEAK_MEMORY} and "fusion rule" in reason
