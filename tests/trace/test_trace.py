"""The trace (fake tensors) against independent references: a real run of the same config tracked by the
same storage tracker, hand-counted FLOPs, and the formula's parameter count."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from batchlab.config import ConfigError, RunConfig, preset
from batchlab.formula.params import count
from batchlab.measure.harness import Trainer
from batchlab.measure.memory import track_update, tracker_for
from batchlab.models import Workload, synthetic_tokens
from batchlab.trace import estimate
from batchlab.models.owners import OUTSIDE, ModuleStack
from shapes import hf_gpt2, hf_llama, tiny


def assert_trace_matches_real(cfg: RunConfig, real=None) -> None:
    """``real``: the tracked update of ``cfg`` where the caller has one already."""
    traced = estimate(cfg).memory
    real = real if real is not None else track_update(Trainer(cfg, "cpu"))
    assert traced.peak_bytes == pytest.approx(real.peak_bytes, rel=0.01)
    assert traced.activations_bytes == pytest.approx(real.activations_bytes, rel=0.01)
    assert traced.peak_phase == real.peak_phase


@pytest.mark.parametrize("ac", ["none", "full", "selective"])  # every:2 is in the tree test
def test_builtin_trace_matches_real_run(ac):
    assert_trace_matches_real(tiny(ac=ac, accum=2))


def test_builtin_trace_matches_real_run_mixed_precision_sdpa():
    cfg = tiny(ac="full", precision="bf16-mixed").replace(attention="sdpa", mlp="swiglu", norm="rmsnorm")
    assert_trace_matches_real(cfg)


@pytest.mark.parametrize("make", [hf_gpt2, hf_llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_hf_trace_matches_real_run(make, ac):
    pytest.importorskip("transformers")
    assert_trace_matches_real(make(ac=ac))


class _ConvLM(nn.Module):
    """Not a transformer: the formula cannot describe it, the trace runs its code like any other."""

    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv1d(width, width, 3, padding=1), nn.GELU())
                                    for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens).transpose(1, 2)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.transpose(1, 2))


def conv_factory(cfg):  # found as "test_trace:conv_factory": pytest puts this file's folder on sys.path
    return _ConvLM(), synthetic_tokens(64, cfg.data)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_user_factory_model_trace_matches_real_run(ac):
    cfg = tiny(ac=ac).replace(model_source="test_trace:conv_factory")
    assert_trace_matches_real(cfg)
    b, s, width, vocab, layers = cfg.micro_batch, cfg.seq, 32, 64, 2
    conv = 2 * (b * width * s) * (width * 3)  # per output element: width x kernel multiply-adds
    f = estimate(cfg).flops
    assert f.forward == layers * conv + 2 * b * s * width * vocab
    assert f.recompute == (layers * conv if ac == "full" else 0)


def hand_forward_flops(cfg: RunConfig) -> tuple[int, int, int]:
    """(whole forward, one layer, attention core of one layer) of one micro-batch: 2 FLOPs per
    multiply-add of every matmul, attention scores and weighted sum without causal halving."""
    m, b, s = cfg.model, cfg.micro_batch, cfg.seq
    tokens, h = b * s, m.hidden
    mlp_mats = 3 if m.mlp.value == "swiglu" else 2
    attention = 2 * (2 * b * s * s * h)  # QK^T and AV over all heads
    layer = 2 * tokens * h * (h + 2 * m.kv_hidden) + 2 * tokens * h * h + mlp_mats * 2 * tokens * h * m.ffn + attention
    return m.layers * layer + 2 * tokens * h * m.vocab, layer, attention


def test_forward_and_backward_flops_equal_hand_count():
    cfg = tiny(accum=2)
    whole, _, _ = hand_forward_flops(cfg)
    f = estimate(cfg).flops
    assert f.forward == cfg.accum * whole
    assert f.backward == 2 * f.forward  # eager attention: every matmul has two gradient matmuls
    assert f.recompute == 0
    assert f.model_flops_per_update == f.hardware_flops_per_update == 3 * f.forward


def test_cpu_sdpa_flops_are_counted():
    # without the registered formula, FlopCounterMode counts CPU's flash attention as 0
    cfg = tiny().replace(attention="sdpa")
    whole, _, _ = hand_forward_flops(cfg)
    assert estimate(cfg).flops.forward == whole


@pytest.mark.parametrize("ac,recomputed_layers", [("full", 2), ("every:2", 1)])
def test_full_recompute_adds_one_forward_of_the_wrapped_blocks(ac, recomputed_layers):
    cfg = tiny(ac=ac, accum=2)
    _, layer, _ = hand_forward_flops(cfg)
    f = estimate(cfg).flops
    assert f.recompute == cfg.accum * recomputed_layers * layer
    assert f.hardware_flops_per_update == f.model_flops_per_update + f.recompute


def test_selective_recomputes_only_the_attention_core():
    cfg = tiny(ac="selective")  # matmul outputs kept; the 4-D attention matmuls (bmm) are redone
    _, _, attention = hand_forward_flops(cfg)
    assert estimate(cfg).flops.recompute == cfg.model.layers * attention


def real_bytes_by_module(cfg: RunConfig) -> dict[str, int]:
    trainer = Trainer(cfg, "cpu")
    trainer.update()
    owners = ModuleStack(trainer.raw_model)
    tracker = tracker_for(trainer, owner=owners.current)
    try:
        with tracker:
            trainer.update(listener=tracker)
    finally:
        tracker.close()
        owners.close()
    return tracker.snapshot().activations_by_owner


def test_tree_sums_to_activations_and_matches_real_run():
    cfg = tiny(ac="every:2")
    t = estimate(cfg, tree=True)
    assert t.tree.total_bytes == t.memory.activations_bytes
    traced = {n.name: n.self_bytes for n in t.tree.walk() if n.self_bytes}
    assert traced == real_bytes_by_module(cfg)
    nodes = {n.name: n for n in t.tree.walk()}
    assert "blocks.0.block" not in nodes  # the wrapper and its block share one place
    assert nodes["blocks.0"].recomputed == "full" and nodes["blocks.1"].recomputed is None
    # a wrapped block keeps only its output (the next block's saved input); the plain one keeps its inside
    assert nodes["blocks.0"].total_bytes == nodes["blocks.0"].self_bytes
    assert nodes["blocks.1"].total_bytes > 4 * nodes["blocks.0"].total_bytes
    assert all(n.total_bytes == n.self_bytes + sum(c.total_bytes for c in n.children) for n in t.tree.walk())
    assert OUTSIDE in nodes  # the harness scales the loss after the model returns


def test_notes_name_what_the_trace_leaves_out():
    t = estimate(tiny(dp=2))
    assert t.global_batch == 4 and any("DDP" in n for n in t.notes)
    if not torch.cuda.is_available():
        gpu = estimate(tiny(device="h100"))
        assert gpu.traced_device == "cpu (CUDA's kernel choices)"
        assert any("CUDA's kernel choices" in n for n in gpu.notes)


class _NeedsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, tokens, targets):
        x = self.lin(torch.ones(tokens.shape[0], 4, device=tokens.device))
        if x.sum() > 0:  # data-dependent Python control flow: fake tensors hold no values
            x = x * 2
        return x.sum()


def test_model_that_needs_values_is_a_config_error(monkeypatch):
    def build(cfg):
        model = _NeedsValues()
        return Workload(model, None, synthetic_tokens(16, cfg.data), lambda m, t, y: m(t, y), "needs values")

    monkeypatch.setattr("batchlab.measure.harness.build_workload", build)
    with pytest.raises(ConfigError, match="cannot run on fake tensors"):
        estimate(tiny())


@pytest.mark.slow
def test_llama_2_7b_traces_at_full_width():
    # 7B's width and sequence (hidden 4096, ffn 11008, seq 4096), 4 of its 32 identical layers: every figure
    # below is per layer times layers, so more layers add time, not checks (benchmarks/estimate_speed.py times all 32)
    cfg = RunConfig(model=preset("llama-2-7b", layers=4), seq=4096, micro_batch=1, ac="full")
    t = estimate(cfg)
    n = count(cfg.model).total
    assert t.memory.parameters_bytes == 4 * n  # fp32 weights, counted by the formula's own code
    assert t.memory.optimizer_bytes == 8 * n  # AdamW m and v: steady state, not the first step
    whole, layer, _ = hand_forward_flops(cfg)
    # SDPA's backward recomputes the scores, so only forward and recompute have a simple hand count
    assert t.flops.forward == whole
    # Non-reentrant checkpointing stops recomputing once the last saved tensor is rebuilt: without
    # dropout that is the MLP down projection's input, so the down projection itself is not redone.
    down = 2 * cfg.micro_batch * cfg.seq * cfg.model.hidden * cfg.model.ffn
    assert t.flops.recompute == cfg.model.layers * (layer - down)


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_autocast_weight_copies_are_parameters_not_activations(micro_batch):
    # bf16-mixed: autocast makes a 16-bit copy of every weight in forward and keeps it for backward; the
    # formula counts it under parameters ("16-bit working copies"), so must the tracker (real run and trace)
    spec = preset("llama-2-7b", layers=2, hidden=128, heads=4, kv_heads=4, ffn=344, vocab=512, max_positions=256,
                  impl="batchlab")  # batchlab's GPT of this shape (the preset defaults to transformers')
    cfg = RunConfig(model=spec, seq=64, micro_batch=micro_batch, precision="bf16-mixed")
    from batchlab.formula import estimate as formula

    real = track_update(Trainer(cfg, "cpu"))
    copies = 2 * count(spec).total  # 1.05 MB here: as large as the micro-batch-1 activations themselves
    expected = formula(cfg).memory.activations_bytes
    # the copies alone would be ~90% of the micro-batch-1 figure: the two must agree far closer than that
    assert abs(real.activations_bytes - expected) < 0.1 * copies
    assert_trace_matches_real(cfg, real)


@pytest.mark.parametrize("ac, micro_batch", [("none", 1), ("none", 2), ("selective", 1), ("selective", 3)])
def test_formula_peak_phase_and_forward_peak_agree_with_a_real_mixed_precision_run(ac, micro_batch):
    # around the optimizer/backward crossover of a small Llama-shaped model with a large vocabulary: the
    # formula once counted a 16-bit copy of the (untied) token embedding, which autocast never makes
    # (forward +4.4% here, and at llama-2-7b seq 4096 micro-batch 1 selective it put the peak in forward)
    from batchlab.formula import estimate as formula

    spec = preset("llama-2-7b", layers=2, hidden=128, heads=4, kv_heads=4, ffn=344, vocab=4096, max_positions=256,
                  impl="batchlab")
    cfg = RunConfig(model=spec, seq=64, micro_batch=micro_batch, precision="bf16-mixed", ac=ac)
    real = track_update(Trainer(cfg, "cpu"))
    f = formula(cfg).memory
    assert f.peak_phase == real.peak_phase.value
    assert f.phase_peaks["forward"] == pytest.approx(real.phase_peaks[real.peak_phase.FORWARD], rel=0.01)
    assert f.peak_tensor_bytes == pytest.approx(real.peak_bytes, rel=0.01)
