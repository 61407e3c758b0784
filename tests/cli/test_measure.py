"""`batchlab measure` end to end on the tiny model (small shapes, few steps)."""
from __future__ import annotations

import json
import statistics

import pytest
import torch
import typer
from typer.testing import CliRunner

from batchlab.cli import app

SMALL = ["--seq", "16", "--micro-batch", "2", "--layers", "2", "--steps", "2", "--warmup", "1"]


def invoke(*args: str):
    # with a single registered command typer makes it the whole app; with several, "measure" is a subcommand
    prefix = ["measure"] if hasattr(typer.main.get_command(app), "commands") else []
    return CliRunner().invoke(app, prefix + list(args))


def test_measure_json_end_to_end():
    r = invoke(*SMALL, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["outcome"] == "ok" and d["global_batch"] == 2
    mem, t = d["memory"], d["time"]
    assert mem["peak_bytes"] >= mem["activations_bytes"] > 0
    assert mem["peak_phase"] in ("forward", "backward", "optimizer")
    assert len(t["samples"]) == 2 and t["update_seconds_median"] == statistics.median(t["samples"])
    assert t["update_seconds_iqr"] >= 0
    assert d["tokens_per_second"] == pytest.approx(2 * 16 / t["update_seconds_median"])
    assert d["environment"]["torch"] == torch.__version__
    assert d["environment"]["threads"] == torch.get_num_threads() and d["environment"]["device_name"]
    assert d["config"]["micro_batch"] == 2 and d["config"]["model"]["layers"] == 2
    # a provenance label on every figure, measured and formula alike
    assert d["provenance"]["memory"] == "allocator" and d["provenance"]["time"] == "wall-clock"
    assert mem["provenance"] == "allocator" and t["provenance"] == "wall-clock"
    figures = {row["figure"]: row for row in d["comparison"]}
    assert figures["peak memory"]["measured"] == mem["peak_bytes"]
    for row in d["comparison"]:
        assert row["measured_provenance"] in ("allocator", "wall-clock") and row["formula_provenance"] == "formula"
        if isinstance(row["formula"], (int, float)) and row["formula"]:
            assert row["relative_difference"] == pytest.approx((row["measured"] - row["formula"]) / row["formula"])
    # the formula at the host speed the probe read before each timed update (the calibration's speed = x1.00)
    probed = [row for row in d["comparison"] if row["figure"].startswith("update time at the probed host speed")]
    assert len(probed) == 1 and len(t["probe_seconds"]) == 2
    factor = float(probed[0]["figure"].split("formula x")[1].rstrip(")"))
    assert probed[0]["formula"] == pytest.approx(factor * figures["update time (median)"]["formula"], rel=0.01)


def test_measure_table_names_provenance_and_global_batch():
    r = invoke(*SMALL)
    assert r.exit_code == 0, r.output
    assert "global batch = micro-batch x accum x DP = 2 x 1 x 1 = 2" in r.stdout
    for word in ("peak memory", "allocator", "wall-clock", "formula", "outcome: ok"):
        assert word in r.stdout


def test_measure_budget_oom_is_a_result_not_an_error():
    r = invoke(*SMALL, "--memory-budget", "3MiB", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["outcome"] == "oom (budget)" and d["oom_phase"] in ("data", "forward", "backward", "optimizer")


@pytest.mark.parametrize("args, field", [
    (["--model", "no_such_module_xyz:factory"], "model"),
    (["--memory-budget", "1KiB"], "memory_budget"),
])
def test_measure_bad_input_exits_2_with_one_line(args, field):
    r = invoke(*SMALL, *args, "--json")
    assert r.exit_code == 2
    assert r.stdout == ""  # nothing half-written
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}:")


def test_measure_cuda_absent_exits_2():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = invoke(*SMALL, "--device", "h100-sxm")
    assert r.exit_code == 2 and "error: device:" in r.stderr


def test_measure_warmup_zero_is_refused():
    r = invoke(*SMALL, "--warmup", "0")  # the first update is never timed
    assert r.exit_code == 2 and r.stderr.startswith("error: warmup:") and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1  # one line, no usage box


@pytest.mark.parametrize("args, world_cfg", [
    (("--nproc", "2"), (2, 2, 1, 4)),  # DP derived from the world size, accum kept: global batch 2 x 1 x 2
    (("--nproc", "2", "--global-batch", "8"), (2, 2, 2, 8)),  # DP derived, the typed global batch kept
    (("--nproc", "2", "--dp", "2"), (2, 2, 1, 4)),
])
def test_nproc_without_dp_derives_dp_from_the_world_size(monkeypatch, args, world_cfg):
    import batchlab.distributed as dist

    seen = []

    def fake_launch(cfg, opts, nproc, torchrun_args, launcher=None):
        seen.append(cfg)
        raise SystemExit(0)  # stop before anything runs

    monkeypatch.setattr(dist, "launch", fake_launch)
    invoke("--seq", "16", "--micro-batch", "2", *args, "--json")
    c = seen[0]
    assert (c.dp, c.micro_batch, c.accum, c.global_batch) == world_cfg


def test_nproc_contradicted_by_an_explicit_dp_is_refused():
    r = invoke("--seq", "16", "--nproc", "2", "--dp", "4")
    assert r.exit_code == 2 and r.stderr.startswith("error: dp") and "world size" in r.stderr
