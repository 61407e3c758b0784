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


def test_without_sequence_parallelism_every_tensor_parallel_rank_runs_the_norms_and_dropouts_whole():
    """Korthikanti et al. 2022 sec. 4.2.2: outside the attention and MLP, a layer's two LayerNorms, dropouts and residual
    adds are replicated on every TP rank unless sequence parallelism splits them along the sequence."""
    from batchlab.formula.opcost import price
    from batchlab.formula.pipeline import replicated_ops
    from batchlab.formula.timing import nominal_costs

    cfg = RunConfig(model=preset("gpt2", layers=4, hidden=2048, heads=16, max_positions=2048), seq=2048,
                    micro_batch=2, accum=4, pp=2, tp=4, precision="bf16-mixed", device="a100-80gb")
    norms = [o for o in replicated_ops(cfg) if o.name == "native_layer_norm"]
    # by hand: 2 LayerNorms per layer x 4 layers, each over b·s = 4096 rows of h = 2048
    assert sum(o.count for o in norms) == 8 and {o.elements for o in norms} == {4096 * 2048}
    whole = sum(price(replicated_ops(cfg), nominal_costs(cfg)).work_by_phase.values())
    sp = cfg.replace(sequence_parallel=True)
    # a stage holds half the layers; each rank runs (1 - 1/4) of that work beyond its share
    assert per_rank(cfg) - per_rank(sp) == pytest.approx(whole / 2 * 3 / 4, rel=0.05)
