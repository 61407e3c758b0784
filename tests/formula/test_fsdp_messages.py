"""FSDP2's collectives per update (formula/sharding.py ``fsdp_collectives``), each a message on a local link
(formula/timing.py): counted against the c10d ops a real FSDP2 update issues (rank 0 on a fake process group, real
tiny tensors, distributed/traffic.py's counter)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from batchlab.config import RunConfig
from batchlab.formula.sharding import fsdp_collectives

SMALL = "--seq 16 --micro-batch 2 --accum 2 --hidden 32 --heads 4 --vocab 64 --dp 2 "


def config(flags: str) -> RunConfig:
    from batchlab.cli.common import config_from_command

    return config_from_command(["estimate", *flags.split()])


@pytest.mark.parametrize("flags", [SMALL + "--layers 3 --zero 3", SMALL + "--layers 2 --zero 2 --accum 3"])
def test_fsdp2s_collectives_are_those_a_real_update_issues(flags):
    from batchlab.distributed import engines
    from batchlab.distributed.traffic import TrafficCounter
    from batchlab.trace.sharded import fake_world

    cfg = config(flags)
    with fake_world(cfg.dp, 0):
        trainer, _ = engines.build(cfg, torch.device("cpu"), 0, cfg.dp)
        trainer.update()
        counter = TrafficCounter()
        with counter:
            trainer.update(listener=counter)
    calls = counter.summary(cfg.accum)["calls_per_update"]
    assert fsdp_collectives(cfg) == {k: v for k, v in calls.items() if v}


def test_each_fsdp_collective_pays_its_messages_on_a_local_link():
    # ZeRO-3, 4 blocks + the root, 4 micro-batches: 5 x (2 all-gathers + 1 reduce-scatter) x 4 = 60 collectives over
    # 2 ranks: an all-gather n - 1 = 1 message, a reduce-scatter 2(n - 1) = 2, as gloo runs it as an all-reduce of
    # its input (ProcessGroupGloo::reduce_scatter_tensor_coalesced), + the token count's all-reduce (2); 1 ms each
    from batchlab.formula import flops, memory
    from batchlab.formula.timing import nominal_costs, timing

    cfg = RunConfig(seq=64, micro_batch=4, accum=4, dp=2, zero=3)
    assert sum(fsdp_collectives(cfg).values()) == 60
    base = dataclasses.replace(nominal_costs(cfg), link_bytes_per_s=1e9, threads=1, cores=2)
    slow, fast = (timing(cfg, flops(cfg), memory(cfg), dataclasses.replace(base, link_latency_s=s)) for s in (1e-3, 0.0))
    assert slow.allreduce_seconds - fast.allreduce_seconds == pytest.approx(82e-3)


def test_fsdp2_beside_tp_pays_its_host_work_once_per_collective_a_real_update_issues():
    # FSDP2 x TP2 on rank 0 of a fake world of 4: FSDP2's all-gathers and reduce-scatters of one real update (TP
    # without sequence parallelism sends all-reduces only), each priced at the calibrated host work per collective
    # on a 2-D mesh (calibrate/fsdp_host.py), at full host speed (a core per rank)
    from batchlab.distributed import layouts
    from batchlab.distributed.traffic import TrafficCounter
    from batchlab.formula import flops, memory
    from batchlab.formula.timing import nominal_costs, timing
    from batchlab.trace.sharded import fake_world

    cfg = config(SMALL + "--layers 2 --zero 3 --tp 2")
    with fake_world(cfg.parallel.world_size, 0):
        trainer, _ = layouts.build(cfg, torch.device("cpu"), 0)
        trainer.update()
        counter = TrafficCounter()
        with counter:
            trainer.update(listener=counter)
    calls = counter.summary(cfg.accum)["calls_per_update"]
    issued = calls.get("all_gather", 0) + calls.get("reduce_scatter", 0)
    base = dataclasses.replace(nominal_costs(cfg), threads=1, cores=4, rank_skew=0.0, contention={})
    priced, free = (timing(cfg, flops(cfg), memory(cfg), dataclasses.replace(
        base, dtensor_seconds={"fsdp-hooks": 5e-3, "fsdp-tp-hooks": s})) for s in (1e-3, 0.0))
    assert issued == 3 * 3 * cfg.accum  # 2 blocks + the root, 2 all-gathers (ZeRO-3) and a reduce-scatter each
    assert priced.update_seconds - free.update_seconds == pytest.approx(issued * 1e-3)


def test_fsdp2_without_a_layout_pays_its_optimizers_dtensor_ops_once_per_parameter():
    # FSDP2 keeps every parameter a DTensor: AdamW's 8 per-element ops on each (counted by hand on a real step,
    # tests/formula/test_dtensor_ops.py) at DTensor's host cost per op; calibrate/fsdp_host.py leaves the step out
    # of its per-collective figure, so nothing else pays them
    from batchlab.formula import flops, memory
    from batchlab.formula.timing import nominal_costs, timing
    from batchlab.models import build_workload

    cfg = RunConfig(seq=64, micro_batch=4, accum=4, dp=2, zero=3)
    tensors = sum(1 for _ in build_workload(cfg).model.parameters())
    base = dataclasses.replace(nominal_costs(cfg), threads=1, cores=2, rank_skew=0.0, contention={})
    priced, free = (timing(cfg, flops(cfg), memory(cfg), dataclasses.replace(
        base, dtensor_seconds={"plain": s, "fsdp-hooks": 1e-3})) for s in (1e-5, 0.0))
    assert priced.update_seconds - free.update_seconds == pytest.approx(tensors * 8 * 1e-5)
    # and the assumptions line says so: the optimizer step's figure includes them
    assert f"{tensors * 8} optimizer ops per update on FSDP2's DTensor parameters, at 10 us" in priced.model
