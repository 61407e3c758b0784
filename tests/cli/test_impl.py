"""--impl: whose code a preset's layer terms count, chosen on the command line and said by estimate."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchlab.cli import app
from batchlab.cli.common import config_from_command
from batchlab.config import Implementation

runner = CliRunner()
MPT = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "mpt.toml"
# torchtitan docs/performance.md @ 613bfd0c: Llama 2 13B, 64 A100 80GB, FSDP, local batch 2, seq 4096 (its
# train_configs/llama_13b.toml), no activation checkpointing: '13B | 2 | no | 2162 | 61.1%' -- it ran
LLAMA13B = ["--model", "llama-2-13b", "--seq", "4096", "--micro-batch", "2", "--dp", "64", "--zero", "3",
            "--precision", "bf16-fsdp", "--ac", "none", "--device", "a100-80gb"]


def run(*args):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.mark.parametrize("model, impl", [("llama-2-13b", "hf"), ("gpt2", "hf"), ("tiny", "batchlab"),
                                         ("hf:llama", "hf")])
def test_each_preset_has_a_default_implementation(model, impl):
    assert config_from_command(["estimate", "--model", model]).model.impl is Implementation(impl)


def test_impl_is_typed_like_any_other_option():
    cfg = config_from_command(["estimate", *LLAMA13B, "--impl", "torchtitan"])
    assert cfg.model.impl is Implementation.TORCHTITAN and cfg.model_source == "builtin" and cfg.dp == 64


@pytest.mark.parametrize("args, says", [(["--model", "gpt2", "--impl", "torchtitan"], "SwiGLU"),
                                        (["--model", "llama-2-7b", "--impl", "nanogpt"], "GELU"),
                                        (["--model", "hf:llama", "--impl", "torchtitan"], "transformers"),
                                        (["--model", "gpt2", "--impl", "colossal"],
                                         "hf, torchtitan, nanogpt, batchlab, megatron")])
def test_an_implementation_that_does_not_fit_the_model_is_a_one_line_error(args, says):
    r = run("estimate", *args)
    assert r.exit_code == 2 and "impl" in r.stderr and says in r.stderr and "Traceback" not in r.output


def test_estimate_says_whose_code_its_layer_terms_describe():
    r = run("estimate", *LLAMA13B, "--impl", "torchtitan")
    assert r.exit_code == 0, r.output
    assert "Layer terms: torchtitan's Llama (models/llama3) (--impl torchtitan)" in r.stdout
    r = run("estimate", "--model", "gpt2")
    assert "Layer terms: transformers' GPT2LMHeadModel (--impl hf)" in r.stdout


def test_the_published_llama_2_13b_run_fits_typed_as_torchtitan():
    """The issue's command, with the implementation that published the run: it ran, so it must fit the card."""
    r = run("estimate", *LLAMA13B, "--impl", "torchtitan", "--json")
    assert r.exit_code == 0, r.output
    mem = json.loads(r.stdout)["memory"]
    assert mem["fits"] is True and mem["reserved_bytes"] < mem["capacity_bytes"]


def test_a_config_files_derived_widths_follow_the_flags_that_change_them():
    """A [config.model] table without kv_heads / ffn gets them derived (heads, 4h); --heads and --hidden typed on
    top must re-derive them, not keep the file's (an accidental 2:1 GQA and a 4 x 2048 MLP at hidden 4096)."""
    cfg = config_from_command(["estimate", "--config", str(MPT), "--layers", "32",
                               "--hidden", "4096", "--heads", "32"])
    assert (cfg.model.heads, cfg.model.kv_heads, cfg.model.ffn) == (32, 32, 4 * 4096)
    gqa = config_from_command(["estimate", "--model", "llama-2-70b", "--heads", "32"])
    assert gqa.model.kv_heads == 8  # a width set apart from the default stays


def test_a_preset_that_does_not_fit_names_the_implementation_under_which_it_fits():
    """The default (transformers' Llama) keeps more per layer than torchtitan's: the card is too small for it, and
    estimate says which --impl the run fits under, with that implementation's own reserved figure."""
    default, titan = run("estimate", *LLAMA13B), run("estimate", *LLAMA13B, "--impl", "torchtitan")
    assert default.exit_code == titan.exit_code == 0, default.output + titan.output
    assert "OUT OF MEMORY with --impl hf:" in default.stdout  # the verdict names whose code it is on
    hint = next(line for line in default.stdout.splitlines() if line.startswith("fits with --impl"))
    titan_reserved = next(line for line in titan.stdout.splitlines() if line.startswith("fits: reserved"))
    assert hint.startswith(f"fits with --impl torchtitan ({titan_reserved.split()[2]} GiB reserved)"), hint
    assert hint.endswith("torchtitan's Llama keeps less per layer")
    assert "fits: reserved" in titan.stdout and "fits with --impl" not in titan.stdout


def test_json_carries_the_alternatives():
    d = json.loads(run("estimate", *LLAMA13B, "--json").stdout)
    titan = json.loads(run("estimate", *LLAMA13B, "--impl", "torchtitan", "--json").stdout)
    assert d["memory"]["fits"] is False and titan["alternatives"] == []
    assert d["alternatives"] == [{"impl": "torchtitan", "reserved_bytes": titan["memory"]["reserved_bytes"],
                                  "why": "torchtitan's Llama keeps less per layer"}]


@pytest.mark.parametrize("args", [
    ("--model", "llama-2-13b", "--seq", "4096", "--micro-batch", "8", "--dp", "64", "--zero", "3",
     "--precision", "bf16-fsdp", "--ac", "none", "--device", "a100-80gb"),  # no implementation holds it
    ("--model", "hf:llama", "--layers", "40", "--hidden", "5120", "--heads", "40", "--ffn", "13824",
     "--vocab", "32000", "--seq", "4096", "--micro-batch", "4", "--dp", "64", "--zero", "3",
     "--precision", "bf16-fsdp", "--ac", "none", "--device", "a100-80gb"),  # transformers' code, not a preset
])
def test_no_alternative_is_named_where_none_fits_or_the_model_is_no_preset(args):
    r = run("estimate", *args, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["memory"]["fits"] is False and d["alternatives"] == []
