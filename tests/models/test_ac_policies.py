"""The checkpoint policies users run (torchtitan selective op, selective layer = every:K, Megatron selective)
against the live tensors of a real CPU step: what the formula says each keeps is what the step keeps."""
import functools

import pytest
import torch

from batchlab.config import ACMode, ConfigError, RunConfig, preset
from batchlab.formula import estimate
from batchlab.formula.checkpointing import matmul_outputs
from batchlab.formula.activations import Impl

# dropout 0 so SDPA takes the fused CPU kernel (with dropout it falls back to the math path)
MODELS = {"gpt": dict(dropout=0.0, attention="sdpa"),
          "llama": dict(dropout=0.0, attention="sdpa", mlp="swiglu", norm="rmsnorm", position="rope", kv_heads=2)}


# one real step per configuration for the module: several tests assert different things about the same step's
# live tensors (a step's bytes are the same each time it runs)
@functools.lru_cache(maxsize=None)
def measured_activations(cfg):
    from batchlab.measure.harness import Trainer
    from batchlab.measure.memory import track_update

    return track_update(Trainer(cfg)).activations_bytes


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("ac", ["selective-op", "megatron-selective", "selective-attn", "selective-layer:2"])
def test_each_policy_keeps_what_the_formula_counts(model, ac):
    cfg = RunConfig(model=preset("tiny", **MODELS[model]), seq=64, micro_batch=4, ac=ac)
    measured = measured_activations(cfg)
    assert estimate(cfg).memory.activations_bytes == pytest.approx(measured, rel=0.02), (model, ac)


def test_policies_order_as_their_sources_say():
    """No checkpointing > Megatron (attention core only) > torchtitan op (half the matmuls) > full."""
    base = RunConfig(model=preset("tiny", **MODELS["llama"]), seq=64, micro_batch=4)
    kept = {ac: measured_activations(base.replace(ac=ac)) for ac in ("none", "megatron-selective",
                                                                      "selective-op", "full")}
    assert kept["none"] > kept["megatron-selective"] > kept["selective-op"] > kept["full"], kept


@pytest.mark.parametrize("attention, dropout", [("sdpa", 0.0), ("eager", 0.0), ("sdpa", 0.1)])
def test_keep_attention_keeps_the_attention_outputs_counted_by_hand(attention, dropout):
    """Over full recompute (the block input only), ``selective-attn`` keeps per layer what the attention kernel
    returns: the fused CPU kernel's output (s b h fp32) and log-sum-exp (a s b fp32); eager attention and SDPA's
    math path (CPU with dropout) the softmax output (a s s b fp32).  Live tensors of a real step, to the byte;
    the formula's count of the policy is exact where every other policy's is (the same offset as selective-op)."""
    cfg = RunConfig(model=preset("tiny", attention=attention, dropout=dropout), seq=64, micro_batch=4, ac="full")
    n, h, a, s, b = 4, 128, 4, 64, 4  # tiny's layers, hidden, heads
    fused = attention == "sdpa" and dropout == 0
    by_hand = n * (s * b * h * 4 + a * s * b * 4 if fused else a * s * s * b * 4)
    kept = {ac: measured_activations(cfg.replace(ac=ac)) for ac in ("full", "selective-attn", "selective-op")}
    assert kept["selective-attn"] - kept["full"] == by_hand
    offset = {ac: estimate(cfg.replace(ac=ac)).memory.activations_bytes - kept[ac] for ac in kept}
    assert offset["selective-attn"] == offset["selective-op"] == offset["full"], offset


def test_selective_op_keeps_every_other_matmul_in_call_order():
    """torchtitan's rule, counted by hand for a Llama block: q, k, v, o, gate(w1), up(w3), down(w2) ->
    q, v, gate, down are kept."""
    m = preset("tiny", **MODELS["llama"])
    widths = [w for w, _ in matmul_outputs(m, Impl.HF_LLAMA)]
    h, kv, f = m.hidden, m.kv_hidden, m.ffn
    assert widths == [h, kv, kv, h, f, f, h]
    assert widths[0::2] == [h, kv, f, h]


def test_policy_names_parse_and_megatron_needs_fused_attention():
    assert RunConfig(ac="selective-layer:2").ac.wrapped_layers(4) == (0, 2)  # torchtitan's name for every:2
    assert RunConfig(ac="op").ac.mode is ACMode.SELECTIVE_OP
    assert RunConfig(ac="keep-attention").ac.mode is RunConfig(ac="attn").ac.mode is ACMode.SELECTIVE_ATTN
    with pytest.raises(ConfigError, match="sdpa"):
        RunConfig(model=preset("tiny", attention="eager"), ac="megatron-selective")


def test_selective_op_gradients_equal_plain_training():
    from batchlab.measure.harness import Trainer

    cfg = RunConfig(model=preset("tiny", **MODELS["llama"]), seq=32, micro_batch=2)
    plain = Trainer(cfg)
    batches = plain.batches()
    ref = plain.gradients(batches)
    for ac in ("selective-op", "megatron-selective", "selective-attn"):
        got = Trainer(cfg.replace(ac=ac)).gradients(batches)
        got = {n.replace(".block.", "."): g for n, g in got.items()}  # the wrapper adds a ".block" level
        for name, g in ref.items():
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ac", ["selective-op", "megatron-selective", "selective-attn"])
def test_the_trace_runs_the_same_policy(ac):
    from batchlab.trace import estimate as trace

    cfg = RunConfig(model=preset("tiny", **MODELS["llama"]), seq=64, micro_batch=4, ac=ac)
    assert trace(cfg).memory.activations_bytes == pytest.approx(measured_activations(cfg), rel=0.01)


def test_selective_op_on_hugging_face_llama_keeps_q_v_gate_down():
    """transformers' Llama calls q, k, v, o, gate, up, down: the formula's HF order, checked on a real step."""
    pytest.importorskip("transformers")
    spec = preset("llama-2-7b", layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=256, max_positions=128,
                  dropout=0.0)
    cfg = RunConfig(model=spec, model_source="hf:llama-2-7b", seq=64, micro_batch=4, ac="selective-op")
    assert estimate(cfg).memory.activations_bytes == pytest.approx(measured_activations(cfg), rel=0.03)


def test_keep_attention_on_hugging_face_llama_is_exact_where_selective_op_is():
    """transformers' Llama through SDPA: what ``selective-attn`` keeps per layer (input, attention output and
    log-sum-exp) is counted to the byte: its error equals selective-op's (the rest of the step's common offset)."""
    pytest.importorskip("transformers")
    spec = preset("llama-2-7b", layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=256, max_positions=128,
                  dropout=0.0)
    cfg = RunConfig(model=spec, model_source="hf:llama-2-7b", seq=64, micro_batch=4)
    err = {ac: estimate(cfg.replace(ac=ac)).memory.activations_bytes - measured_activations(cfg.replace(ac=ac))
           for ac in ("selective-attn", "selective-op")}
    assert err["selective-attn"] == err["selective-op"], err
