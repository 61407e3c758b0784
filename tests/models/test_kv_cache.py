"""transformers' KV cache in the training forward: batchlab builds a model with its config's use_cache (the family's
default: on), as a user's training loop on that config runs it, turns it off where transformers does (gradient
checkpointing), lets the user set it, and says which; the formula's count and the trace follow real runs."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from batchlab.cli import app
from batchlab.cli.common import config_from_command
from batchlab.config.phase import Phase
from batchlab.config.load import parse_field_value
from batchlab.formula import estimate as formula
from batchlab.measure.harness import Trainer
from batchlab.measure.memory import track_update
from batchlab.run import measure
from batchlab.trace import estimate as trace
from hf_shapes import FAST, config_dir, hf_cfg, rel
from shapes import hf_gpt2, hf_llama

pytest.importorskip("transformers")


@pytest.mark.parametrize("kw, built", [(dict(), True), (dict(use_cache=False), False), (dict(use_cache=True), True),
                                       (dict(ac="full"), False), (dict(ac="selective", use_cache=True), False)])
def test_the_model_is_built_with_its_configs_use_cache_and_without_it_under_checkpointing(kw, built):
    ac = kw.pop("ac", "none")
    cfg = hf_gpt2(ac=ac).replace(**kw)
    trainer = Trainer(cfg, "cpu")
    assert trainer.raw_model.config.use_cache is built is cfg.kv_cache
    trainer.update()  # a cache written inside a recomputed layer would be written twice: it must not be there


def test_use_cache_is_set_by_a_flag_a_change_and_a_config_json():
    assert config_from_command(["estimate", "--model", "gpt2", "--no-use-cache"]).model.use_cache is False
    assert config_from_command(["estimate", "--model", "gpt2", "--use-cache"]).model.use_cache is True
    assert config_from_command(["estimate", "--model", "gpt2"]).model.use_cache is None  # the config's default
    assert parse_field_value("use_cache", "false") is False


def test_a_config_json_with_use_cache_off_is_followed(tmp_path):
    cfg = hf_cfg(config_dir(tmp_path, "llama", use_cache=False))
    assert cfg.model.use_cache is False and Trainer(cfg, "cpu").raw_model.config.use_cache is False


@pytest.mark.parametrize("make", [hf_gpt2, hf_llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_cache_on_and_off_against_real_updates(make, precision):
    real, counted, traced, forward = {}, {}, {}, {}
    for use_cache in (False, True):
        cfg = make(precision=precision).replace(use_cache=use_cache)
        real[use_cache] = track_update(Trainer(cfg, "cpu"))
        est = formula(cfg).memory
        counted[use_cache] = est.activations_bytes
        forward[use_cache] = est.phase_peaks["forward"]
        traced[use_cache] = trace(cfg).memory
        assert traced[use_cache].peak_bytes == real[use_cache].peak_bytes
        assert rel(counted[use_cache], real[use_cache].activations_bytes) <= 0.01
    # GPT-2's cache copies k and v while q's view keeps the fused c_attn output; Llama's copies replace its
    # rotated k and projected v: the formula's difference is the real one
    real_change = real[True].activations_bytes - real[False].activations_bytes
    assert counted[True] - counted[False] == real_change
    assert (real_change > 0) == (make is hf_gpt2)
    # until the loss is computed the cache itself is alive: under autocast Llama's holds each layer's fp32 rotated
    # k (SDPA keeps its 16-bit cast), GPT-2's holds the tensors SDPA keeps
    real_forward = [real[u].phase_peaks[Phase.FORWARD] for u in (False, True)]
    assert forward[True] - forward[False] == real_forward[1] - real_forward[0]
    assert (real_forward[1] - real_forward[0] > real_change) == (make is hf_llama and precision == "bf16-mixed")


def test_estimate_trace_and_measure_say_whether_the_cache_is_on():
    runner = CliRunner()
    small = ["--model", "gpt2", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq", "32"]
    est = json.loads(runner.invoke(app, ["estimate", *small, "--json"]).stdout)["kv_cache"]
    assert est["on"] is True and est["toggle_activations"] < 0 and est["toggle_peak"] < 0 and "--no-use-cache" in est["text"]
    r = runner.invoke(app, ["estimate", "--trace", *small, "--no-use-cache"], env={"COLUMNS": "200"})
    assert "KV cache: off (use_cache=False)" in r.stdout and "--use-cache changes the peak by +" in r.stdout
    assert "KV cache on" in runner.invoke(app, ["estimate", *small], env={"COLUMNS": "200"}).stdout
    off = runner.invoke(app, ["estimate", *small, "--ac", "full", "--verbose"], env={"COLUMNS": "200"}).stdout
    assert "KV cache off" in off and "gradient checkpointing" in off
    assert "KV cache" not in runner.invoke(app, ["estimate", "--model", "tiny"]).stdout  # batchlab's GPT has none
    m = measure(hf_gpt2(), FAST)
    assert m.environment["kv_cache"] is True
