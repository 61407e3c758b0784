"""--compile on the command line: validated, in --json and --change, warned about once where only the formula
answers, traced by estimate --trace (inductor's wrapper on fake tensors, no kernel built)."""
import json

from typer.testing import CliRunner

from batchlab.cli import app
from batchlab.config import CompileMode, RunConfig, config_from_dict, parse_field_value
from batchlab.experiment.predict import COMPILED_TIME_MARGIN

runner = CliRunner()
WARNING = "layer terms are eager PyTorch's here"


def run(*args):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


def test_compile_is_a_config_field_everywhere():
    cfg = RunConfig(compile="Blocks")
    assert cfg.compile is CompileMode.BLOCKS and cfg.to_dict()["compile"] == "blocks"
    assert config_from_dict(cfg.to_dict()).compile is CompileMode.BLOCKS
    assert parse_field_value("compile", "model") == "model" and RunConfig().replace(compile="model").compile.value == "model"
    r = run("estimate", "--compile", "everything")
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [
        "error: compile: 'everything' is not one of: none, model, blocks"]


def test_the_formula_says_where_its_compiled_terms_come_from_and_once_where_it_has_none():
    r = run("estimate", "--compile", "blocks", "--json")
    assert r.exit_code == 0 and WARNING not in r.stderr
    assert json.loads(r.stdout)["config"]["compile"] == "blocks"
    assert "partition" in run("estimate", "--compile", "blocks").stdout  # the layer-terms line names the source
    # AC policies the compiled terms are not derived for: eager terms, said once whatever the rows
    r = run("estimate", "--compile", "blocks", "--ac", "selective-attn", "--json")
    assert r.exit_code == 0 and r.stderr.count(WARNING) == 1 and "selective-attn" in r.stderr
    r = run("estimate", "--ac", "selective-attn", "--vary", "compile=none,model,blocks")
    assert r.exit_code == 0 and r.stderr.count(WARNING) == 1
    assert WARNING not in run("estimate").stderr


def test_trace_compile_counts_the_partition_and_says_how():
    args = ("estimate", "--trace", "--layers", "1", "--seq", "32", "--micro-batch", "2", "--json")
    r = run(*args, "--compile", "blocks")
    assert r.exit_code == 0, r.output
    assert WARNING not in r.stderr
    compiled, eager = json.loads(r.stdout), json.loads(run(*args).stdout)
    assert any("min-cut partition" in n and "exact on what the compiled forward saves" in n for n in compiled["notes"])
    assert any("graph breaks" in n for n in compiled["notes"])
    assert any("inductor's own compile" in n for n in compiled["notes"])
    # a CUDA config: inductor would lower with Triton there, so the partition-only count, and the note says why
    cuda = json.loads(run(*args, "--compile", "blocks", "--device", "h100-sxm").stdout)["notes"]
    assert any("min-cut partition" in n and "inductor lowers for CPU only here" in n for n in cuda)
    # the partition saves fewer bytes than eager autograd keeps (it recomputes cheap ops in backward), and the
    # model states are the same
    assert compiled["memory"]["activations_bytes"] < eager["memory"]["activations_bytes"]
    for k in ("parameters_bytes", "gradients_bytes", "optimizer_bytes"):
        assert compiled["memory"][k] == eager["memory"][k]
    # the formula's compiled terms (derived at other dimensions) count what this partition keeps
    formula = json.loads(run(*args[:1], *args[2:], "--compile", "blocks").stdout)["memory"]["activations_bytes"]
    assert abs(formula - compiled["memory"]["activations_bytes"]) < 0.01 * compiled["memory"]["activations_bytes"]


def test_compare_a_compile_change_predicts_time_only_beyond_the_margin_and_says_why_where_terms_are_eager():
    r = run("compare", "--layers", "1", "--seq", "64", "--micro-batch", "4", "--change", "compile=none:blocks",
            "--formula-only", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["formula"]["available"] is True, d["formula"]
    assert d["formula"]["prediction"]["peak_memory"]["direction"] == "down"  # the partition saves less than eager
    # the fusion rule's time: a direction only where it moves by more than its margin, else the reason
    ratio = d["formula"]["b"]["time"]["update_seconds"] / d["formula"]["a"]["time"]["update_seconds"]
    if abs(ratio - 1) > COMPILED_TIME_MARGIN:
        assert d["formula"]["prediction"]["update_time"]["direction"] == ("down" if ratio < 1 else "up")
    else:
        assert "update_time" not in d["formula"]["prediction"] and "fusion rule" in d["formula"]["reason"]
    r = run("compare", "--layers", "1", "--seq", "16", "--micro-batch", "1", "--ac", "selective-attn",
            "--change", "compile=none:blocks", "--formula-only", "--json")
    d = json.loads(r.stdout)
    assert d["formula"]["available"] is False and WARNING in d["formula"]["reason"]


def test_measure_without_a_cpp_compiler_is_one_line_and_exit_2():
    """Inductor reads CXX: a compiler that is not there is refused before anything is built."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "batchlab", "measure", "--layers", "1", "--seq", "16",
                        "--micro-batch", "1", "--compile", "blocks", "--steps", "1"],
                       env={**os.environ, "CXX": "batchlab-no-such-c++"}, capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: compile: inductor needs a C++ compiler") and "batchlab-no-such-c++" in lines[0]
