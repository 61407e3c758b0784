"""benchmarks/published_parallel.py: a row whose source omits an input the prediction needs states how each of its
figures bounds the published one (memory and rate may bound in opposite directions, or not at all); it is checked as
that bound and kept out of every mean; a retyped row shows the old command's figures beside the new."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())


def _run(run_id: str, memory_gib: float, tokens_per_s: float, **extra) -> dict:
    return {"id": run_id, "cli": "--model tiny --seq 64 --micro-batch 2 --dp 2 --sharding deepspeed-zero2",
            "source": "s", "quote": "q", "gpu": "a100-sxm4-80gb", "gpu_count": 2, "engine": "DeepSpeed",
            "model": {"name": "tiny", "layers": 4}, "sharding": "deepspeed-zero2", "precision": "fp32", "attention": "sdpa",
            "tp": 1, "pp": 1, "pp_virtual": 1, "dp": 2, "seq": 64,
            "measured": {"memory_value": memory_gib, "memory_unit": "GiB", "memory_kind": "allocated",
                         "tokens_per_s_per_gpu": tokens_per_s}, **extra}


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import published_parallel

    return published_parallel


def test_each_figure_bounds_its_own_way_and_stays_out_of_the_means(script):
    probe = script.evaluate(_run("probe", 1.0, 1.0), {})
    mem, rate = probe.mem_predicted / 2**30, probe.rate_predicted
    point = script.evaluate(_run("point", mem / 1.1, rate), {})  # memory 10% high by construction
    # the longest possible sequence: at least the memory, at most the rate of the real run (both hold here)
    held = script.evaluate(_run("held", mem / 2, rate * 2, not_typed=["the sequence length"],
                                bound={"memory": "upper", "rate": "lower"}), {})
    broken = script.evaluate(_run("broken", mem * 2, rate / 2, not_typed=["the batch"],
                                  bound={"memory": "upper", "rate": "lower"}), {})
    nothing = script.evaluate(_run("nothing", mem * 9, rate * 9, not_typed=["the model"], bound="none"), {})
    text = script.document([point, held, broken, nothing], [])
    assert "mean |error| 10.0%, median 10.0%, worst 10.0% (point), over 1 runs" in text  # the point alone
    assert "| held | predicted >= measured |" in text and "| predicted <= measured |" in text
    bounds = text.split("## Bounds")[1].split("##")[0]
    assert "Bounds that hold: memory 1 of 2; rate 1 of 2" in bounds
    assert bounds.count("**no**") == 2  # broken's memory and rate
    assert "| nothing | - |" in bounds and "- nothing: the model" in bounds
    assert "| nothing (no point) |" in text and "| held (bound) |" in text


def test_a_retyped_row_shows_the_old_commands_figures(script):
    old_cli = "--model tiny --seq 64 --micro-batch 1 --dp 2 --sharding deepspeed-zero2"
    row = script.evaluate(_run("r", 1.0, 1.0, retyped={"cli": old_cli, "why": "micro-batch 1 -> 2"}), {})
    old = script.evaluate(_run("o", 1.0, 1.0, cli=old_cli), {})
    text = "\n".join(script.retypes([row], {}))
    assert f"| r | micro-batch 1 -> 2 | 1.00 | {old.mem_predicted / 2**30:.2f} |" in text
    assert row.mem_predicted != old.mem_predicted


def test_a_bound_names_each_figure_or_fails_loudly():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import published

    with pytest.raises(SystemExit, match="a table giving each of memory, rate one"):
        published.bound_of({"id": "r", "not_typed": ["x"], "bound": {"memory": "upper"}})
    assert published.bound_of({"id": "r", "not_typed": ["x"], "bound": {"memory": "upper", "rate": "lower"}}) == "mixed"
    assert published.bound_of({"id": "r", "not_typed": ["x"], "bound": "lower"}, "rate") == "lower"


def test_a_gap_that_moves_one_figure_leaves_the_other_a_point(script):
    """The Megatron functional tests log every iteration: their rate is bounded, their memory still a point."""
    probe = script.evaluate(_run("probe", 1.0, 1.0), {})
    mem, rate = probe.mem_predicted / 2**30, probe.rate_predicted
    row = script.evaluate(_run("half", mem / 1.2, rate / 3, not_typed=["per-iteration logging"],
                               bound={"memory": "point", "rate": "upper"}), {})
    text = script.document([row], [])
    summary = text.split("## Summary")[1].split("## Runs")[0]
    assert "memory now (the kind and rank each source measured): mean |error| 20.0%" in summary  # a point
    assert "- throughput now: no runs" in summary  # the rate is a bound: in no mean
    assert "Bounds that hold: memory 0 of 0; rate 1 of 1" in text.split("## Bounds")[1]


def test_a_bound_without_its_gap_or_a_gap_that_is_not_a_list_fails_loudly(script):
    with pytest.raises(SystemExit, match="a bound needs not_typed"):
        script.document([script.evaluate(_run("b", 1.0, 1.0, bound="upper"), {})], [])
    with pytest.raises(SystemExit, match="not_typed is a list"):
        script.document([script.evaluate(_run("s", 1.0, 1.0, not_typed="the length", bound="upper"), {})], [])


def test_the_runs_fields_type_what_their_trainer_ran(script):
    """torchtitan shards with reshard_after_forward=False under a pipeline (parallelize_llama.apply_fsdp @ 9dec370:
    FSDP2 at ZeRO-2), with it elsewhere; a run whose loss is a fused cross entropy gets --loss fused."""
    base = dict(engine="torchtitan FSDP2", sharding="fsdp", loss="causal-lm-ce")
    cli = "--model tiny --seq 64 --micro-batch 2 --accum 2 --dp 2 --zero 3 --pp 2 --precision bf16-fsdp"
    piped = script.command_for(_run("pp", 1.0, 1.0, **dict(base, cli=cli, pp=2)), [])
    flat = script.command_for(_run("flat", 1.0, 1.0, **dict(base, cli=cli.replace("--pp 2", "--pp 1"))), [])
    assert piped[piped.index("--zero") + 1] == "2" and flat[flat.index("--zero") + 1] == "3"
    assert "--zero 3" in " ".join(script.command_for(_run("first", 1.0, 1.0, **dict(base, cli=cli, pp=2)), [],
                                                     typed=False))
    fused = script.command_for(_run("fused", 1.0, 1.0, loss="causal-lm-fused-ce"), [])
    assert fused[fused.index("--loss") + 1] == "fused"
    assert "--loss" not in script.command_for(_run("plain", 1.0, 1.0, loss="causal-lm-ce"), [])
