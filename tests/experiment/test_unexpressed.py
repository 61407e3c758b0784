"""A change the measured run cannot express (issue 41): compare refuses it before anything runs (one line naming the
field, exit 2, no notebook row) unless --formula-only; beside an expressed change it is a warning; a measurement
says what it ran past."""
from __future__ import annotations

import sqlite3

import pytest
from typer.testing import CliRunner

from batchlab.cli import app
from batchlab.config import ConfigError, RunConfig, preset
from batchlab.experiment.change import parse_change
from batchlab.experiment.compare import make_plan
from batchlab.measure import unexpressed

SP = RunConfig(seq=32, micro_batch=2, tp=2, sequence_parallel=True)


def _plan(text: str, base: RunConfig = SP, **kw):
    return make_plan(base, [parse_change(t, base) for t in text.split(";")], **kw)


@pytest.mark.parametrize("text, base, field", [
    ("tp_overlap=none:async", SP, "tp_overlap"),  # the ranks run DTensor's plain collectives
    ("achievable_fraction=0.3:0.6", RunConfig(), "achievable_fraction"),  # the formula's assumptions
    ("zero_grad_set_to_none=true:false", RunConfig(), "zero_grad_set_to_none"),
    ("deepspeed=hf-auto:reduce_bucket_size=1e6", RunConfig(sharding="deepspeed-zero2", zero=2), "deepspeed"),
    ("device=h100-sxm:a100-sxm4-80gb", RunConfig(), "device"),  # one local CUDA device measures both
    # fields the stand-in resets: torchtitan's Llama runs as transformers' (no KV cache either way)
    ("use_cache=true:false", RunConfig(model=preset("llama-2-7b", impl="torchtitan", layers=2, hidden=64,
                                                            heads=2, vocab=128), seq=16), "use_cache"),
])
def test_compare_refuses_two_sides_that_are_one_measured_run(text, base, field):
    with pytest.raises(ConfigError) as e:
        _plan(text, base)
    assert e.value.field == field and "--formula-only" in e.value.message
    assert _plan(text, base, formula_only=True).formula_only  # the formula's derivation is still there to ask for


def test_a_torch_device_measures_both_catalogue_cards_on_one_device():
    with pytest.raises(ConfigError) as e:
        _plan("device=cpu:h100-sxm", RunConfig(), torch_device="cpu")
    assert e.value.field == "device"
    assert _plan("device=cpu:h100-sxm", RunConfig()).sides.b.device == "h100-sxm"  # cpu vs cuda: two runs


def test_an_unexpressed_change_beside_an_expressed_one_is_said():
    p = _plan("tp_overlap=none:async;micro_batch=2:1", allow_confounded=True)
    assert any(w.startswith("tp_overlap changes only the formula's side") for w in p.sides.warnings)
    p = _plan("device=h100-sxm:a100-sxm4-80gb;micro_batch=1:2", RunConfig(), allow_confounded=True)
    assert any(w.startswith("device changes only the formula's side") for w in p.sides.warnings)
    assert _plan("micro_batch=2:1").sides.warnings == ()


def test_compare_cli_refuses_tp_overlap_on_cpu_with_one_line_and_no_row(tmp_path):
    book = tmp_path / "nb.sqlite"
    res = CliRunner().invoke(app, ["compare", "--tp", "2", "--sequence-parallel", "--seq", "32",
                                   "--change", "tp_overlap=none:async", "--predict", "none", "--notebook", str(book)])
    assert res.exit_code == 2
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: tp_overlap:") and "Traceback" not in res.output
    assert not book.exists() or not sqlite3.connect(book).execute("select count(*) from experiments").fetchone()[0]


def test_measurement_warns_of_each_field_it_ran_past():
    assert unexpressed.warnings(RunConfig()) == []
    cfg = SP.replace(tp_overlap="async", comm_overlap=0.5)
    said = unexpressed.warnings(cfg)
    assert [w.split(":")[1].strip() for w in said] == ["tp_overlap", "comm_overlap"]


def test_an_implementation_not_installed_here_is_its_stand_in_when_measured():
    # Megatron's and nanoGPT's layers run as batchlab's GPT: two names of one measured run
    with pytest.raises(ConfigError) as e:
        _plan("impl=batchlab:megatron", RunConfig())
    assert e.value.field == "impl" and "batchlab's GPT runs in its place" in e.value.message
    assert _plan("impl=batchlab:hf", RunConfig()).sides.b.model.impl.value == "hf"  # transformers' GPT-2 runs
    _plan("impl=batchlab:megatron", RunConfig(), formula_only=True)


def test_a_stand_in_beside_other_measured_code_is_no_formula_only_change():
    # megatron runs as batchlab's GPT, hf as transformers' GPT-2: the measured code changes, so no "formula only"
    gpt = RunConfig()
    assert "impl" in unexpressed.reasons(gpt, gpt.replace(impl="megatron"))
    assert "impl" not in unexpressed.reasons(gpt.replace(impl="hf"), gpt.replace(impl="megatron"))
