"""`batchlab fit` end to end: the llama target, snippets that load back, bad input, after-OOM advice."""
from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from batchlab.advise import load_config_toml
from batchlab.cli import app, main
from batchlab.config import RunConfig, preset
from batchlab.formula import estimate



def llama(zero: int = 1, global_batch: int = 512) -> list[str]:
    return ["--model", "llama-2-7b", "--seq", "4096", "--global-batch", str(global_batch), "--dp", "8", "--device", "h100-sxm",
            "--precision", "bf16-mixed", "--zero", str(zero)]


LLAMA = llama()
TINY = ["--seq", "64", "--layers", "2", "--global-batch", "8"]


def invoke(*args: str):
    return CliRunner().invoke(app, ["fit", *args])


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Through batchlab.cli.main, which turns a ConfigError raised while building the config into exit 2."""
    monkeypatch.setattr(sys, "argv", ["batchlab", "fit", *args])
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_llama_target_json(tmp_path):
    r = invoke(*LLAMA, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    final = d["final"]
    assert final["micro_batch"] * final["accum"] * final["dp"] == 512 == d["global_batch"]
    assert d["verification"] is None  # a catalogue GPU is not local: formula only
    path = tmp_path / "fit.toml"
    path.write_text(d["snippets"]["batchlab_toml"])
    cfg = load_config_toml(path)
    assert cfg.to_dict() == final
    assert estimate(cfg).memory.peak_bytes <= 0.9 * 80e9  # fits with the margin, by the formula
    s = d["snippets"]
    hf, ds, pl = s["huggingface"]["TrainingArguments"], s["deepspeed"], s["lightning"]
    assert hf["per_device_train_batch_size"] * hf["gradient_accumulation_steps"] * 8 == 512
    assert hf["gradient_checkpointing"] == (cfg.ac.mode.value != "none")
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 8 == ds["train_batch_size"] == 512
    assert ds["zero_optimization"]["stage"] == 1 and ds["bf16"]["enabled"]
    assert pl["Trainer"]["accumulate_grad_batches"] == cfg.accum and pl["DataLoader"]["batch_size"] == cfg.micro_batch


def test_text_names_provenance_global_batch_and_assumptions():
    r = invoke(*LLAMA)
    assert r.exit_code == 0, r.output
    assert "global batch = micro-batch x accum x DP" in r.stdout and "per_device_train_batch_size" not in r.stdout
    r = invoke(*LLAMA, "--verbose")  # the assumptions and the settings for other stacks
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    for words in ("global batch = micro-batch x accum x DP", "[formula]", "achievable fraction",
                  "hidden behind backward", "safety margin 10%", "per_device_train_batch_size",
                  "accumulate_grad_batches", "train_micro_batch_size_per_gpu", "[config]"):
        assert words in text, words


def test_global_tokens_is_the_same_target_as_global_batch():
    a = json.loads(invoke(*LLAMA, "--json").stdout)
    tokens_args = [x for x in LLAMA]
    i = tokens_args.index("--global-batch")
    tokens_args[i:i + 2] = ["--global-tokens", str(512 * 4096)]
    b = json.loads(invoke(*tokens_args, "--json").stdout)
    assert a["final"] == b["final"]


def test_model_toml_table_round_trips(tmp_path):
    from batchlab.advise import config_toml

    cfg = RunConfig(model=preset("tiny", layers=2, dropout=0.0), seq=64, micro_batch=2, accum=3,
                    memory_budget=5 * 2**20, ac="every:2").replace(achievable_fraction=0.5)
    path = tmp_path / "c.toml"
    path.write_text(config_toml(cfg))
    assert load_config_toml(path) == cfg


@pytest.mark.parametrize("args, field", [
    (["--global-batch", "500"], "global_batch"),  # not divisible by DP 8
    (["--global-tokens", "1000"], "global_tokens"),  # not a multiple of seq
])
def test_bad_target_exits_2_with_one_line(monkeypatch, capsys, args, field):
    base = ["--model", "llama-2-7b", "--seq", "4096", "--dp", "8", "--device", "h100-sxm", "--json"]
    code, out, err = run_main(monkeypatch, capsys, *base, *args)
    assert code == 2 and out == ""
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}:")


def test_budget_below_the_parameters_exits_2():
    r = invoke(*TINY, "--memory-budget", "1MiB", "--no-verify")
    assert r.exit_code == 2
    assert r.stderr.strip().startswith("error: memory_budget:") and "parameters alone" in r.stderr


def test_nothing_fits_exits_1_and_says_what_would():
    # ZeRO-0: 108 GB of model states per rank, whatever the batch; global batch 64 (8 per rank, 4 micro-batches)
    # keeps the search for what would fit to ~900 estimates (512: ~1,900, twice the time, the same answer)
    lean = llama(zero=0, global_batch=64)
    r = invoke(*lean, "--json")
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)
    assert d["final"] is None and d["what_would_fit"]
    changes = " ".join(x["change"] for x in d["what_would_fit"])
    assert "ZeRO" in changes and "devices" in changes
    text = invoke(*lean)
    assert text.exit_code == 1 and "would fit" in text.stdout


def test_allow_zero_finds_a_stage_the_user_did_not_set():
    r = invoke(*llama(zero=0), "--allow-zero", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["final"]["zero"] > 0


def test_after_oom_json_lists_changes_with_formula_figures():
    r = invoke("--seq", "128", "--micro-batch", "32", "--accum", "2", "--memory-budget", "64MiB", "--after-oom",
               "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["global_batch"] == 64
    first = d["advice"][0]
    assert first["change"].startswith("halve the micro-batch")
    assert (first["config"]["micro_batch"], first["config"]["accum"]) == (16, 4)
    cfg = RunConfig(seq=128, micro_batch=16, accum=4, memory_budget=64 * 2**20)
    assert first["figures"]["peak_bytes"] == estimate(cfg).memory.peak_bytes
    assert all(a["changes"] for a in d["advice"])
    text = invoke("--seq", "128", "--micro-batch", "32", "--accum", "2", "--memory-budget", "64MiB", "--after-oom")
    assert "same:" in text.stdout and "changes:" in text.stdout and "global batch = " in text.stdout


@pytest.mark.slow
def test_cpu_search_by_measurement_finds_the_largest_micro_batch():
    """Verification is on by default for the local CPU; --search finds the limit under --memory-budget."""
    budget = 20 * 2**20
    r = invoke(*TINY, "--memory-budget", "20MiB", "--search", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    trials, search = d["search"]["trials"], d["search"]
    assert d["verification"] == trials[0]
    assert len(trials) <= search["budget"] == 5  # ceil(log2 8) + 2
    limit = search["limit"]
    at_limit = next(t for t in trials if t["micro_batch"] == limit)
    assert at_limit["fits"] and at_limit["peak_bytes"] <= budget
    above = [t for t in trials if t["micro_batch"] > limit]
    bigger = [m for m in (1, 2, 4, 8) if m > limit]
    if bigger:  # the next divisor was measured and ran out of the budget
        nxt = next(t for t in above if t["micro_batch"] == bigger[0])
        assert not nxt["fits"] and nxt["outcome"] == "oom (budget)"
    final = d["final"]
    expected = limit if at_limit["peak_bytes"] <= 0.9 * budget else max(m for m in (1, 2, 4, 8) if m < limit)
    assert final["micro_batch"] == expected and final["micro_batch"] * final["accum"] == 8
    assert d["limits"]["measured_limit"] == limit
    assert d["limits"]["predicted_limit"] in (1, 2, 4, 8)


def test_global_tokens_and_global_batch_together_are_refused(capsys):
    from batchlab.cli import main
    import sys as _sys

    argv = _sys.argv
    _sys.argv = ["batchlab", "fit", "--global-tokens", "1024", "--global-batch", "8", "--no-verify"]
    try:
        with pytest.raises(SystemExit) as e:
            main()
    finally:
        _sys.argv = argv
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().startswith("error: global_tokens:")


# -- knobs typed explicitly are held (issue 11, item 16) --------------------------------------------------------

SMALL = ["--seq", "64", "--layers", "2", "--global-batch", "16", "--memory-budget", "64MiB", "--no-verify", "--json"]


def test_typed_ac_is_held_even_at_its_default_value():
    """`--ac none` is the default value, typed: held.  Detected by click's parameter source, not by value."""
    held = json.loads(invoke(*SMALL, "--ac", "none").stdout)
    assert held["held"] == ["ac"] and "ac" not in held["searched"]
    assert held["final"]["ac"] == "none"
    assert {a["config"]["ac"] for a in held["alternatives"]} == {"none"}
    free = json.loads(invoke(*SMALL).stdout)
    assert free["held"] == [] and "ac" in free["searched"]
    assert len({a["config"]["ac"] for a in free["alternatives"]}) > 1  # policies searched when not typed


def test_held_knobs_are_named_in_the_header():
    r = invoke(*SMALL[:-1], "--ac", "none", "--micro-batch", "4", "--precision", "fp32")
    assert r.exit_code == 0, r.output
    line = next(x for x in r.stdout.splitlines() if x.startswith("held as given"))
    text = " ".join(r.stdout.split())
    assert "held as given: --micro-batch 4 (accum 4), --ac none, --precision fp32; searched: nothing" in text, line


def test_held_micro_batch_is_the_one_chosen():
    d = json.loads(invoke(*SMALL, "--micro-batch", "2").stdout)
    assert d["held"] == ["micro_batch"]
    assert {a["config"]["micro_batch"] for a in d["alternatives"]} == {2}
    assert (d["final"]["micro_batch"], d["final"]["accum"]) == (2, 8)


def test_held_policy_that_cannot_fit_says_what_releasing_it_would_give():
    """20 MiB: some checkpointing policy fits, no micro-batch without one does (formula)."""
    args = ["--seq", "128", "--global-batch", "8", "--memory-budget", "20MiB", "--no-verify", "--json"]
    free = json.loads(invoke(*args).stdout)
    assert free["final"] is not None and free["final"]["ac"] != "none"
    r = invoke(*args, "--ac", "none")
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)
    assert d["final"] is None
    first = d["what_would_fit"][0]
    assert first["change"] == "without holding --ac none" and first["config"]["ac"] == free["final"]["ac"]


def test_allow_zero_searches_from_the_typed_stage():
    d = json.loads(invoke(*llama(zero=1), "--allow-zero", "--json").stdout)
    assert "zero" not in d["held"] and "zero" in d["searched"]
    assert {a["config"]["zero"] for a in d["alternatives"]} <= {1, 2, 3}
    held = json.loads(invoke(*llama(zero=1), "--json").stdout)
    assert "zero" in held["held"] and {a["config"]["zero"] for a in held["alternatives"]} == {1}



@pytest.mark.parametrize("engine, stage", [("megatron", 0), ("megatron-distopt", 1), ("deepspeed-zero2", 2),
                                           ("ddp", 0)])
def test_a_typed_engine_holds_its_stage_under_allow_zero(engine, stage):
    # Megatron's DDP is ZeRO-0 and its distributed optimizer ZeRO-1 (Megatron-LM README); DeepSpeed's stage is its
    # name: --allow-zero may not move them to another stage
    r = invoke(*TINY, "--dp", "2", "--sharding", engine, "--allow-zero", "--no-verify", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert "zero" in d["held"] and "zero" not in d["searched"]
    assert {(a["config"]["zero"], a["config"]["sharding"]) for a in d["alternatives"]} == {
        (stage, None if engine == "ddp" else engine)}
    assert f"ignored: --allow-zero: --sharding {engine} runs ZeRO-{stage} only" in r.stderr

# -- after an OOM, model states alone over the device (issue 11, item 7) ------------------------------------------

LLAMA_A100 = ["--model", "llama-2-7b", "--device", "a100-80gb", "--after-oom"]
LLAMA_PARAMS = 6_738_415_616  # Llama-2-7b (Touvron et al. 2023; the HF checkpoint's parameter count)


def test_after_oom_says_first_that_the_model_states_exceed_the_device():
    r = invoke(*LLAMA_A100, "--json")
    assert r.exit_code == 1, r.output  # no listed change fits: documented exit 1
    d = json.loads(r.stdout)
    s = d["model_states"]
    # fp32 AdamW: 4 (weights) + 4 (gradients) + 8 (m, v) bytes per parameter
    assert s["states_bytes"] == pytest.approx(16 * LLAMA_PARAMS, rel=1e-3)
    assert s["states_bytes"] > s["usable_bytes"] and not d["any_change_fits"]
    assert not any(a["fits"] for a in d["advice"])
    text = invoke(*LLAMA_A100)
    assert text.exit_code == 1
    out = " ".join(text.stdout.split())
    order = [out.index(w) for w in ("the model states alone do not fit: 100.4", "what does help", "ZeRO-3",
                                    "8-bit Adam", "CPU offload", "nothing fits on this device")]
    assert order == sorted(order)
    assert "outside what batchlab predicts or measures" in out


def test_after_oom_device_counts_are_the_fewest_that_fit():
    """By hand, fp32 AdamW bytes per parameter per rank over N ranks: ZeRO-1 4 + 4 + 8/N, ZeRO-2 4 + 12/N,
    ZeRO-3 16/N.  76.5 GB usable (90% of the 79.15 GiB the card reports): ZeRO-1 needs N = 4
    (N = 2: 12 B x 6.74e9 = 80.9 GB); ZeRO-2 too, because FSDP2 keeps its freed gradient shards' 4/N B
    reserved in the reduce-scatter stream's pool through the next forward (foreach_reduce), where the unsharded
    weights are held: N = 2 gives 4 + 6 + 2 = 12 B again; ZeRO-3 N = 2 (8 B per parameter, its weights resharded
    after each block's forward); N divides the global batch 8, which stays."""
    d = json.loads(invoke(*LLAMA_A100, "--json").stdout)
    usable = d["usable_bytes"]
    by_stage = {o["zero"]: o for o in d["model_states"]["sharding"]}
    expected = {1: (4, 4 + 4 + 8 / 4), 2: (4, 4 + 12 / 4), 3: (2, 16 / 2)}
    assert {z: o["devices"] for z, o in by_stage.items()} == {z: n for z, (n, _) in expected.items()}
    for z, (n, per_param) in expected.items():
        o = by_stage[z]
        assert o["states_bytes"] == pytest.approx(per_param * LLAMA_PARAMS, rel=1e-3)
        assert o["figures"]["peak_bytes"] <= usable
        c = o["figures"]["config"]
        assert c["micro_batch"] * c["accum"] * c["dp"] == 8
    assert (4 + 4 + 8 / 2) * LLAMA_PARAMS > usable  # why ZeRO-1 over 2 is not enough
    eight_bit = next(o for o in d["model_states"]["optimizer"] if o["bytes_per_param"] == 2)
    assert eight_bit["fits"]  # 4 + 4 + 2 bytes per parameter = 67.4 GB <= 76.5 GB usable


def test_after_oom_exit_0_when_a_change_fits():
    r = invoke("--seq", "128", "--micro-batch", "32", "--accum", "2", "--memory-budget", "64MiB", "--after-oom")
    assert r.exit_code == 0 and "model states alone" not in r.stdout
