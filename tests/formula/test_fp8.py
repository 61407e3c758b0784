"""--fp8 (config/fp8.py, formula/fp8.py) against hand counts from cited figures: the H100's FP8 GEMM against its
bf16 one at the datasheet peaks (989.4 and 1978.9 TF dense, NVIDIA's H100 SXM table), what a Float8Linear saves
(torchao: the bf16 input; Transformer Engine: its fp8 cast), TE's cached fp8 weights, FSDP2's fp8 all-gather, and
the refusals (one line, exit 2).  Formula only: no FP8 tensor cores exist on the machines these tests run on."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from batchlab.cli import app
from batchlab.config import RunConfig, preset
from batchlab.formula import estimate
from batchlab.formula.activation_plan import activation_plan
from batchlab.formula.oplist import update_ops
from batchlab.formula.sharding import traffic
from batchlab.formula.timing import costs_for

# Llama 2 7B's shape on 2 layers: h 4096, ffn 11008, 32 heads (no GQA), vocab 32000
LLAMA = preset("llama-2-7b", layers=2)
H, FFN, V, SEQ = 4096, 11008, 32000, 1024


def cfg(**kw) -> RunConfig:
    base = dict(model=LLAMA, seq=SEQ, micro_batch=1, precision="bf16", device="h100-sxm")
    return RunConfig(**{**base, **kw})


def _gemm_seconds(c: RunConfig, name: str, flops: int) -> float:
    ops = update_ops(c)
    costs = costs_for(c, None, ops)
    op = next(o for o in ops if o.name == name and o.flops == flops and o.phase.value == "forward")
    return costs.work_seconds(op)


def test_an_h100_fp8_gemm_runs_at_the_fp8_peak_with_the_bf16_gemms_fraction():
    # the MLP's up projection on 64 x 1024 tokens: 2 x 65536 x 4096 x 11008 = 5.9 TFLOP in one forward GEMM, so
    # a call's few microseconds of start-up are under 1% of it
    flops = 2 * 64 * SEQ * H * FFN
    bf16 = _gemm_seconds(cfg(micro_batch=64), "mm", flops)
    fp8 = _gemm_seconds(cfg(micro_batch=64, fp8="tensorwise"), "_scaled_mm", flops)
    # t = FLOPs / (peak x fraction), the fraction the same: t_bf16 x 989.4 TF = t_fp8 x 1978.9 TF
    assert fp8 * 1978.9e12 == pytest.approx(bf16 * 989.4e12, rel=1e-2)
    assert fp8 < bf16 / 1.95


def test_the_lm_head_and_attention_stay_16_bit():
    ops = update_ops(cfg(fp8="te"))
    names = {o.name for o in ops}
    head = 2 * SEQ * H * V  # the LM head's GEMM: torchtitan filters "output", Megatron's is no TE module
    assert any(o.name == "mm" and o.flops == head for o in ops)
    assert not any(o.name == "_scaled_mm" and o.flops == head for o in ops)
    assert "_scaled_dot_product_flash_attention" in names and "_scaled_mm" in names
    # 5 block linears (the fused q/k/v, o, gate, up, down) x 3 GEMMs (forward, grad-input, grad-weight) x 2 layers
    assert sum(o.count for o in ops if o.name == "_scaled_mm") == 5 * 3 * 2


def test_torchao_saves_the_bf16_input_te_its_fp8_cast():
    # torchao (float8_linear.py: ctx.save_for_backward(input_hp, weight_hp_t)) keeps what nn.Linear keeps
    none, tensorwise, te = (activation_plan(cfg(fp8=f)) for f in ("none", "tensorwise", "te"))
    assert tensorwise.per_layer_kept == none.per_layer_kept
    # TE keeps each distinct linear input in 1 byte instead of 2: the attention input (q, k, v read it), the
    # output projection's input, the MLP input (gate and up read it) and the down projection's input:
    # 1024 tokens x (4096 + 4096 + 4096 + 11008) x 1 byte
    assert none.per_layer_kept[0] - te.per_layer_kept[0] == SEQ * (3 * H + FFN) == 23_855_104


def test_te_keeps_its_fp8_weights_and_their_transposes():
    parts = estimate(cfg(fp8="te")).memory.at_peak
    # per layer: q, k, v, o 4 x 4096^2 and gate, up, down 3 x 4096 x 11008 weights; 2 bytes each (fp8 + transpose)
    assert parts["fp8 weights"] == 2 * 2 * (4 * H * H + 3 * H * FFN) == 809_500_672
    assert "fp8 weights" not in estimate(cfg(fp8="tensorwise")).memory.at_peak


def test_fsdp_fp8_all_gather_halves_the_blocks_gathered_bytes():
    kw = dict(dp=2, zero=3, precision="bf16-fsdp")
    bf16 = traffic(cfg(**kw)).per_micro_batch[0]["all_gather"]
    fp8 = traffic(cfg(fp8="tensorwise-allgather", **kw)).per_micro_batch[0]["all_gather"]
    root = 2 * V * H + H  # embedding, LM head, final norm: gathered in bf16
    block = 4 * H * H + 3 * H * FFN + 2 * H  # the linears and the two norms
    # ZeRO-3 gathers every unit twice (forward, and again in backward)
    assert bf16 == 2 * (2 * root + 2 * 2 * block)
    assert fp8 == 2 * (2 * root + 1 * 2 * block)


runner = CliRunner()
BASE = ["--model", "tiny", "--seq", "64", "--precision", "bf16-mixed"]


@pytest.mark.parametrize("argv, words", [
    (["estimate", *BASE, "--device", "a100-80gb", "--fp8", "te"], "FP8 tensor cores"),
    (["estimate", *BASE, "--device", "h100-sxm", "--fp8", "fp4"], "not one of"),
    (["estimate", "--model", "tiny", "--seq", "64", "--device", "h100-sxm", "--fp8", "rowwise"], "16-bit"),
    (["estimate", *BASE, "--device", "h100-sxm", "--fp8", "tensorwise-allgather"], "FSDP2"),
    (["measure", *BASE, "--device", "h100-sxm", "--fp8", "te"], "formula only"),
])
def test_bad_fp8_input_is_one_line_and_exit_2(argv, words):
    r = runner.invoke(app, argv)
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: fp8:"), r.output
    assert words in lines[0]


def test_autocast_caches_no_copy_of_a_float8_linears_weight():
    # under bf16-mixed autocast keeps a bf16 copy of every F.linear weight through forward; Float8Linear casts its
    # own weight to fp8 and calls no F.linear: 2 bytes x (4 x 4096^2 + 3 x 4096 x 11008) x 2 layers fewer
    from batchlab.formula.memory import memory
    plain, fp8 = (memory(cfg(precision="bf16-mixed", fp8=f)).phase_peaks["forward"] for f in ("none", "tensorwise"))
    assert plain - fp8 == 2 * 2 * (4 * H * H + 3 * H * FFN)
