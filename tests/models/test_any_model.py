"""Any model: hf: for every family transformers builds, a calculator whose layer terms come from the model's own
code (a layer profile), and non-language models through factories.  References: real runs' live tensor
storages (measure), the HF model's own parameters and loss, hand-computed polynomials."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchlab.config import ConfigError, Counted, RunConfig, resolve_model
from batchlab.config.profile import Knots, Poly
from batchlab.formula.params import count
from batchlab.measure import MeasureOptions
from batchlab.run import measure as run
from batchlab.trace import estimate as trace_estimate

from hf_shapes import FAST, config_dir, hf_cfg, rel

transformers = pytest.importorskip("transformers")
TESTS = Path(__file__).parents[1]

# ------------------------------------------------------------------------------------------ fitting

def test_fit_recovers_every_term_of_the_basis():
    from batchlab.trace.profile import _fit

    # b·s widths, b·heads·s² scores, s² mask, s, constant; at b = 1 an expanded fp32 s x s mask is not copied
    truth = Poly(bs=1234, bss=16, s1=40, ss=2, c=777, b1=(0, -4, 0))
    points = {(b, s): truth(b, s) for b in (1, 2, 3) for s in (16, 32, 48)}
    poly, residual = _fit(points)
    assert poly == truth and residual == 0


def test_knots_interpolate_between_and_extrapolate_the_parabola():
    k = Knots(s=(8, 32, 128, 256, 384), at_b1=(100, 100, 1000, 2000, 3000), at_b2=(100, 150, 2000, 4000, 6000),
              at_b3=(100, 200, 3000, 6000, 9000))
    assert k(1, 4) == 100  # below the first knot: the weight-gradient floor
    assert k(1, 80) == 550  # halfway between 32 and 128
    assert k(2, 256) == 4000 and k(4, 256) == 8000  # linear in b from 2 and 3
    assert k(1, 512) == 4000  # the last three knots lie on a line: its continuation


def test_knots_follow_one_quadratic_event_between_and_past_them():
    # attention's b·heads·s² working set: one event a·s² + b·s + c is recovered exactly between knots,
    # where a chord would overestimate and a line through neighbours underestimate
    q = lambda s: 3 * s * s + 5 * s + 7  # noqa: E731
    xs = (16, 64, 128, 256, 384)
    k = Knots(s=xs, at_b1=tuple(q(s) for s in xs), at_b2=tuple(2 * q(s) for s in xs),
              at_b3=tuple(3 * q(s) for s in xs))
    assert k(1, 200) == q(200) and k(2, 320) == 2 * q(320) and k(1, 512) == q(512)
    # a linear event (the loss's logits) overtaken by a quadratic one (attention's) between two knots
    ev = lambda s: max(40_000 * s, 200 * s * s)  # noqa: E731
    xs = (16, 64, 128, 256, 384, 512, 768)
    k = Knots(s=xs, at_b1=tuple(ev(s) for s in xs), at_b2=tuple(ev(s) for s in xs), at_b3=tuple(ev(s) for s in xs))
    assert [k(1, s) for s in (100, 180, 230, 300, 640)] == [ev(s) for s in (100, 180, 230, 300, 640)]


# ------------------------------------------------------------------------------------------ config.json reader

def test_config_json_reader_follows_each_familys_spelling(tmp_path):
    opt, _ = resolve_model(f"hf:{config_dir(tmp_path, 'opt', ffn_dim=256, intermediate_size=None)}")
    assert (opt.ffn, opt.position.value, opt.tied_embeddings, opt.bias) == (256, "learned", True, True)
    falcon, _ = resolve_model(f"hf:{config_dir(tmp_path, 'falcon')}")
    assert falcon.kv_heads == 1  # multi_query defaults on
    bloom, _ = resolve_model(f"hf:{config_dir(tmp_path, 'bloom', n_layer=3, n_head=4, num_hidden_layers=None)}")
    assert (bloom.layers, bloom.attention.value, bloom.position.value) == (3, "eager", "alibi")
    qwen, _ = resolve_model(f"hf:{config_dir(tmp_path, 'qwen2', num_key_value_heads=2)}")
    assert (qwen.bias, qwen.qkv_bias, qwen.kv_heads, qwen.norm.value) == (False, True, 2, "rmsnorm")
    with pytest.raises(ConfigError, match="model"):
        resolve_model(f"hf:{tmp_path / 'missing.json'}")


def test_qwen2_parameter_count_includes_the_qkv_biases(tmp_path):
    cfg = hf_cfg(config_dir(tmp_path, "qwen2", num_key_value_heads=2))
    from batchlab.models import build_workload

    model = build_workload(cfg).model
    assert count(cfg.model).total == sum(p.numel() for p in model.parameters())  # no profile: the formula's own


def test_a_bare_model_type_is_transformers_default_config_of_that_family():
    """hf:mistral: no file; transformers' MistralConfig() (Mistral-7B-v0.1) counted, then built shrunk."""
    import transformers

    from batchlab.models import build_workload

    spec, source = resolve_model("hf:mistral")
    with torch.device("meta"):  # 7.2 B parameters: counted on the meta device, nothing allocated
        full = transformers.AutoModelForCausalLM.from_config(transformers.MistralConfig())
    assert source == "hf:mistral" and count(spec).total == sum(p.numel() for p in full.parameters())
    assert (spec.layers, spec.hidden, spec.kv_heads, spec.sliding_window) == (32, 4096, 8, 4096)
    small, source = resolve_model("hf:mistral", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=512)
    model = build_workload(RunConfig(model=small, model_source=source, seq=16, micro_batch=1)).model
    assert type(model).__name__ == "MistralForCausalLM" and model.config.num_hidden_layers == 2
    assert count(small).total == sum(p.numel() for p in model.parameters())
    with pytest.raises(ConfigError, match="model_type transformers knows"):
        resolve_model("hf:no_such_family")


def test_overrides_are_written_back_under_the_familys_names(tmp_path):
    from batchlab.models import build_workload

    spec, source = resolve_model(f"hf:{config_dir(tmp_path, 'bloom', n_layer=2, n_head=4, num_hidden_layers=None)}",
                                 layers=3)
    model = build_workload(RunConfig(model=spec, model_source=source, seq=32, micro_batch=1)).model
    assert model.config.n_layer == 3 and len(model.transformer.h) == 3
    spec, source = resolve_model(f"hf:{config_dir(tmp_path, 'opt', ffn_dim=256, intermediate_size=None)}",
                                 mlp="swiglu")
    with pytest.raises(ConfigError) as e:  # OPT's MLP is its code's, not a config field
        build_workload(RunConfig(model=spec, model_source=source, seq=32, micro_batch=1))
    assert e.value.field == "mlp"


def test_hf_config_flag_is_the_same_path_as_model_hf(tmp_path):
    from batchlab.cli.common import _config_from_flags

    folder = config_dir(tmp_path, "gpt_neox")
    a = _config_from_flags(hf_config=str(Path(folder) / "config.json"), seq=64)
    b = _config_from_flags(model=f"hf:{Path(folder) / 'config.json'}", seq=64)
    assert a == b and a.model_source.startswith("hf:")


# ------------------------------------------------------------------------------------------ the model's own loss

def test_loss_is_the_models_own_labels_loss(tmp_path):
    from batchlab.models import build_workload

    cfg = hf_cfg(config_dir(tmp_path, "gpt_neox"), seq=16)
    wl = build_workload(cfg)
    tokens, targets = wl.make_batch(torch.Generator().manual_seed(0), 2, 16, torch.device("cpu"))
    targets[0, :3] = -100
    logits = wl.model(input_ids=tokens).logits
    reference = F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1), ignore_index=-100, reduction="sum")
    assert torch.allclose(wl.loss_sum(wl.model, tokens, targets), reference, rtol=1e-5)


# ------------------------------------------------------------------------------------------ trace, measure, formula

def test_a_factory_building_an_hf_model_gets_the_eager_branches(tmp_path, monkeypatch):
    """GQA under transformers: a fake tensor looks like tracing and would keep a packed-sequence mask."""
    (tmp_path / "gqa_factory.py").write_text(
        "import transformers\n"
        "from batchlab.models import synthetic_tokens\n"
        "def make(cfg):\n"
        "    c = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,\n"
        "                                 num_key_value_heads=2, intermediate_size=128, use_cache=False)\n"
        "    m = transformers.AutoModelForCausalLM.from_config(c, attn_implementation='sdpa')\n"
        "    m.blocks = m.model.layers\n"
        "    return m, synthetic_tokens(128, cfg.data)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = RunConfig(model_source="gqa_factory:make", seq=64, micro_batch=2)
    m = run(cfg, FAST)
    assert rel(trace_estimate(cfg).memory.peak_bytes, m.memory.peak_bytes) <= 0.005


# ------------------------------------------------------------------------------------------ non-language models

@pytest.fixture
def vision(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))


@pytest.mark.parametrize("factory", ["cnn", "vit"])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_vision_factories_trace_equals_measure(vision, factory, ac):
    # seq 3072 is beyond the stand-in shape's max_positions: no sequence checks for factory models
    cfg = RunConfig(model_source=f"vision_models:{factory}", seq=3072, micro_batch=4, ac=ac)
    m = run(cfg, MeasureOptions(warmup=1, steps=1, memory=True, timing=True))
    assert m.ok, m.outcome_detail
    trace = trace_estimate(cfg)
    tr = trace.memory
    assert rel(tr.peak_bytes, m.memory.peak_bytes) <= 0.005
    assert rel(tr.activations_bytes, m.memory.activations_bytes) <= 0.005
    # one target per image: throughput counts samples, and every renderer says so
    from batchlab.measure.versus import rows

    assert m.counted is Counted.SAMPLES and trace.counted is Counted.SAMPLES
    assert m.useful_tokens_per_update == cfg.global_batch  # each sample counted once
    assert [r.unit for r in rows(m) if r.figure.startswith("useful")] == ["samples/s"]
    assert cfg.global_batch_text(m.counted).endswith("= 4 samples per update")


def test_an_input_spec_must_be_one_batchlab_knows():
    from batchlab.models.inputs import batch_maker

    images, labels = batch_maker("image:3x8x8:classes=5")(torch.Generator().manual_seed(0), 2, 99, torch.device("cpu"))
    assert images.shape == (2, 3, 8, 8) and labels.shape == (2,) and int(labels.max()) < 5
    with pytest.raises(ConfigError, match="input spec"):
        batch_maker("audio:16000")

@pytest.mark.slow

def test_vision_compare_and_fit_run(vision, tmp_path, monkeypatch):
    """An image factory through compare and fit.  Each side and fit's verification are measured in this process
    (a factory run in a fresh process is tests/models/test_model_sources.py's isolated cases; compare's subprocesses
    its smoke test, fit's tests/advise/test_search.py)."""
    from dataclasses import replace

    from typer.testing import CliRunner

    from batchlab import advise
    from batchlab.cli import app
    from batchlab.experiment import protocol

    monkeypatch.setattr(protocol, "default_measure", lambda cfg, options: run(cfg, replace(options, isolate=False)))
    in_process = MeasureOptions(warmup=1, steps=1, timing=False)  # isolated_measure's, in this process
    monkeypatch.setattr(advise, "isolated_measure", lambda capacity, timeout=None: lambda cfg:
                        advise.trial_from_measurement(cfg, run(cfg, in_process), capacity))
    model = ["--model", "vision_models:cnn", "--seq", "1", "--global-batch", "8"]
    r = CliRunner().invoke(app, ["compare", *model, "--change", "micro_batch=2:4", "--steps", "1", "--warmup", "1",
                                 "--no-verify", "--notebook", str(tmp_path / "nb.sqlite"), "--json"])
    assert r.exit_code == 0, r.output
    record = json.loads(r.stdout)
    # twice the images per micro-batch: twice the activations live at once (the weights and Adam state stay)
    assert record["metrics"]["peak_memory"]["observed"] == "up", record["metrics"]["peak_memory"]
    assert record["metrics"]["peak_memory"]["formula"]["ratio"] is None  # a factory's own code: no formula guess
    assert record["metrics"]["tokens_per_second"]["unit"] == "samples/s"  # the key is the contract; the unit says
    assert record["change"]["global_batch_text"]["b"].endswith("= 8 samples per update")
    # fit traces a factory's own code (the formula knows only its stand-in GPT shape): under a budget that only
    # a checkpointed micro-batch of 2 fits, the traced peak is the real run's
    # fit at global batch 4: micro-batch 1, 2 and 4 under each of the 4 policies, each candidate traced
    r = CliRunner().invoke(app, ["fit", *model[:-1], "4", "--memory-budget", "1MiB", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["predictor"] == "trace" and d["recommended_by_formula"]["provenance"] == "trace"
    assert d["recommended_by_formula"]["counted"] == "samples"
    rec, measured = d["recommended_by_formula"], d["verification"]
    assert (rec["config"]["micro_batch"], measured["micro_batch"]) == (2, 2) and measured["outcome"] == "ok"
    assert abs(rec["peak_bytes"] / measured["peak_bytes"] - 1) < 0.01, (rec["peak_bytes"], measured["peak_bytes"])
