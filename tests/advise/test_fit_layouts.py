"""`batchlab fit --world-size N`: the tensor / pipeline / data-parallel layout searched with the micro-batch and
activation checkpointing, the global batch kept; bad input answered in one line."""
from __future__ import annotations

import itertools
import json

import pytest
from typer.testing import CliRunner

from batchlab.advise import Goal, plan
from batchlab.advise.plan import layouts
from batchlab.cli import app
from batchlab.config import ConfigError, RunConfig, preset
from batchlab.formula import estimate

GIB = 2**30


def llama(**kw) -> RunConfig:  # 32 heads, 32 kv-heads, 32 layers
    values = dict(model=preset("llama-2-7b"), seq=4096, micro_batch=1, accum=64, precision="bf16-mixed",
                  device="a100-80gb")
    values.update(kw)
    return RunConfig(**values)


def test_every_split_of_the_world_the_model_and_batch_allow_is_searched():
    got = {(c.dp, c.tp, c.pp) for c in layouts(Goal(llama(), world=8))}
    # by hand: dp x tp x pp = 8, all of 32 heads / 32 layers / batch 64 divisible, tp within an 8-GPU node
    assert got == {(8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 4, 1), (2, 2, 2), (2, 1, 4), (1, 8, 1), (1, 4, 2), (1, 2, 4),
                   (1, 1, 8)}
    # gpt2: 12 heads and 12 layers; batch 24: tp 8 and pp 8 do not split it, dp 8 does not divide 24
    gpt2 = RunConfig(model=preset("gpt2"), seq=1024, micro_batch=1, accum=24, device="a100-80gb")
    got = {(c.dp, c.tp, c.pp) for c in layouts(Goal(gpt2, world=8))}
    expected = {(dp, tp, pp) for dp, tp, pp in itertools.product((1, 2, 4, 8), repeat=3)
                if dp * tp * pp == 8 and 12 % tp == 0 and 12 % pp == 0 and 24 % dp == 0}
    assert got == expected and (2, 4, 1) in got and (1, 8, 1) not in got


def test_a_degree_typed_is_held():
    got = {(c.dp, c.tp, c.pp) for c in layouts(Goal(llama(tp=2), world=8, held=frozenset({"tp"})))}
    assert got == {(4, 2, 1), (2, 2, 2), (1, 2, 4)}


def test_the_pick_is_the_fastest_fitting_candidate_of_all_layouts_and_keeps_the_global_batch():
    goal = Goal(llama(), world=8, min_micro_tokens=1)
    p = plan(goal)
    assert {c.config.parallel.world_size for c in p.candidates} == {8}
    assert {c.config.global_batch for c in p.candidates} == {64}
    # brute force through the public calculator, enumerated here, not from the planner's list: every dp x tp x pp
    # of 8 devices (tp within the 8-GPU node), every micro-batch dividing the rank's batch, every policy of the
    # ladder (none, every K-th layer for K < 32 layers, selective, full); a config the calculator refuses (1F1B
    # over p stages with fewer than p micro-batches) is no candidate
    fitting = []
    for dp, tp, pp in itertools.product((1, 2, 4, 8), repeat=3):
        if dp * tp * pp != 8:
            continue
        per_rank = 64 // dp
        for mb, ac in itertools.product([d for d in range(1, per_rank + 1) if per_rank % d == 0],
                                        ("none", "every:8", "every:4", "every:2", "selective", "full")):
            try:
                cfg = llama(dp=dp, tp=tp, pp=pp, micro_batch=mb, accum=per_rank // mb, ac=ac)
            except ConfigError:
                continue
            e = estimate(cfg)
            if e.memory.peak_bytes <= goal.usable_bytes:
                fitting.append(e.time.update_seconds)
    assert p.recommended is not None
    assert p.recommended.update_seconds == pytest.approx(min(fitting), rel=1e-9)
    # layouts compete (DP 8 alone cannot hold 16 bytes per parameter of 7B in 80 GB)
    assert {(c.config.tp, c.config.pp) for c in p.ranked} >= {(2, 1), (4, 1), (2, 2)}
    assert (1, 1) not in {(c.config.tp, c.config.pp) for c in p.ranked}


def test_a_model_too_big_for_one_device_is_split_by_tensor_or_pipeline_parallelism():
    base = RunConfig(model=preset("llama-2-13b"), seq=4096, micro_batch=1, accum=32, precision="bf16-mixed",
                     device="a100-40gb")
    alone = estimate(base.replace(dp=8, accum=4))  # plain DP: 16 bytes per parameter of 13B does not fit 40 GB
    assert alone.memory.peak_bytes > 40 * 10**9
    p = plan(Goal(base, world=8))
    assert p.recommended is not None
    pick = p.recommended.config
    assert pick.tp * pick.pp > 1 and pick.parallel.world_size == 8 and pick.global_batch == 32
    assert estimate(pick).memory.peak_bytes <= 40 * 2**30 * 0.9  # an A100-40GB's 40 GiB, less the 10% margin


def test_goal_refuses_a_world_no_layout_fills():
    with pytest.raises(ConfigError, match="world_size"):
        Goal(llama(), world=6)  # 64 % 3, 32 heads % 3, 32 layers % 3: nothing divides
    with pytest.raises(ConfigError, match="world_size"):
        Goal(llama(tp=4), world=6, held=frozenset({"tp"}))
    with pytest.raises(ConfigError, match="world_size"):
        Goal(llama(), world=0)


@pytest.mark.parametrize("extra, field", [(["--world-size", "6"], "world_size"),
                                          (["--world-size", "8", "--dp", "2"], "world_size"),
                                          (["--world-size", "-1"], "world_size"),
                                          (["--world-size", "8", "--ac", "auto"], "world_size"),
                                          (["--world-size", "8", "--after-oom"], "world_size")])
def test_cli_bad_world_is_one_line_exit_2(extra, field):
    r = CliRunner().invoke(app, ["fit", "--model", "llama-2-7b", "--seq", "4096", "--global-batch", "64", "--device",
                                 "a100-80gb", "--no-verify", *extra])
    assert r.exit_code == 2, r.output
    assert field in r.output and "Traceback" not in r.output


def test_cli_json_names_the_layout_of_the_pick():
    r = CliRunner().invoke(app, ["fit", "--model", "llama-2-7b", "--seq", "4096", "--global-batch", "64", "--device",
                                 "a100-80gb", "--precision", "bf16-mixed", "--world-size", "8", "--no-verify", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    par = d["final"]["parallel"] if "parallel" in d["final"] else d["final"]["config"]["parallel"]
    assert par["world_size"] == 8 and par["dp"] * par["tp"] * par["pp"] == 8


LLAMA_64 = ["fit", "--model", "llama-2-7b", "--seq", "4096", "--global-batch", "64", "--device", "a100-80gb",
            "--precision", "bf16-mixed", "--no-verify", "--json"]


@pytest.mark.parametrize("asked, expected", [
    # on a card every one of them fits (the set is the search's, not the memory verdict's; an interleaved stage keeps
    # every micro-batch's sends to the step's end: formula/interleaved.py)
    # by hand: dp x tp x pp = 4 with tp > 1 (sequence parallelism splits over TP ranks), all dividing 32 heads,
    # 32 layers and batch 64
    (["--sequence-parallel"], {(2, 2, 1, True, 1), (1, 4, 1, True, 1), (1, 2, 2, True, 1)}),
    # pp > 1 (2 chunks per rank: 32 layers split into pp x 2 stages)
    (["--pp-virtual", "2", "--pp-schedule", "interleaved-1f1b"],
     {(2, 1, 2, False, 2), (1, 2, 2, False, 2), (1, 1, 4, False, 2)}),
])
def test_world_size_searches_only_the_layouts_that_take_what_was_asked(asked, expected):
    r = CliRunner().invoke(app, [*LLAMA_64, "--world-size", "4", "--device", "h200", *asked])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    got = {(a["config"]["dp"], a["config"]["tp"], a["config"]["pp"], a["config"]["sequence_parallel"],
            a["config"]["pp_virtual"]) for a in d["alternatives"]}
    assert got == expected


@pytest.mark.parametrize("extra, says", [
    (["--world-size", "4", "--pp-virtual", "2"], "pp_virtual: 1f1b runs one stage per rank"),
    (["--world-size", "4", "--pp-virtual", "0", "--pp-schedule", "interleaved-1f1b"], "pp_virtual: must be > 0"),
    (["--world-size", "1", "--sequence-parallel"], "world_size: no layout"),
])
def test_world_size_refuses_what_no_layout_can_take_in_one_line(extra, says):
    r = CliRunner().invoke(app, [*LLAMA_64, *extra])
    assert r.exit_code == 2 and says in r.stderr and "Traceback" not in r.output, r.output


@pytest.mark.distributed
def test_cli_verifies_a_tensor_parallel_pick_by_measuring_it():
    # tiny: 4 heads; TP 2 held over a world of 2: the pick is measured on two forked gloo ranks
    r = CliRunner().invoke(app, ["fit", "--model", "tiny", "--seq", "64", "--global-batch", "8", "--device", "cpu",
                                 "--world-size", "2", "--tp", "2", "--ac", "none", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["verification"]["outcome"] == "ok" and d["verification"]["peak_bytes"] > 0
    assert d["source"].endswith("confirmed by measurement")
