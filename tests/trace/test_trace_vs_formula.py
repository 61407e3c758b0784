"""A preset's trace runs the code its formula describes (``--impl``): the trace and the formula agree on
activations, and the formula's layer terms agree with a real run of that code under autocast.  The full list of
presets at full depth and their own sequence lengths: benchmarks/trace_vs_formula.py
(docs/accuracy/trace_vs_formula.md); here a representative subset, 2 layers each."""
from __future__ import annotations

import pytest

from batchlab.config import RunConfig, preset
from batchlab.formula import estimate as formula
from batchlab.measure.harness import Trainer
from batchlab.measure.memory import track_update
from batchlab.trace import estimate as trace
from shapes import hf_llama

pytest.importorskip("transformers")


def rel(a: float, b: float) -> float:
    return abs(a - b) / b


@pytest.mark.parametrize("name, seq", [("gpt2", 1024), ("llama-2-7b", 1024), ("llama-3-8b", 512), ("tiny", 256)])
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_a_presets_trace_agrees_with_its_formula_on_activations(name, seq, precision):
    cfg = RunConfig(model=preset(name, layers=2), seq=seq, micro_batch=1, precision=precision, device="cpu")
    traced = trace(cfg)
    assert rel(formula(cfg).memory.activations_bytes, traced.memory.activations_bytes) <= 0.05
    code = {"gpt2": "GPT2LMHeadModel", "tiny": "built-in GPT"}.get(name, "LlamaForCausalLM")
    assert code in traced.traced


def test_the_issue_command_traces_transformers_llama_and_agrees_on_a_cuda_device():
    # llama-2-7b at seq 4096 on h100-sxm (4 of its 32 layers): the trace once ran with transformers' traced-mask
    # branch and the formula missed autocast's per-projection casts, 29.42 vs 25.41 GiB at full depth
    cfg = RunConfig(model=preset("llama-2-7b", layers=4), seq=4096, micro_batch=1, precision="bf16-mixed",
                    device="h100-sxm")
    traced = trace(cfg)
    assert "LlamaForCausalLM" in traced.traced
    assert rel(formula(cfg).memory.activations_bytes, traced.memory.activations_bytes) <= 0.01


def test_an_implementation_not_installed_traces_the_nearest_and_says_how_far_apart_they_are():
    cfg = RunConfig(model=preset("llama-2-7b", layers=2, impl="torchtitan"), seq=512, micro_batch=1,
                    precision="bf16-mixed")
    traced = trace(cfg)
    assert "LlamaForCausalLM" in traced.traced and "torchtitan's Llama is not installed" in traced.traced
    note = next(n for n in traced.notes if "runs in its place" in n)
    assert "per layer the formula counts" in note and "%" in note


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_the_formula_counts_each_projections_own_autocast_copy_of_the_norm_output(precision):
    # transformers' Llama reads each norm's fp32 output with separate q, k, v (and gate, up) projections: under
    # autocast each casts its own 16-bit copy and keeps it (the cast cache holds only the weights' copies);
    # counting one copy per norm put the formula 9.9% under this real run
    cfg = hf_llama(precision=precision)
    real = track_update(Trainer(cfg, "cpu"))
    assert rel(formula(cfg).memory.activations_bytes, real.activations_bytes) <= 0.01
