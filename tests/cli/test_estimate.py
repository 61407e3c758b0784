import json

import pytest
from typer.testing import CliRunner

from batchlab.cli import app
from batchlab.config import RunConfig

runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


def test_estimate_json_contract():
    r = run("estimate", "--model", "gpt2", "--seq", "1024", "--micro-batch", "4", "--accum", "2",
            "--device", "a100-80gb", "--precision", "bf16-mixed", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["provenance"] == "formula" and d["global_batch"] == 8
    n = 124_439_808  # gpt2's published parameter count
    mem = d["memory"]
    assert (mem["parameters_bytes"], mem["master_bytes"], mem["gradients_bytes"], mem["optimizer_bytes"]) == \
        (2 * n, 4 * n, 4 * n, 8 * n)  # bf16 working copies, fp32 master, fp32 grads, AdamW m and v
    assert mem["fits"] is True and mem["peak_phase"] in ("forward", "backward", "optimizer")
    assert mem["peak_bytes"] == mem["peak_tensor_bytes"] + mem["margin_bytes"] > mem["activations_bytes"]
    assert {"update_seconds", "tokens_per_second"} <= set(d["time"])
    assert d["flops"]["hardware_flops_per_update"] == d["flops"]["model_flops_per_update"]


def test_estimate_table_names_provenance_global_batch_and_both_checkpoints():
    r = run("estimate", "--ac", "full", "--tokens", "1e9", "--price", "2")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "[formula]" in out and "global batch = micro-batch x accum x DP = 8 x 1 x 1 = 8" in out
    assert "Training checkpoint file on disk" in out and "not activation" in out
    assert "time to 1 billion tokens" in out


def test_global_batch_derives_accum():
    r = run("estimate", "--global-batch", "32", "--micro-batch", "4", "--dp", "2", "--json")
    d = json.loads(r.stdout)
    assert (d["config"]["accum"], d["global_batch"]) == (4, 32)


@pytest.mark.parametrize("args, field", [
    (("--heads", "3"), "heads"),
    (("--global-batch", "7", "--micro-batch", "2"), "global_batch"),
    (("--model", "gpt-17"), "model"),
    (("--device", "tpu"), "device"),
    (("--seq", "4096"), "seq"),
    (("--ac", "every:9"), "ac"),
    (("--micro-batch", "0"), "micro_batch"),
    (("--vary", "bogus=1,2"), "bogus"),
    (("--hf-config", "/nonexistent/config.json"), "hf_config"),
])
def test_bad_input_is_one_line_exit_2(args, field):
    r = run("estimate", *args)
    assert r.exit_code == 2
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}"), r.stderr
    assert "Traceback" not in r.output


def test_vary_keeps_global_batch_and_warns_when_it_changes():
    r = run("estimate", "--vary", "micro_batch=1,2,4", "--global-batch", "8", "--json")
    rows = json.loads(r.stdout)
    assert [row["global_batch"] for row in rows] == [8, 8, 8]
    assert [row["config"]["accum"] for row in rows] == [8, 4, 2]
    assert rows[2]["directions"]["activations"] == "up"
    r = run("estimate", "--vary", "micro_batch=1,2", "--keep", "accum")
    assert "global batch changes" in r.stdout


def test_explain_uses_the_users_numbers():
    r = run("explain", "--micro-batch", "2", "--accum", "4", "--dp", "2")
    assert r.exit_code == 0, r.output
    assert "2 x 4 x 2 = 16" in r.stdout and "Training checkpoint" in r.stdout
    # tiny: 891,648 parameters x (4 fp32 weights + 8 AdamW state) bytes = 10,699,776 B = 10.20 MiB
    assert "10.20 MiB" in r.stdout


def test_a_config_json_without_optional_fields_counts_the_model_transformers_builds(tmp_path, monkeypatch):
    """GPT-2 with no n_positions / n_inner: the family's defaults (1024 positions, 4h MLP), as
    AutoModelForCausalLM.from_config fills them; without torch, estimate says why it has no layer profile
    (the profiled path: tests/trace/test_layer_profile.py); a custom device's memory is the capacity."""
    transformers = pytest.importorskip("transformers")
    import sys

    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100}))
    monkeypatch.setitem(sys.modules, "batchlab.trace.profile", None)  # import fails as it does without torch
    r = run("estimate", "--hf-config", str(p), "--device", "custom:mem=1GiB,tflops=10", "--json")
    assert r.exit_code == 0, r.output
    assert "no layer profile (" in r.stderr and "built-in layer terms" in r.stderr
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    d = json.loads(r.stdout)
    assert d["parameters"] == sum(q.numel() for q in model.parameters())
    assert d["config"]["model"]["layers"] == 2 and d["memory"]["capacity_bytes"] == 2**30  # the custom device


def test_config_file_from_fit_is_the_base_and_typed_flags_override(tmp_path):
    from batchlab.advise.snippets import config_toml
    from batchlab.config import load_config_toml, preset

    cfg = RunConfig(model=preset("tiny", layers=2), seq=64, micro_batch=16, ac="selective", precision="bf16-mixed")
    path = tmp_path / "fit.toml"
    path.write_text(config_toml(cfg))
    assert load_config_toml(path) == cfg
    d = json.loads(run("estimate", "--config", str(path), "--json").stdout)
    assert (d["config"]["seq"], d["config"]["micro_batch"], d["config"]["ac"], d["config"]["model"]["layers"]) == \
        (64, 16, "selective", 2)
    # --seq 128 equals the flag's default, but it was typed: it wins over the file
    d = json.loads(run("estimate", "--config", str(path), "--seq", "128", "--global-batch", "32", "--json").stdout)
    assert (d["config"]["seq"], d["config"]["micro_batch"], d["config"]["accum"]) == (128, 16, 2)
    r = run("estimate", "--config", str(tmp_path / "missing.toml"))
    assert r.exit_code == 2 and r.stderr.startswith("error: config")


def test_vary_accum_keeps_the_global_batch_by_re_deriving_the_micro_batch():
    rows = json.loads(run("estimate", "--vary", "accum=1,2,4", "--global-batch", "8", "--micro-batch", "8",
                          "--json").stdout)
    assert [(r["config"]["micro_batch"], r["config"]["accum"], r["global_batch"]) for r in rows] == \
        [(8, 1, 8), (4, 2, 8), (2, 4, 8)]


def test_a_vary_range_is_every_whole_number_in_it():
    rows = json.loads(run("estimate", "--vary", "accum=1,2..4,8", "--keep", "accum", "--micro-batch", "2",
                          "--json").stdout)
    assert [r["config"]["accum"] for r in rows] == [1, 2, 3, 4, 8]
    assert [r["global_batch"] for r in rows] == [2, 4, 6, 8, 16]  # 2 x accum x 1


def test_config_file_model_may_be_a_hugging_face_family(tmp_path):
    from batchlab.config import load_config_toml

    path = tmp_path / "c.toml"
    path.write_text('[config]\nmodel = "hf:gpt2"\nseq = 64\n')
    cfg = load_config_toml(path)
    assert (cfg.model.name, cfg.model.layers, cfg.model_source) == ("gpt2", 12, "hf:gpt2")
    path.write_text('[config]\nmodel = "tiny"\nmicro_batch = 4\n')
    d = json.loads(run("estimate", "--config", str(path), "--global-batch", "8", "--accum", "2", "--json").stdout)
    assert (d["config"]["micro_batch"], d["config"]["accum"]) == (4, 2)


def test_estimate_and_vary_use_the_cached_calibration_of_the_device(tmp_path, monkeypatch):
    # the CLI is the caller that reads the cache: formula.estimate itself never does
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    import torch

    from batchlab.calibrate import Calibration, save
    from batchlab.host import cpu_hardware

    rate = 5e10  # a flat matmul curve: every matmul at 50 GFLOP/s, used as measured (no achievable fraction)
    save(Calibration(device="cpu", hardware=f"{cpu_hardware()}, 1 threads", torch_device="cpu",
                     matmul_flops_fp32=rate, matmul_flops_bf16=None, memory_bytes_per_s=3e9, threads=1,
                     measured_at="2025-01-01T00:00:00+00:00", torch_version=torch.__version__,
                     matmul_curve={"fp32": [[1.0, rate], [1e12, rate]]}, memory_curve=[[1.0, 3e9], [1e9, 3e9]], strided_bytes_per_s=1e9,
                     dispatch_seconds={"forward": 5e-6, "backward": 5e-6, "plain": 5e-6}))
    one = json.loads(run("estimate", "--device", "cpu", "--json").stdout)["time"]
    assert one["flops_ceiling"] == pytest.approx(rate) and one["ceiling_source"].startswith("calibrated on")
    rows = json.loads(run("estimate", "--device", "cpu", "--vary", "micro_batch=1,2", "--json").stdout)
    assert [r["time"]["flops_ceiling"] for r in rows] == pytest.approx([rate] * 2)
    other = json.loads(run("estimate", "--device", "h100-sxm", "--json").stdout)["time"]
    assert other["ceiling_source"].startswith("nominal:") and "datasheet" in other["ceiling_source"]  # none cached


def test_typed_seq_is_validated_against_the_config_files_model_not_the_default(tmp_path):
    path = tmp_path / "gpt2.toml"
    path.write_text('[config]\nmodel = "gpt2"\nmicro_batch = 2\n')
    # tiny's max_positions is 256, gpt2's 1024: the typed --seq is checked once, after the merge
    d = json.loads(run("estimate", "--config", str(path), "--seq", "512", "--json").stdout)
    assert (d["config"]["model"]["name"], d["config"]["seq"], d["config"]["micro_batch"]) == ("gpt2", 512, 2)
    r = run("estimate", "--config", str(path), "--seq", "2048")
    assert r.exit_code == 2 and r.stderr.startswith("error: seq") and "1024" in r.stderr
    d = json.loads(run("estimate", "--config", str(path), "--layers", "3", "--memory-budget", "1GiB", "--json").stdout)
    assert (d["config"]["model"]["layers"], d["config"]["memory_budget"]) == (3, 2**30)


def test_a_long_sweep_counts_its_impossible_rows_and_suggests_no_absurd_global_batch():
    # micro_batch=1..1000 at the kept global batch 8: only 1, 2, 4, 8 are possible; the global batch every
    # row would divide is lcm(1..1000), already past 1e9 at lcm(1..23) = 5,354,228,880
    r = run("estimate", "--vary", "micro_batch=1..1000")
    assert r.exit_code == 0, r.output
    notes = [line for line in r.stdout.splitlines() if line.startswith("micro_batch=")]
    assert len(notes) == 5 and "... and 991 more values not possible" in r.stdout
    assert "no global batch up to 1e+09 makes every row possible" in " ".join(r.stdout.split())
    r = run("estimate", "--vary", "micro_batch=1..1000", "--verbose")  # every row's why and fix
    assert len([line for line in r.stdout.splitlines() if line.startswith("micro_batch=")]) == 996
    assert "more values not possible" not in r.stdout
    rows = json.loads(run("estimate", "--vary", "micro_batch=1..1000", "--json").stdout)
    assert sum(row["possible"] for row in rows) == 4 and all(row["fix"] for row in rows if not row["possible"])


def test_vary_table_keeps_every_row_and_exits_0_when_one_is_possible():
    r = run("estimate", "--vary", "micro_batch=1,2,4,8,16")
    assert r.exit_code == 0, r.output
    assert "not possible" in r.stdout and "--keep accum" in r.stdout and "--global-batch 16" in r.stdout
    rows = json.loads(run("estimate", "--vary", "micro_batch=1,2,4,8,16", "--json").stdout)
    assert [row["possible"] for row in rows] == [True] * 4 + [False]
    assert rows[4]["value"] == "16" and "--keep accum" in rows[4]["fix"]
    r = run("estimate", "--model", "llama-2-7b", "--micro-batch", "2", "--dp", "8", "--vary", "accum=32,64")
    assert r.exit_code == 2 and r.stderr.startswith("error: accum") and "--global-batch 512" in r.stderr


def test_explain_gives_both_readings_of_doubling_accumulation_with_the_users_numbers():
    from batchlab.config import Keep, apply_change
    from batchlab.formula import estimate

    d = json.loads(run("explain", "--micro-batch", "2", "--accum", "4", "--dp", "2", "--json").stdout)
    text = "\n".join(d["lines"])
    assert "[bold]" not in text and "[/" not in text  # plain strings in JSON
    acc = next(s for s in d["sections"] if s["title"].startswith("Gradient accumulation"))
    fixed_micro = next(l for l in acc["lines"] if "(a)" in l)
    fixed_global = next(l for l in acc["lines"] if "(b)" in l)
    # (a) micro-batch 2 kept: 2 x 8 x 2 = 32, the global batch doubles; (b) global batch 16 kept: micro-batch 1
    assert "2 x 8 x 2 = global batch 32" in fixed_micro and "global batch doubles" in fixed_micro
    assert "1 x 8 x 2 = global batch 16" in fixed_global and "micro-batch halves" in fixed_global
    base = RunConfig(micro_batch=2, accum=4, dp=2)
    a, b = (estimate(apply_change(base, "accum", 8, k)) for k in (Keep.ACCUM, Keep.GLOBAL_BATCH))
    e = estimate(base)
    assert a.memory.peak_bytes == pytest.approx(e.memory.peak_bytes, rel=0.01) and "stays about the same" in fixed_micro
    assert 1.8 < a.time.update_seconds / e.time.update_seconds < 2.0  # twice the sequences, one optimizer step
    assert b.memory.activations_bytes < e.memory.activations_bytes and "peak falls" in fixed_global
    titles = [s["title"] for s in d["sections"]]
    for q in ("1. Micro-batch and global batch", "2. Why activation checkpointing", "3. What accumulation changes",
              "4. What a local comparison cannot support"):
        assert any(t.startswith(q) for t in titles), titles
    local = next(s for s in d["sections"] if s["title"].startswith("4."))
    # compare's scope rules: a CPU run says nothing about GPU kernels; loopback gloo nothing about NCCL
    assert any("GPU kernels" in l for l in local["lines"]) and any("NCCL" in l for l in local["lines"])


@pytest.mark.parametrize("args", [["--micro-batch", "1", "--accum", "8"], ["--accum", "1"], ["--global-batch", "1"],
                                  ["--micro-batch", "3", "--accum", "3", "--dp", "3"], ["--dp", "1", "--ac", "full"]])
def test_explain_says_a_change_that_is_not_possible_in_one_complete_sentence(args):
    """Edge inputs (micro-batch 1, accum 1, global batch 1, odd sizes): where a change cannot be made at a fixed
    global batch the line says why and what it would need, and nothing follows it with placeholders."""
    d = json.loads(run("explain", *args, "--json").stdout)
    lines = [line for s in d["sections"] for line in s["lines"]]
    for line in lines:
        assert not any(p in line for p in (" -;", " - as long", " -.", "peak -", "takes -")), line
    for line in (l for l in lines if "not possible here" in l):
        assert line.endswith(".") and "halves" not in line and "doubles" not in line, line
        assert "needs an even one (now" in line, line  # what the change would need
    if args[:4] == ["--micro-batch", "1", "--accum", "8"]:
        (b,) = [l for l in lines if l.lstrip().startswith("(b)")]
        assert "not possible here" in b and "halving the micro-batch needs an even one (now 1)." in b


def test_the_memory_tables_live_column_adds_up_to_allocated_under_a_pipeline():
    # a pipeline stage's own parts (its kept outputs, receive buffers, gradient sends) have rows of their own
    from batchlab.cli.estimate import _memory_rows
    from batchlab.config.model import preset
    from batchlab.formula import estimate

    e = estimate(RunConfig(model=preset("gpt2"), pp=2, accum=8, device="a100-80gb"))
    rows = _memory_rows(e, verbose=False)
    assert {"stage outputs", "receive buffers"} <= {r[0] for r in rows}
    assert sum(e.memory.at_peak[part] for _, _, part, _ in rows if part) == e.memory.allocated_bytes
