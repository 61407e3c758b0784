"""Every bad input is a clean error: exit 2, one line on stderr naming the field, no traceback — over every
command.  Table-driven; run in-process with typer's CliRunner (a few through a real subprocess at the end).

The values are those a sweep of malformed inputs found crashing, hanging or silently accepted (issue 12):
non-finite and overflowing numbers, wrong TOML / JSON types, empty strings, repeated options.  Nothing here
measures: each error is found before anything runs.  Values click itself rejects (``--layers abc``) are left
to click (its usage box, exit 2)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchlab.cli import app

BIG = "1" + "0" * 29  # a 30-digit whole number
FILES = Path(__file__).parents[1] / "data" / "bad_inputs"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """The bad files the table names as {f}/NAME."""
    d = tmp_path_factory.mktemp("bad")
    gpt2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 100}
    (d / "hf_str.json").write_text(json.dumps({**gpt2, "resid_pdrop": "x"}))
    (d / "hf_list.json").write_text(json.dumps({**gpt2, "resid_pdrop": [1]}))
    (d / "hf_nan.json").write_text(json.dumps(gpt2).replace("}", ', "resid_pdrop": NaN}'))
    (d / "hf_layers_str.json").write_text(json.dumps({**gpt2, "n_layer": "2"}))
    (d / "hf_big.json").write_text(json.dumps({**gpt2, "n_layer": int(BIG)}))
    (d / "hf_array.json").write_text("[1]")
    (d / "hf_broken.json").write_text("{")
    (d / "hf_lacks.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    (d / "hf_family.json").write_text(json.dumps({"model_type": "t5"}))
    for name, text in {
        "cfg_nan": "[config]\noptimizer_bytes_per_param = nan\n",
        "cfg_overhead_text": "[config]\nop_overhead_seconds = \"x\"\n",
        "cfg_inf_budget": "[config]\nmemory_budget = 1e999\n",
        "cfg_unknown": "[config]\ncolour = 1\n",
        "cfg_broken": "[config\n",
        "cfg_layers_big": f"[config]\nlayers = {BIG}\n",
        "cfg_seq_str": "[config]\nseq = \"128\"\n",
        "cfg_torch_float": "[config]\ntorch_version = 2.10\n",
        "cfg_not_table": "config = 5\n",
        "cfg_seed_big": f"[config]\nseed = {BIG}\n",
        "cfg_device": "[config]\ndevice = \"custom:mem=80GB,tflops=nan\"\n",
        "cfg_parallel_list_degree": "[config]\nparallel = {dp = [1], tp = 10000000, pp = 10000000, world_size = 1}\n",
        "cfg_parallel_zero_str": "[config]\nparallel = {zero = \"x\"}\n",
        "cfg_parallel_zero_big": "[config]\nparallel = {zero = 9}\n",
        "cfg_parallel_str_degree": "[config]\nparallel = {dp = \"x\", tp = 3, world_size = 1}\n",
        "exp_note_int": "note = 5\n[change]\nmicro_batch = [1, 2]\n",
        "exp_note_list": "note = [\"a\"]\n[change]\nmicro_batch = [1, 2]\n",
        "exp_confounded_str": "allow_confounded = \"no\"\n[change]\nmicro_batch = [1, 2]\nseq = [64, 128]\n",
        "exp_confounded_int": "allow_confounded = 1\n[change]\nmicro_batch = [1, 2]\n",
        "exp_rounds_str": "rounds = \"3\"\n[change]\nmicro_batch = [1, 2]\n",
        "exp_rounds_float": "rounds = 3.5\n[change]\nmicro_batch = [1, 2]\n",
        "exp_rounds_2": "rounds = 2\n[change]\nmicro_batch = [1, 2]\n",
        "exp_steps_neg": "steps = -1\n[change]\nmicro_batch = [1, 2]\n",
        "exp_warmup_big": f"warmup = {BIG}\n[change]\nmicro_batch = [1, 2]\n",
        "exp_budget_bool": "token_budget = true\n[change]\nmicro_batch = [1, 2]\n",
        "exp_unknown": "colour = 1\n[change]\nmicro_batch = [1, 2]\n",
        "exp_no_change": "rounds = 3\n",
        "exp_change_scalar": "[change]\nmicro_batch = 2\n",
        "exp_change_triple": "[change]\nmicro_batch = [1, 2, 4]\n",
        "exp_change_nan": "[change]\noptimizer_bytes_per_param = [1, nan]\n",
        "exp_change_inf_budget": "[change]\nmemory_budget = [\"1GiB\", 1e999]\n",
        "exp_change_big": f"[change]\nlayers = [1, {BIG}]\n",
        "exp_change_field": "[change]\ncolour = [1, 2]\n",
        "exp_config_nan": "[config]\noptimizer_bytes_per_param = nan\n[change]\nmicro_batch = [1, 2]\n",
        "exp_keep": "keep = \"everything\"\n[change]\nmicro_batch = [1, 2]\n",
        "exp_predict_int": "predict = 5\n[change]\nmicro_batch = [1, 2]\n",
        "exp_predict_bad": "predict = { memory = \"sideways\" }\n[change]\nmicro_batch = [1, 2]\n",
        "exp_broken": "[change\n",
        "exp_twice": "rounds = 3\n[change]\nmicro_batch = [1, 2]\nrounds = 4\n",
    }.items():
        (d / f"{name}.toml").write_text(text)
    (d / "not_fallback.json").write_text('{"a": 1}')
    (d / "broken.json").write_text("{")
    (d / "garbage.sqlite").write_bytes(b"SQLite format 3\x00" + b"\x17" * 4096)
    (d / "fac").mkdir()
    (d / "fac" / "exits.py").write_text("def build(cfg):\n    raise SystemExit(3)\n")
    (d / "fac" / "exits_on_import.py").write_text("raise SystemExit(3)\n")
    (d / "fac" / "raises.py").write_text("def build(cfg):\n    raise RuntimeError('boom')\n")
    (d / "fac" / "not_callable.py").write_text("build = 5\n")
    return d


# shared config options: (argv, field named in the message)
CONFIG = [
    (["--layers=0"], "layers"), (["--layers", BIG], "layers"), (["--hidden=0"], "hidden"),
    (["--hidden", BIG], "hidden"), (["--heads", "3"], "heads"), (["--kv-heads", "3"], "kv_heads"),
    (["--ffn=0"], "ffn"), (["--vocab=0"], "vocab"), (["--vocab", BIG], "vocab"), (["--mlp", "relu"], "mlp"),
    (["--norm", "batchnorm"], "norm"), (["--dropout", "nan"], "dropout"), (["--dropout", "1.5"], "dropout"),
    (["--dropout=-0.1"], "dropout"), (["--attention", "flash"], "attention"), (["--seq=0"], "seq"),
    (["--seq", "100000"], "seq"), (["--seq", BIG], "seq"), (["--micro-batch=0"], "micro_batch"),
    (["--micro-batch", BIG], "micro_batch"), (["--accum=0"], "accum"), (["--accum", BIG], "accum"),
    (["--global-batch", "7", "--micro-batch", "2"], "global_batch"), (["--global-batch=0"], "global_batch"),
    (["--dp=0"], "dp"), (["--dp", BIG], "dp"), (["--precision", "fp8"], "precision"),
    (["--optimizer", "lion"], "optimizer"), (["--optimizer-bytes", "nan"], "optimizer_bytes"),
    (["--optimizer-bytes", "inf"], "optimizer_bytes"), (["--optimizer-bytes=-1"], "optimizer_bytes"),
    (["--optimizer-bytes", "1e999"], "optimizer_bytes"), (["--ac", "sometimes"], "ac"), (["--ac", "every:0"], "ac"),
    (["--ac", "every:99"], "ac"), (["--ac", "every"], "ac"), (["--zero", "4"], "zero"), (["--zero=-1"], "zero"),
    (["--device", "tpu"], "device"), (["--device", "custom:mem=1e999,tflops=100"], "device mem"),
    (["--device", "custom:mem=80GB,tflops=0"], "device tflops"),
    (["--device", "custom:mem=80GB,tflops=nan"], "device tflops"),
    (["--device", "custom:mem=80GB,tflops=-5"], "device tflops"),
    (["--device", "custom:mem=80GB,tflops=inf"], "device tflops"),
    (["--device", "custom:mem=80GB,tflops=100,hbm=0"], "device hbm"),
    (["--device", "custom:mem=80GB,tflops=100,link=nan"], "device link"),
    (["--device", "custom:mem=80GB,tflops=100,net=-1"], "device net"),
    (["--device", "custom:mem=80GB,tflops=100,fp32_tflops=0"], "device fp32_tflops"),
    (["--device", "custom:mem=0,tflops=100"], "device mem"), (["--device", "custom:tflops=100"], "device"),
    (["--device", "custom:mem=80GB,tflops=100,colour=red"], "device"),
    (["--device", "custom:mem=lots,tflops=100"], "device mem"),
    (["--device", "custom:mem=80GB,tflops=100,backend=tpu"], "device"), (["--device", ""], "device"),
    (["--memory-budget", "1e999"], "memory_budget"), (["--memory-budget", ""], "memory_budget"),
    (["--memory-budget", "lots"], "memory_budget"), (["--memory-budget", "0"], "memory_budget"),
    (["--memory-budget", "nan"], "memory_budget"), (["--memory-budget", "-1GiB"], "memory_budget"),
    (["--data", "random"], "data"), (["--seed", BIG], "seed"), (["--seed=-1"], "seed"),
    (["--achievable-fraction", "nan"], "achievable_fraction"), (["--achievable-fraction", "0"], "achievable_fraction"),
    (["--achievable-fraction", "2"], "achievable_fraction"), (["--comm-overlap", "inf"], "comm_overlap"),
    (["--comm-overlap=-0.5"], "comm_overlap"), (["--model", ""], "model"), (["--model", "   "], "model"),
    (["--model", "no-such-preset"], "model"), (["--model", "not a module:f"], "model"),
    (["--hf-config", "{f}/missing.json"], "hf_config"), (["--hf-config", "{f}/hf_str.json"], "resid_pdrop"),
    (["--hf-config", "{f}/hf_list.json"], "resid_pdrop"), (["--hf-config", "{f}/hf_nan.json"], "resid_pdrop"),
    (["--hf-config", "{f}/hf_layers_str.json"], "layers"), (["--hf-config", "{f}/hf_big.json"], "layers"),
    (["--hf-config", "{f}/hf_array.json"], "hf_config"), (["--hf-config", "{f}/hf_broken.json"], "hf_config"),
    (["--hf-config", "{f}/hf_lacks.json"], "hf_config"), (["--hf-config", "{f}/hf_family.json"], "hf_config"),
    (["--config", "{f}/missing.toml"], "config"), (["--config", "{f}/cfg_broken.toml"], "config"),
    (["--config", "{f}/cfg_unknown.toml"], "colour"), (["--config", "{f}/cfg_nan.toml"], "optimizer_bytes"),
    (["--config", "{f}/cfg_overhead_text.toml"], "op_overhead_seconds"),
    (["--config", "{f}/cfg_inf_budget.toml"], "memory_budget"), (["--config", "{f}/cfg_layers_big.toml"], "layers"),
    (["--config", "{f}/cfg_parallel_list_degree.toml"], "dp"),
    (["--config", "{f}/cfg_parallel_str_degree.toml"], "dp"), (["--config", "{f}/cfg_parallel_zero_str.toml"], "parallel.zero"),
    (["--config", "{f}/cfg_parallel_zero_big.toml"], "parallel.zero"), (["--config", "{f}/cfg_seq_str.toml"], "seq"), (["--config", "{f}/cfg_seed_big.toml"], "seed"),
    (["--config", "{f}/cfg_device.toml"], "device tflops"),
    (["--config", "{f}/cfg_torch_float.toml"], 'torch_version: quote it, e.g. "2.10"'),
]
# the subset also run through measure, explain and fit (the same parser: a sample shows it is the one used)
SAMPLE = [CONFIG[i] for i in (1, 11, 17, 20, 28, 33, 39, 41, 44, 55, 57, 61, 64, 70, 74, 75, 81, 88)]

COMPARE = ["compare", "--formula-only", "--predict", "none", "--notebook", "{f}/nb.sqlite"]
OWN = [
    (["estimate", "--vary", "micro_batch=1,2", "--vary", "seq=64,128"], "vary"),
    (["estimate", "--vary", "micro_batch=1,2", "--vary", "micro_batch=4,8"], "vary"),
    (["estimate", "--vary", "micro_batch"], "vary"), (["estimate", "--vary", "colour=1,2"], "colour"),
    (["estimate", "--trace", "--vary", "micro_batch=1,2"], "trace"),
    (["estimate", "--vary", "accum=5..2"], "vary"), (["estimate", "--vary", "accum=1..x"], "vary"),
    (["estimate", "--vary", "accum=1..1000000"], "vary"),
    (["estimate", "--timeline", "out.txt"], "timeline"),
    (COMPARE + ["--change", "micro_batch"], "change"), (COMPARE + ["--change", "micro_batch=1"], "change"),
    (COMPARE + ["--change", "colour=1:2"], "colour"), (COMPARE + ["--change", f"layers=1:{BIG}"], "layers"),
    (COMPARE + ["--change", "optimizer_bytes_per_param=1:nan"], "optimizer_bytes"),
    (COMPARE + ["--change", "optimizer_bytes_per_param=1:inf"], "optimizer_bytes"),
    (COMPARE + ["--change", "memory_budget=1GiB:1e999"], "memory_budget"),
    (COMPARE + ["--change", "dropout=0:nan"], "dropout"), (COMPARE + ["--change", f"seed=0:{BIG}"], "seed"),
    (COMPARE + ["--change", "device=cpu:custom:mem=80GB,tflops=0"], "device"),
    (COMPARE + ["--change", "micro_batch=1:1"], "micro_batch"),
    (COMPARE + ["--change", "micro_batch=1:2", "--experiment", "{f}/exp_note_int.toml"], "change"),
    (COMPARE + ["--rounds", "2"], "rounds"), (COMPARE + ["--steps", "0"], "steps"),
    (COMPARE + ["--warmup", "0"], "warmup"), (COMPARE + ["--token-budget", "0"], "token_budget"),
    (COMPARE + ["--keep", "everything"], "keep"), (COMPARE + ["--predict", "memory=sideways"], "memory"),
    (COMPARE + ["--predict", "colour=up"], "colour"), (COMPARE + ["--timeout", "nan"], "timeout"),
    (COMPARE + ["--timeout=-1"], "timeout"), (COMPARE + ["--threads=-1"], "threads"),
    (COMPARE + ["--experiment", "{f}/missing.toml"], "experiment"),
    *[(COMPARE + ["--experiment", f"{{f}}/{name}.toml"], field) for name, field in (
        ("exp_note_int", "note"), ("exp_note_list", "note"), ("exp_confounded_str", "allow_confounded"),
        ("exp_confounded_int", "allow_confounded"), ("exp_rounds_str", "rounds"), ("exp_rounds_float", "rounds"),
        ("exp_rounds_2", "rounds"), ("exp_steps_neg", "steps"), ("exp_warmup_big", "warmup"),
        ("exp_budget_bool", "token_budget"), ("exp_unknown", "colour"), ("exp_no_change", "change"),
        ("exp_change_scalar", "micro_batch"), ("exp_change_triple", "micro_batch"),
        ("exp_change_nan", "optimizer_bytes"), ("exp_change_inf_budget", "memory_budget"),
        ("exp_change_big", "layers"), ("exp_change_field", "colour"), ("exp_config_nan", "optimizer_bytes"),
        ("exp_keep", "keep"), ("exp_predict_int", "predict"), ("exp_predict_bad", "memory"),
        ("exp_broken", "experiment"), ("exp_twice", "rounds"))],
    (["measure", "--steps", "0"], "steps"), (["measure", "--warmup", "0"], "warmup"),
    (["measure", "--isolate", "--timeout", "nan"], "timeout"), (["measure", "--isolate", "--timeout=-1"], "timeout"),
    (["measure", "--nproc", "0", "--dp", "2"], "nproc"), (["measure", "--nproc", "3", "--dp", "2"], "dp"),
    (["measure", "--torch-device", "meta"], "torch_device"), (["measure", "--torch-device", "tpu"], "torch_device"),
    (["measure", "--torch-device", "cuda:x"], "torch_device"),
    # a torch device given as the card: the error says which flags take it
    (["measure", "--device", "cuda"], "device: 'cuda' is a torch device"),
    (["measure", "--device", "cuda"], "--device local"), (["measure", "--device", "cuda:1"], "--torch-device cuda:1"),
    (["measure", "--model", "no_such_module_xyz:build"], "model"), (["measure", "--model", "exits:build"], "model"),
    (["measure", "--model", "exits_on_import:build"], "model"), (["measure", "--model", "raises:build"], "model"),
    (["measure", "--model", "not_callable:build"], "model"), (["measure", "--model", "exits:nothing"], "model"),
    (["measure", "--timeline", "out.txt"], "timeline"),
    (["fit", "--margin", "nan"], "margin"), (["fit", "--margin", "1"], "margin"), (["fit", "--margin=-0.1"], "margin"),
    (["fit", "--tokens", "nan"], "tokens"), (["fit", "--tokens", "inf"], "tokens"), (["fit", "--tokens", "0"], "tokens"),
    (["fit", "--top", "0"], "top"), (["fit", "--global-tokens", "100"], "global_tokens"),
    (["fit", "--timeout", "nan"], "timeout"),
    (["calibrate", "--seconds", "nan"], "seconds"), (["calibrate", "--seconds", "inf"], "seconds"),
    (["calibrate", "--seconds", "0"], "seconds"), (["calibrate", "--seconds", "1e9"], "seconds"),
    (["calibrate", "--torch-device", "meta"], "torch_device"), (["calibrate", "--torch-device", "tpu"], "torch_device"),
    (["notebook", "show", BIG, "--notebook", "{f}/nb.sqlite"], "id"),
    (["notebook", "show", "0", "--notebook", "{f}/nb.sqlite"], "id"),
    (["notebook", "show", "999", "--notebook", "{f}/nb.sqlite"], "id"),
    (["notebook", "show", "1", "--notebook", "{f}/garbage.sqlite"], "notebook"),
    (["notebook", "list", "--notebook", "{f}/garbage.sqlite"], "notebook"),
    (["notebook", "export", "--notebook", "{f}/garbage.sqlite"], "notebook"),
    (["notebook", "export", "--format", "xml", "--notebook", "{f}/nb.sqlite"], "format"),
    (["notebook", "export", "--notebook", "{f}/nb.sqlite", "-o", "{f}"], "output"),
    (["notebook", "diff", "1", BIG, "--notebook", "{f}/nb.sqlite"], "id"),
    (["notebook", "diff", "1", "2", "--notebook", "{f}/garbage.sqlite"], "notebook"),
    (["notebook", "import", "{f}/missing.json", "--notebook", "{f}/nb.sqlite"], "file"),
    (["notebook", "import", "{f}/not_fallback.json", "--notebook", "{f}/nb.sqlite"], "file"),
    (["notebook", "import", "{f}/broken.json", "--notebook", "{f}/nb.sqlite"], "file"),
    (["notebook", "import", "{f}/fallback.json", "--notebook", "{f}/nb.sqlite"], "damaged"),
]
# the tensor and pipeline layouts issue 41 lists as bad, each on estimate, compare, measure and fit
LLAMA_TP = ["--model", "hf:llama", "--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "1", "--ffn",
            "256", "--vocab", "512"]
LAYOUT = [
    (["--tp", "3"], "tp"),  # heads 4
    (LLAMA_TP + ["--tp", "2"], "tp"),  # kv heads 1
    (["--pp", "3"], "pp"), (["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--pp-virtual", "3"], "pp"),  # 4 layers
    (["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--pp-virtual", "2", "--accum", "1"], "accum"),
    (["--pp", "4", "--pp-schedule", "1f1b", "--accum", "3"], "accum"),
]
WORLD = [(["measure", "--tp", "2", "--pp", "2", "--accum", "2", "--nproc", "6"], "nproc"),
         (["measure", "--tp", "2", "--nproc", "4", "--dp", "4"], "dp"),
         (["fit", "--tp", "2", "--pp", "2", "--world-size", "6", "--global-batch", "8"], "world_size")]
CASES = ([(["estimate", *a], f) for a, f in CONFIG] + [(COMPARE + a, f) for a, f in CONFIG]
         + [([cmd, *a], f) for cmd in ("measure", "explain", "fit") for a, f in SAMPLE] + OWN
         + [([cmd, *a], f) for cmd in ("estimate", "measure", "fit") for a, f in LAYOUT]
         + [(COMPARE + a + ["--change", "micro_batch=1:2"], f) for a, f in LAYOUT] + WORLD)


def test_the_suite_is_large_enough():
    assert len(CASES) >= 150


def _id(case) -> str:
    argv, field = case
    return " ".join(a if len(a) < 40 else a[:37] + "..." for a in argv if a not in COMPARE[1:]) + f" -> {field}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_a_bad_input_is_one_line_naming_the_field(case, files, monkeypatch, tmp_path):
    argv, field = case
    monkeypatch.syspath_prepend(str(files / "fac"))  # the factory modules the table names
    monkeypatch.chdir(files)
    if not (files / "fallback.json").exists():
        (files / "fallback.json").write_text(json.dumps({"batchlab_unsaved_record": 1, "record": {}}))
    book = tmp_path / "nb.sqlite"
    res = CliRunner().invoke(app, [a.replace("{f}/nb.sqlite", str(book)).replace("{f}", str(files)) for a in argv])
    err = res.stderr.strip()
    assert res.exit_code == 2, f"exit {res.exit_code}: {res.output}\n{res.exception!r}"
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert field in err, err
    assert not book.exists() or _rows(book) == 0  # bad input leaves nothing in the notebook


@pytest.mark.parametrize("value, field", [("micro_batch=1,0", "micro_batch"), (f"layers=1,{BIG}", "layers"),
                                          ("optimizer_bytes_per_param=1,inf", "optimizer_bytes")])
def test_a_value_the_config_refuses_in_a_vary_table_is_its_row_marked_not_possible(value, field):
    """--vary keeps every row (first-hour's design): a value of the field's type that this config cannot take is
    that row's "not possible", naming the field."""
    res = CliRunner().invoke(app, ["estimate", "--vary", value], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and res.exception is None and "Traceback" not in res.output
    assert f"not possible: {field}" in res.output, res.output


@pytest.mark.parametrize("value, bad", [("micro_batch=abc,2", "abc"), ("micro_batch=2,abc", "abc"),
                                        ("micro_batch=1,nan,4", "nan")])
def test_a_value_not_of_the_fields_type_in_a_vary_table_is_a_user_error_wherever_it_stands(value, bad):
    """'abc' is no whole number whatever the config: one line naming the field, exit 2, before any row is
    computed, first value or not."""
    res = CliRunner().invoke(app, ["estimate", "--vary", value])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert res.stderr.strip().splitlines() == [f"error: micro_batch: {bad!r} is not a whole number"]
    assert res.stdout == ""


def test_a_value_outside_a_closed_set_in_a_vary_table_is_a_user_error_too():
    res = CliRunner().invoke(app, ["estimate", "--vary", "precision=bf16-mixed,[red]x"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert res.stderr.strip().splitlines() == [
        "error: precision: '[red]x' is not one of: fp32, bf16-mixed, fp16-mixed, bf16, bf16-fsdp"]
    assert res.stdout == ""


def _rows(path: Path) -> int:
    import sqlite3

    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT count(*) FROM experiments").fetchone()[0]


@pytest.mark.parametrize("argv, field", [
    (["estimate", "--layers", BIG], "layers"),
    (["estimate", "--optimizer-bytes", "nan"], "optimizer_bytes"),
    (["compare", "--formula-only", "--predict", "none", "--notebook", "{nb}", "--seed", BIG], "seed"),
])
def test_through_the_installed_entry_point(argv, field, tmp_path):
    """The same errors from a real process (the console script's main, which also maps SIGTERM)."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    argv = [a.replace("{nb}", str(tmp_path / "nb.sqlite")) for a in argv]
    out = subprocess.run([sys.executable, "-m", "batchlab", *argv], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().startswith("error: ") and len(out.stderr.strip().splitlines()) == 1
    assert field in out.stderr and "Traceback" not in out.stderr


def test_a_parallel_world_size_counts_a_degree_given_beside_the_table(tmp_path):
    """world_size in [config.parallel] is checked against dp x tp x pp, a degree given as a flat field included."""
    from batchlab.config import load_config_toml

    p = tmp_path / "c.toml"
    p.write_text("[config]\ndp = 2\nparallel = {world_size = 2}\n")
    assert load_config_toml(p).parallel.world_size == 2


def test_a_compare_the_measurement_would_refuse_is_refused_before_any_calibration(monkeypatch, tmp_path):
    """A budget that cannot hold the model: exit 2 at once, not after calibrating this CPU for tens of seconds."""
    from batchlab import calibrate

    calls = []
    monkeypatch.setattr(calibrate, "auto", lambda *a, **k: calls.append(a))
    res = CliRunner().invoke(app, ["compare", "--change", "micro_batch=1:2", "--memory-budget", "1KiB", "--predict",
                                   "none", "--notebook", str(tmp_path / "nb.sqlite")])
    assert res.exit_code == 2 and "memory_budget" in res.stderr and calls == [], (res.output, calls)
