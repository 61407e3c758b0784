"""--ac budget:F (torch.compile's activation_memory_budget) wherever an AC policy goes: the command line, config
files, --change, --vary, fit's printed script and torchtitan settings; refused without --compile or outside
[0, 1] in one line."""
import ast
import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from batchlab.advise.snippets import config_toml, torchtitan_toml
from batchlab.advise.torch_script import training_script
from batchlab.cli import app
from batchlab.config import RunConfig, config_from_dict, preset
from batchlab.experiment.change import parse_change

runner = CliRunner()
CFG = RunConfig(model=preset("tiny", layers=2), seq=32, micro_batch=2, ac="budget:0.4", compile="blocks")


def run(*args):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.mark.parametrize("args, line", [
    (("--ac", "budget:0.5"), "error: ac: ac=budget:0.5 needs --compile model|blocks: the knob is read by "
                             "torch.compile's partitioner"),
    (("--ac", "budget:1.5", "--compile", "blocks"),
     "error: ac: budget:F needs 0 <= F <= 1 (0: recompute from the inputs), got 1.5"),
])
def test_refused_in_one_line(args, line):
    r = run("estimate", *args)
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [line]


def test_a_config_field_in_files_changes_and_tables(tmp_path):
    cfg = RunConfig(ac="Budget:0.25", compile="blocks")
    assert str(cfg.ac) == "budget:0.25" and config_from_dict(cfg.to_dict()).ac == cfg.ac
    path = tmp_path / "run.toml"
    path.write_text(config_toml(cfg))
    r = run("estimate", "--config", str(path), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["config"]["ac"] == "budget:0.25"
    change = parse_change("ac=none:budget:0.5", RunConfig(compile="blocks"))
    assert (str(change.a), str(change.b)) == ("none", "budget:0.5")
    r = run("estimate", "--compile", "blocks", "--vary", "ac=none,budget:0.6,budget:0.3,full", "--json")
    assert r.exit_code == 0, r.output
    rows = {row["value"]: row["memory"]["peak_bytes"] for row in json.loads(r.stdout)}
    assert rows["none"] > rows["budget:0.6"] > rows["budget:0.3"] > rows["full"]


def test_fits_printed_script_and_torchtitan_set_the_knob():
    cfg = CFG
    script = training_script(cfg)
    ast.parse(script)
    knob = script.index("torch._functorch.config.activation_memory_budget = 0.4")
    compiled = script.index("layer.compile()")
    assert knob < compiled < script.index("for step,") and "checkpoint(" not in script
    assert "model.compile()" in training_script(cfg.replace(compile="model"))
    titan = torchtitan_toml(cfg)
    assert 'mode = "memory_budget"' in titan and "memory_budget = 0.4" in titan


@pytest.mark.slow  # a Python process importing torch and dynamo (seconds)
def test_fits_printed_script_runs_as_printed_with_the_knob_set(tmp_path):
    """Compiling disabled (inductor takes a minute here): the script's own imports reach the knob."""
    script = training_script(CFG)
    path = tmp_path / "train.py"
    path.write_text(script + "assert torch._functorch.config.activation_memory_budget == 0.4\n")
    done = subprocess.run([sys.executable, str(path)], env={**os.environ, "TORCH_COMPILE_DISABLE": "1"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "update 1: loss" in done.stdout


def test_the_kv_cache_stays_on_no_layer_is_checkpointed():
    """transformers turns use_cache off under gradient checkpointing only; budget:F wraps no layer."""
    gpt2 = dict(model=preset("gpt2", layers=2), model_source="hf:gpt2", compile="blocks")
    assert RunConfig(**gpt2, ac="budget:0.5").kv_cache == RunConfig(**gpt2, ac="none").kv_cache is True
    assert RunConfig(**gpt2, ac="full").kv_cache is False


def test_compare_predicts_memory_only_where_the_recompute_is_the_partitioners():
    from batchlab.experiment.change import build_sides
    from batchlab.experiment.compare import _formula

    base = RunConfig(compile="blocks")
    record, prediction = _formula(build_sides(base, [parse_change("ac=none:budget:0.3", base)]), 10**6)
    assert record.available and "budget:F" in record.reason
    assert set(m.value for m in prediction) == {"peak_memory", "oom"}  # memory still predicted
    assert prediction[next(m for m in prediction if m.value == "peak_memory")]["direction"] == "down"


@pytest.mark.parametrize("sharding", [["--dp", "2"], ["--dp", "2", "--zero", "3"]])
def test_compiled_ddp_and_fsdp_are_refused_before_a_rank_starts(sharding):
    r = run("measure", "--compile", "blocks", "--ac", "budget:0.5", *sharding)
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [
        "error: compile: a compiled run is measured and traced in one process for now (DP = 1); compiled DDP/FSDP "
        "runs are future work"]
