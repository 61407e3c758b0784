"""A tensor-parallel GPU rank's compute (formula/pipeline.py ``rank_compute_seconds``): each rank runs 1/t of every
kernel's work but launches every kernel of its stage (Shoeybi et al. 2019, sec. 3: every GPU runs the whole layer on
its shard), so a launch-bound model gains nothing from TP while a matmul-bound one divides by t."""

import pytest

from batchlab.config import Backend, RunConfig, preset
from batchlab.formula import estimate
from batchlab.formula.oplist import micro_batch_ops
from batchlab.formula.timing import NOMINAL_DISPATCH


def per_rank(cfg: RunConfig) -> float:
    t = estimate(cfg).time
    return max(t.stage_seconds) - t.tp_comm_seconds / cfg.accum - t.pp_comm_seconds / cfg.accum


def test_a_launch_bound_model_keeps_its_launches_on_every_tensor_parallel_rank():
    # the built-in GPT (4 layers, h 128) on H100s: a few us of launch per kernel against sub-us kernels
    tiny = RunConfig(seq=128, micro_batch=2, accum=4, pp=2, precision="bf16-mixed", device="h100-sxm")
    tp4 = tiny.replace(tp=4)
    # by hand: the stage issues half the micro-batch's kernels (views are host-only), at >= 5 us each (the smallest
    # nominal CUDA launch, NOMINAL_DISPATCH) -- a floor no TP degree lowers
    kernels = sum(o.count for o in micro_batch_ops(tiny) if o.cost_class.value != "view")
    floor = kernels / 2 * min(NOMINAL_DISPATCH[Backend.CUDA][k] for k in ("forward", "backward"))
    assert per_rank(tp4) >= floor
    assert per_rank(tp4) == pytest.approx(per_rank(tiny), rel=0.1)


def test_a_matmul_bound_model_divides_its_compute_by_the_tensor_parallel_degree():
    big = RunConfig(model=preset("gpt2", layers=4, hidden=4096, heads=32, max_positions=2048), seq=2048,
                    micro_batch=4, accum=4, pp=2, precision="bf16-mixed", device="h100-sxm")
    assert per_rank(big.replace(tp=4)) == pytest.approx(per_rank(big) / 4, rel=0.1)
