"""The formula's per-rank peak against a real per-rank peak: TP2 and PP2 1F1B of the tiny model on two forked gloo
ranks (the build and the memory update a measurement uses), each rank's live-storage peak within 3% of the
formula's entry for its pipeline stage (``memory.ranks``)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from batchlab.config import RunConfig, config_from_dict, preset, to_jsonable

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BASE = RunConfig(model=preset("tiny"), micro_batch=4, seq=64, accum=4)
CASES = {"tp2": BASE.replace(tp=2), "pp2-1f1b": BASE.replace(pp=2, pp_schedule="1f1b")}


def _forked_rank(folder: Path, request: dict, parent: int) -> int:
    import torch
    import torch.distributed as dist

    from batchlab.distributed import layouts, worker

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    out = {}
    for name, cfg in request["cases"].items():
        trainer, _ = layouts.build(config_from_dict(cfg), torch.device("cpu"), rank)
        for _ in range(2):  # AdamW's state, the pipeline's buffers, DTensor's cached shardings
            trainer.update()
        out[name] = worker.measure_memory(trainer, None).peak_bytes
    (folder.parent / f"peaks{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    os._exit(0)


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    from batchlab.distributed import forked
    from batchlab.measure.runner import child_env

    out = tmp_path_factory.mktemp("peaks")
    cases = {k: to_jsonable(v) for k, v in CASES.items()}
    run = forked.run(2, f"{__name__}:_forked_rank", dict(cases=cases), out, dict(child_env(), OMP_NUM_THREADS="1"),
                     240)
    assert run is not None and not run.timed_out and set(run.codes.values()) == {0}, run and run.log[-3000:]
    return [json.loads((out / f"peaks{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_the_formulas_per_rank_peak_is_within_3_percent_of_the_measured(peaks, name):
    from batchlab.distributed.mesh import coordinates
    from batchlab.formula import memory

    cfg = CASES[name]
    stages = {r.stage: r.peak_bytes for r in memory(cfg).ranks}
    for rank, measured in enumerate(p[name] for p in peaks):
        predicted = stages[coordinates(cfg.parallel, rank)["pp"]]
        assert predicted == pytest.approx(measured, rel=0.03), (name, rank, predicted, measured)


@pytest.mark.parametrize("name", list(CASES))
def test_the_trace_of_each_stages_rank_is_within_3_percent_of_its_measured_peak(peaks, name):
    """The trace runs the same build on a fake process group, one rank per pipeline stage; its figures are the
    most loaded stage's."""
    from batchlab.trace import estimate
    from batchlab.trace.run import rank_estimate
    from batchlab.trace.sharded import traced_ranks

    cfg = CASES[name]
    measured = [p[name] for p in peaks]
    # one stage: estimate is that stage's rank_estimate (trace/run.py), traced once for both checks
    whole = estimate(cfg) if cfg.pp == 1 else None
    for rank in traced_ranks(cfg):  # here rank r is stage r (dp = tp = 1)
        traced = (whole or rank_estimate(cfg, rank)).memory.peak_bytes
        assert traced == pytest.approx(measured[rank], rel=0.03), (name, rank, traced, measured[rank])
    if whole is not None:
        assert whole.memory.peak_bytes == pytest.approx(max(measured), rel=0.03)
