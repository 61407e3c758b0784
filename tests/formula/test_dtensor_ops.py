"""DTensor's host work on a tensor-parallel rank (formula/dtensor.py) and the pipeline schedules' actions
(formula/pipeline.py ``schedule_actions``).  References: the DTensor ops a real update dispatches, counted by a
dispatch mode on the rank the measurement builds (a fake process group, real tiny tensors); hand counts from the
papers' schedules; torch.distributed.pipelining's own schedule IR."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from batchlab.config import RunConfig
from batchlab.formula.dtensor import dtensor_ops, host_seconds
from batchlab.formula.opcost import OpCosts
from batchlab.formula.pipeline import pipeline_time, schedule_actions
from batchlab.formula.ranks import shares

SMALL = "--seq 16 --micro-batch 2 --accum 2 --hidden 32 --heads 4 --vocab 64 "
LLAMA = SMALL + "--model hf:llama --kv-heads 2 --ffn 64 "
KINDS = ("F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B")  # torch.distributed.pipelining's _ComputationType


def config(flags: str) -> RunConfig:
    from batchlab.cli.common import config_from_command

    return config_from_command(["estimate", *flags.split()])


def _live(cfg: RunConfig, rank: int) -> dict[str, float]:
    """The DTensor ops of one update of ``rank`` as the measurement builds it, by dispatch kind."""
    from batchlab.calibrate.dtensor import dtensor_calls
    from batchlab.distributed import layouts
    from batchlab.trace.sharded import _static_shapes, fake_world

    with fake_world(cfg.parallel.world_size, rank):
        trainer, _ = layouts.build(cfg, torch.device("cpu"), rank)
        if cfg.parallel.pipelined:
            _static_shapes(trainer.schedule, trainer.stages)
        trainer.update()  # AdamW's state made: the counted update is a steady one
        return dtensor_calls(trainer)


@pytest.mark.parametrize("flags, rank", [
    # the head's stage of a pipeline: sequence-parallel norms, the vocabulary-split head and the loss
    (SMALL + "--layers 2 --tp 2 --pp 2 --sequence-parallel", 2),
    # separate q/k/v, a gated MLP, no biases, its own loss; both ends; FSDP2 steps every parameter as a DTensor
    (LLAMA + "--layers 1 --tp 2 --dp 2 --zero 3", 1),
    (SMALL + "--layers 2 --pp 2 --dp 2 --zero 3", 2),  # FSDP2 without TP: the optimizer's ops alone
])
def test_the_dtensor_ops_of_a_rank_are_those_a_real_update_dispatches(flags, rank):
    cfg = config(flags)
    stage = rank // (cfg.parallel.dp * cfg.parallel.tp)
    per = dtensor_ops(cfg, shares(cfg)[stage])
    formula = {"forward": per["forward"] * cfg.accum, "backward": per["backward"] * cfg.accum, "plain": per["plain"]}
    assert formula == _live(cfg, rank)


def test_hand_count_of_the_tiny_gpts_dtensor_ops():
    # 4 layers x 4 linears with biases; tied embedding and head split over the vocabulary (512 / 2)
    cfg = RunConfig(seq=64, micro_batch=4, accum=4, tp=2)
    ops = dtensor_ops(cfg, shares(cfg)[0])
    # forward: 16 linears x (t, view, addmm, view) + the embedding + the head's 4 + the loss's 5
    assert ops["forward"] == 16 * 4 + 1 + 4 + 5
    # backward: 16 x (2 mm, 4 t, 3 view, sum) + 33 parameters' accumulation (32 + the tied table) + the
    # embedding's + the head's 8 + the loss's 8 + the tied table's two gradients added
    assert ops["backward"] == 16 * 10 + 33 + 1 + 8 + 8 + 1
    assert ops["plain"] == 33 * 8  # AdamW's 8 per-element ops on each DTensor parameter
    assert dtensor_ops(RunConfig(seq=64, micro_batch=4, accum=4), shares(RunConfig())[0]) == {}


def test_dtensor_host_work_is_priced_per_op_and_not_divided_by_tp():
    cfg = RunConfig(seq=64, micro_batch=4, accum=4, tp=2)
    rank = shares(cfg)[0]
    costs = OpCosts(matmul={"fp32": ((1.0, 1e10),)}, memory=((1.0, 1e9),), strided_bytes_per_s=1e9,
                    element_seconds={}, dispatch={"forward": 0.0, "backward": 0.0, "plain": 0.0},
                    dtensor_seconds={"forward": 1e-4, "backward": 2e-5, "plain": 1e-5, "collective": 1e-3})
    micro, update = host_seconds(cfg, rank, costs)
    assert micro == pytest.approx(74 * 1e-4 + 211 * 2e-5)
    assert update == pytest.approx(264 * 1e-5)
    # 10 ms of compute a micro-batch, 6 ms of it dispatch: a TP rank runs half the work and all the dispatch
    stage = pipeline_time(cfg, 10e-3, costs, dispatch_per_micro_batch=6e-3).stages[0]
    assert stage.compute_seconds == pytest.approx(2e-3 + 6e-3)
    # + each of the 21 collectives a real TP2 micro-batch of this GPT issues (tests/formula/test_parallel_time.py)
    # as a redistribution's host work
    assert stage.dtensor_seconds == pytest.approx(micro + 21 * 1e-3)


def _hand(p: int, m: int, v: int, rank: int) -> dict[str, int]:
    """Per rank, chunk-stages rank, rank + p, ...: each runs F and B per micro-batch; a stage sends its
    activations on unless it is the pipeline's last and its input gradient back unless it is the first."""
    stages = [rank + j * p for j in range(v)]
    n = p * v
    out = {"F": m * v, "B": m * v, "SEND_F": 0, "RECV_F": 0, "SEND_B": 0, "RECV_B": 0}
    for s in stages:
        if s < n - 1:
            out["SEND_F"] += m
            out["RECV_B"] += m
        if s > 0:
            out["RECV_F"] += m
            out["SEND_B"] += m
    return out


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_schedule_actions_at_p2_m4_match_the_hand_count(schedule, v):
    cfg = RunConfig(seq=64, micro_batch=4, accum=4, pp=2, pp_schedule=schedule, pp_virtual=v)
    got = [schedule_actions(cfg, r) for r in shares(cfg)]
    assert got == [_hand(2, 4, v, 0), _hand(2, 4, v, 1)]
    # interleaving puts each rank on 3 chunk boundaries where 1F1B has 1: 3x the point-to-point actions
    p2p = sum(n for k, n in got[0].items() if k not in ("F", "B"))
    assert p2p == (24 if v == 2 else 8)


def _torch_counts(order: list) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in order:
        if a is not None and a.computation_type.value in KINDS:
            out[a.computation_type.value] = out.get(a.computation_type.value, 0) + 1
    return out


def test_schedule_actions_match_torchs_own_ir():
    from torch.distributed.pipelining import schedules

    p, m = 3, 6
    cfg = {name: RunConfig(seq=64, micro_batch=1, accum=m, pp=p, pp_schedule=name,
                           model=dataclasses.replace(RunConfig().model, layers=6)) for name in ("gpipe", "1f1b")}
    orders = {}
    for name, cls in (("gpipe", schedules.ScheduleGPipe), ("1f1b", schedules.Schedule1F1B)):
        sched = object.__new__(cls)  # its IR needs the stage and micro-batch counts alone
        sched._num_stages, sched._n_microbatches = p, m
        orders[name] = sched._get_pipeline_order()
    # GPipe's IR with torch's own send / receive pass over it
    compute = {r: [a for a in acts if a is not None] for r, acts in orders["gpipe"].items()}
    with_comms = schedules._add_send_recv(compute, stage_to_rank=lambda s: s, num_stages=p)
    assert [schedule_actions(cfg["gpipe"], r) for r in shares(cfg["gpipe"])] == [
        {k: _torch_counts(with_comms[r]).get(k, 0) for k in KINDS} for r in range(p)]
    # 1F1B: the same forwards and backwards in another order
    assert [{k: schedule_actions(cfg["1f1b"], r)[k] for k in ("F", "B")} for r in shares(cfg["1f1b"])] == [
        _torch_counts(orders["1f1b"][r]) for r in range(p)]


def test_interleaved_actions_match_the_schedule_torch_builds():
    cfg = config(SMALL + "--layers 4 --pp 2 --pp-schedule interleaved-1f1b --pp-virtual 2 --accum 4")
    from batchlab.distributed import layouts
    from batchlab.trace.sharded import fake_world

    for rank in range(2):
        with fake_world(2, rank):
            trainer, _ = layouts.build(cfg, torch.device("cpu"), rank)
            ir = trainer.schedule.pipeline_order_with_comms[rank]
        counts = _torch_counts(ir)
        assert schedule_actions(cfg, shares(cfg)[rank]) == {k: counts.get(k, 0) for k in KINDS}


def test_local_ranks_share_the_cores_for_a_layouts_host_work_too():
    # 4 local ranks x 1 thread: on 4 cores each runs at its calibrated speed, on 2 cores at half of it -- the
    # ops' dispatch and DTensor's host work alike (formula/timing.py's sharing, world = DP x TP x PP ranks)
    import dataclasses

    from batchlab.formula import flops, memory
    from batchlab.formula.timing import nominal_costs, timing

    cfg = RunConfig(seq=64, micro_batch=4, accum=4, tp=2, dp=2)
    base = dataclasses.replace(nominal_costs(cfg), threads=1, dtensor_seconds={"forward": 1e-4, "backward": 5e-5,
                                                                              "plain": 2e-5})
    alone, shared = (timing(cfg, flops(cfg), memory(cfg), dataclasses.replace(base, cores=c)) for c in (4, 2))
    micro, _ = host_seconds(cfg, shares(cfg)[0], base, collectives={("all_reduce", ""): (21, 0)})
    assert shared.compute_seconds == pytest.approx(2 * alone.compute_seconds)
    assert shared.optimizer_seconds == pytest.approx(2 * alone.optimizer_seconds)  # its DTensor ops included
    assert shared.tp_comm_seconds == pytest.approx(alone.tp_comm_seconds)  # messages do not share the cores
    grown = shared.update_seconds - shared.exposed_comm_seconds - (alone.update_seconds - alone.exposed_comm_seconds)
    assert grown == pytest.approx(alone.compute_seconds + alone.optimizer_seconds + cfg.accum * micro)


def test_a_calibration_older_than_a_figure_labels_that_figure_nominal():
    """A cache holding the per-op figures but not the redistribution's: the per-op clause says calibrated, the
    redistribution's says whose CPU its nominal figure was measured on."""
    from batchlab.formula import dtensor
    from batchlab.formula.pipeline import tp_collectives
    from batchlab.formula.timing import nominal_costs

    cfg = RunConfig(seq=32, micro_batch=2, tp=2)
    old = dataclasses.replace(nominal_costs(cfg), dtensor_seconds={"forward": 8e-5, "backward": 4e-5, "plain": 3e-5})
    rank = shares(cfg)[0]
    line = dtensor.text(cfg, rank, old, tp_collectives(cfg, rank))
    assert "at 80 / 40 / 30 us each (calibrated)" in line
    assert "450 us of host work each (nominal: one server CPU's own calibration" in line
