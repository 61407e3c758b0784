"""Each optimizer catalogue entry (config/optimizers.py) against a real step of the built-in model: the state
bytes the formula counts are the live state tensors the torch optimizer holds after one update, to the byte, and
the time model prices the step ops the entry lists."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from batchlab.config import OPTIMIZERS, OptimizerKind, RunConfig, optimizer_spec, preset
from batchlab.formula import estimate
from batchlab.formula.oplist import update_ops

TORCH_CLASS = {k: optimizer_spec(k).torch_class.rpartition(".")[2] for k in OptimizerKind}
# entries whose class comes from another package (bitsandbytes) run only where it is installed
LIVE = [k for k in OptimizerKind if not optimizer_spec(k).package
        or importlib.util.find_spec(optimizer_spec(k).package) is not None]


def live_state(kind: OptimizerKind, precision: str, **model) -> tuple[int, int, RunConfig]:
    """(bytes of the state tensors with a dimension, count of 0-dim step counters) after one real update."""
    from batchlab.measure.harness import Trainer

    cfg = RunConfig(model=preset("tiny", **model), seq=16, micro_batch=2, optimizer=kind, precision=precision)
    trainer = Trainer(cfg)
    trainer.update()
    tensors = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    assert type(trainer.optimizer).__name__ == TORCH_CLASS[kind]
    steps = [t for t in tensors if t.dim() == 0]
    assert all(t.dtype == torch.float32 for t in steps)  # one fp32 step counter per parameter, where kept
    return sum(t.numel() * t.element_size() for t in tensors if t.dim() > 0), len(steps), cfg


@pytest.mark.parametrize("kind", LIVE)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-mixed"])
def test_state_bytes_are_the_live_state_tensors(kind, precision):
    measured, steps, cfg = live_state(kind, precision)
    # the formula leaves out the 0-dim step counters (4 bytes per parameter tensor, where the optimizer keeps one)
    assert estimate(cfg).memory.optimizer_bytes == measured, (kind, precision, steps)


@pytest.mark.parametrize("kind", LIVE)
def test_state_bytes_on_a_llama_shape(kind):
    """Bias-free SwiGLU with RMSNorm and an untied head: other parameter shapes, the same count."""
    measured, _, cfg = live_state(kind, "fp32", mlp="swiglu", norm="rmsnorm", position="rope", bias=False,
                                  tied_embeddings=False, kv_heads=2)
    assert estimate(cfg).memory.optimizer_bytes == measured


def test_hand_counts_for_the_shipped_optimizers():
    """AdamW keeps m and v (8 bytes per fp32 parameter, 4 under pure bf16), SGD with momentum one buffer,
    plain SGD nothing: tiny's 891,648 parameters (docs/accuracy figures) by hand."""
    n = 891_648
    by_hand = {("adamw", "fp32"): 8 * n, ("adamw", "bf16"): 4 * n, ("sgd-momentum", "fp32"): 4 * n,
               ("sgd", "fp32"): 0}
    for (kind, precision), want in by_hand.items():
        cfg = RunConfig(model=preset("tiny"), optimizer=kind, precision=precision)
        assert estimate(cfg).memory.optimizer_bytes == want, kind


@pytest.mark.parametrize("kind", list(OptimizerKind))
def test_the_time_model_prices_the_entrys_step(kind):
    """Every op name the entry lists is in the update's op list, in the optimizer phase."""
    ops = update_ops(RunConfig(model=preset("tiny"), optimizer=kind))
    names = {o.name for o in ops if o.phase.value == "optimizer"}
    assert {s.name for s in optimizer_spec(kind).step_ops} <= names


def test_every_entry_is_registered_once_and_recognised_from_its_live_class():
    from batchlab.config.optimizers import from_live

    assert set(OPTIMIZERS) == set(OptimizerKind)
    for kind, spec in OPTIMIZERS.items():
        momentum = 0.9 if spec.live_momentum else None
        assert from_live(spec.live_names[0], momentum) is kind


def test_adafactor_keeps_row_and_column_statistics_counted_by_hand():
    """Shazeer & Stern 2018: an (o, i) matrix keeps o + i statistics, a vector its own size.  tiny (GPT-2 style,
    4 layers, h 128, f 512, vocab 512, 256 positions, biases, tied head) by hand, fp32."""
    h, f, V, P, L = 128, 512, 512, 256, 4
    matrices = [(V, h), (P, h)] + [(3 * h, h), (h, h), (f, h), (h, f)] * L
    vectors = [h, h, 3 * h, h, h, h, f, h] * L + [h, h]  # 2 norms x (w, b), 4 biases per layer; final norm
    by_hand = 4 * (sum(o + i for o, i in matrices) + sum(vectors))
    cfg = RunConfig(model=preset("tiny"), optimizer="adafactor")
    assert estimate(cfg).memory.optimizer_bytes == by_hand == live_state(OptimizerKind.ADAFACTOR, "fp32")[0]


def test_measure_runs_adafactor():
    """``batchlab measure --optimizer adafactor`` runs a real update: its tracker's optimizer category is the
    formula's state to the byte, its peak the formula's within 1%."""
    import json

    import typer
    from typer.testing import CliRunner

    from batchlab.cli import app

    prefix = ["measure"] if hasattr(typer.main.get_command(app), "commands") else []
    r = CliRunner().invoke(app, prefix + ["--seq", "16", "--micro-batch", "2", "--steps", "1", "--warmup", "1",
                                          "--optimizer", "adafactor", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["outcome"] == "ok", d
    cfg = RunConfig(model=preset("tiny"), seq=16, micro_batch=2, optimizer="adafactor")
    est = estimate(cfg).memory
    assert d["memory"]["breakdown"]["optimizer"] == est.optimizer_bytes, d["memory"]
    assert d["memory"]["peak_bytes"] == pytest.approx(est.peak_bytes, rel=0.01), (d["memory"], est.peak_bytes)


def test_adamw8bit_state_counted_by_hand():
    """bitsandbytes' blockwise 8-bit Adam (optim/optimizer.py Optimizer2State.init_state): a tensor of n >= 4096
    elements keeps two uint8 states and two fp32 absmax vectors of ceil(n / 2048); a smaller one two fp32 states.
    tiny (GPT-2 style, 4 layers, h 128, f 512, vocab 512, 256 positions, biases, tied head) by hand."""
    h, f, V, P, L = 128, 512, 512, 256, 4
    big = [V * h, P * h] + [3 * h * h, h * h, f * h, h * f] * L  # all >= 4096 elements
    small = [h, h, 3 * h, h, h, h, f, h] * L + [h, h]  # norms and biases
    by_hand = sum(2 * n + 2 * 4 * -(-n // 2048) for n in big) + sum(8 * n for n in small)
    for precision in ("fp32", "bf16"):  # 8-bit whatever the weights' dtype
        cfg = RunConfig(model=preset("tiny"), optimizer="adamw8bit", precision=precision)
        assert estimate(cfg).memory.optimizer_bytes == by_hand


def test_paged_adamw8bit_leaves_large_states_out_of_the_device_count():
    """PagedAdamW8bit (bitsandbytes get_state_buffer): the uint8 states of tensors of >= 1e5 elements are CUDA
    unified memory, outside the allocator's count; their absmax scales and the small tensors' states are not.
    h 512, f 2048, vocab 1024, 2 layers, no biases, untied, RoPE, RMSNorm, by hand."""
    h, f, V, L = 512, 2048, 1024, 2
    tensors = [V * h] + [3 * h * h, h * h, f * h, f * h, h * f] * L + [V * h]  # q/k/v fused, SwiGLU's three
    norms = [h, h] * L + [h]

    def device(n: int, paged: bool) -> int:
        states = 0 if paged and n >= 100_000 else 2 * n
        return states + 2 * 4 * -(-n // 2048)

    model = preset("tiny", layers=L, hidden=h, heads=8, ffn=f, vocab=V, mlp="swiglu", norm="rmsnorm",
                   position="rope", bias=False, tied_embeddings=False)
    for kind, paged in (("adamw8bit", False), ("adamw8bit-paged", True)):
        want = sum(device(n, paged) for n in tensors) + sum(8 * n for n in norms)
        assert estimate(RunConfig(model=model, optimizer=kind, device="a100-80gb")).memory.optimizer_bytes == want


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed")
def test_measure_refuses_an_optimizer_whose_package_is_absent():
    from typer.testing import CliRunner

    from batchlab.cli import app

    r = CliRunner().invoke(app, ["measure", "--seq", "16", "--micro-batch", "2", "--optimizer", "adamw8bit"])
    assert r.exit_code == 2, r.output
    assert "optimizer" in r.output and "bitsandbytes" in r.output and "Traceback" not in r.output
