"""The optimizer step's bytes in the calculator's op list against the ops a real update runs (recorded with
their live tensors): under pure bf16 the weights, gradients and AdamW state are bf16, so the step moves half of
what it moves in fp32 or under autocast (fp32 master weights)."""
from __future__ import annotations

import pytest

from batchlab.config import RunConfig, preset
from batchlab.config.phase import Phase
from batchlab.formula.oplist import update_ops
from batchlab.formula.timing import timing
from batchlab.formula import flops, memory
from batchlab.measure.harness import Trainer
from batchlab.trace.ops import record_update


def recorded(cfg: RunConfig):
    trainer = Trainer(cfg)
    trainer.update()  # AdamW's state exists: the steady update
    return record_update(trainer)


def _step_bytes(ops) -> int:
    return sum(o.bytes * o.count for o in ops if o.phase is Phase.OPTIMIZER)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_step_moves_the_bytes_a_real_step_moves(precision):
    cfg = RunConfig(seq=32, micro_batch=2, precision=precision)
    assert _step_bytes(update_ops(cfg)) == pytest.approx(_step_bytes(recorded(cfg)), rel=0.06)


def test_a_pure_bf16_step_takes_half_the_time_of_an_fp32_master_copys_on_a_gpu():
    # a 1.6 B-parameter model on an A100: its step is bandwidth-bound, and only the weights' dtype differs
    spec = preset("llama-3-8b", layers=4)
    cfgs = [RunConfig(model=spec, device="a100-80gb", precision=p) for p in ("bf16", "bf16-mixed")]
    steps = [timing(c, flops(c), memory(c)).optimizer_seconds for c in cfgs]
    assert steps[0] == pytest.approx(steps[1] / 2, rel=0.02)


def test_megatron_core_steps_its_fp32_main_params_under_bf16_weights():
    # Megatron-LM README, "Distributed Optimizer": bf16 weights train beside fp32 main params, fp32 gradients and
    # fp32 Adam state, and the optimizer steps the fp32 copies: the same bytes as an fp32 run's step
    steps = [_step_bytes(update_ops(RunConfig(seq=32, micro_batch=2, dp=2, sharding="megatron", precision=p)))
             for p in ("bf16", "fp32")]
    assert steps[0] == steps[1]
