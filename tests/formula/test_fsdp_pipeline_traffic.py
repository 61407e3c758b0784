"""FSDP2 inside a pipeline stage sends what torch.distributed.pipelining issues (formula/sharding.py ``traffic`` and
``fsdp_collectives``): counted on a real update of one rank on a fake process group (real tiny tensors,
distributed/traffic.py's counter), not the once-per-micro-batch reduce-scatters of FSDP2 without a pipeline."""
from __future__ import annotations

import collections

import pytest
import torch

from batchlab.formula.ranks import shares
from batchlab.formula.sharding import fsdp_collectives, traffic

SMALL = "--seq 16 --micro-batch 2 --hidden 32 --heads 4 --vocab 64 --layers 4 --dp 2 "


@pytest.mark.parametrize("flags, rank", [
    (SMALL + "--pp 2 --accum 4 --zero 3 --pp-schedule 1f1b", 0),
    (SMALL + "--pp 2 --accum 4 --zero 2 --pp-schedule 1f1b", 0),
    (SMALL + "--pp 4 --accum 4 --zero 3 --pp-schedule 1f1b", 4),  # a middle stage: its root holds nothing
])
def test_a_pipeline_stages_fsdp2_collectives_are_those_a_real_update_issues(flags, rank):
    from batchlab.cli.common import config_from_command
    from batchlab.distributed import layouts
    from batchlab.distributed.traffic import TrafficCounter
    from batchlab.trace.sharded import _static_shapes, fake_world

    cfg = config_from_command(["estimate", *flags.split()])
    with fake_world(cfg.parallel.world_size, rank):
        trainer, _ = layouts.build(cfg, torch.device("cpu"), rank)
        _static_shapes(trainer.schedule, trainer.stages)
        trainer.update()
        counter = TrafficCounter()
        with counter:
            trainer.update(listener=counter)
    calls, sent = collections.Counter(), collections.Counter()
    for call in counter.calls:
        if call.kind in ("all_gather", "reduce_scatter"):
            calls[call.kind] += 1
            sent[call.kind] += call.bytes
    stage = shares(cfg)[rank // cfg.parallel.dp]
    assert fsdp_collectives(cfg, stage) == dict(calls)
    # fp32: a unit gathers and reduces 4 bytes an element, so the bytes' ratio is the gathers per reduce-scatter
    whole = traffic(cfg).per_update
    assert whole["all_gather"] / whole["reduce_scatter"] == pytest.approx(sent["all_gather"] / sent["reduce_scatter"])
