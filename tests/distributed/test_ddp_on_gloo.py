"""DP measurement on the real stack: torchrun, 2 ranks, gloo, DistributedDataParallel (CPU).

Launches are shared between assertions (module fixtures).  This file's ``_rank_main`` is the rank program of
the user-started (external) measurement and, in the same ranks after it, of the FSDP2 (ZeRO-3) measurement and
of the gradient-equivalence test; run as a script (``torchrun ... tests/distributed/test_ddp_on_gloo.py DIR``) it runs
under torchrun as well.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchlab.host import regime
from batchlab.config import RunConfig, preset
from batchlab.distributed import forked
from batchlab.measure.options import MeasureOptions
from batchlab.measure.result import Outcome

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BASE = RunConfig(dp=2, micro_batch=2, seq=32)
OPTS = MeasureOptions(warmup=1, steps=2)
# dropout off: each rank's dropout masks come from its own RNG stream, which no single process reproduces
GRAD_CFG = BASE.replace(accum=2, dropout=0.0)
# micro-batch 4 x seq 64: one FSDP2 block (0.76 MiB, by which the peak moves between runs as gloo's threads
# free buffers) stays under 4% of the peak
FSDP_CFG = RunConfig(model=preset("tiny"), dp=2, micro_batch=4, seq=64, zero=3)
FSDP_OPTS = MeasureOptions(warmup=2, steps=1, timing=False)


def _parameter_bytes(cfg: RunConfig) -> int:
    from batchlab.models import build_workload

    return sum(p.numel() * p.element_size() for p in build_workload(cfg).model.parameters())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def _measure_argv(*args: str) -> list[str]:
    """``measure ARGS`` (typer drops the command name while ``measure`` is the app's only command)."""
    import typer.main

    from batchlab.cli import app

    named = hasattr(typer.main.get_command(app), "commands")  # a group of subcommands
    return (["measure"] if named else []) + list(args)


# --no-calibrate: the time model's calibration is not under test here (each process without a cached one would
# measure it, every rank of the external job included)
SHAPE = ["--dp", "2", "--micro-batch", str(BASE.micro_batch), "--seq", str(BASE.seq),
         "--warmup", str(OPTS.warmup), "--steps", str(OPTS.steps), "--no-calibrate"]


EXTERNAL_ACCUM = 4


@pytest.fixture(scope="module")
def external(tmp_path_factory):
    """One 2-rank job running ``_rank_main`` in ranks batchlab did not start for the measurement (they have
    torchrun's environment: forks of the pre-imported process here, distributed/forked.py; torchrun itself starts
    ranks in the dead-rank test below and in util/test_lifeline.py): each rank first runs
    ``python -m batchlab measure --dp 2 --accum 4 --json`` (rank 0 alone prints), then measures FSDP_CFG
    (batchlab.distributed.measure_in_torchrun, the rank side of every DP measurement), then saves the
    all-reduced gradients of one update of GRAD_CFG.
    (The DDP Measurement, the gradients' folder, the FSDP2 Measurement.)"""
    from batchlab.measure.result import load_measurement
    from batchlab.measure.runner import child_env

    out = tmp_path_factory.mktemp("grads")
    ranks = forked.run(2, f"{__name__}:_forked_rank", {}, out, dict(child_env(), OMP_NUM_THREADS="1"), 120)
    assert ranks is not None and not ranks.timed_out and set(ranks.codes.values()) == {0}, ranks and ranks.log[-3000:]
    printed = (out / "stdout0.txt").read_text()
    return load_measurement(printed), out, load_measurement((out / "fsdp.json").read_text())


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, plant_shadows):
    """``batchlab measure --nproc 2 --dp 2`` (the launcher path, text output) started in a folder holding
    modules named like the stdlib's; the Measurement the CLI printed, kept by a spy on the real launch."""
    from typer.testing import CliRunner

    import batchlab.distributed
    from batchlab.cli import app

    cwd = tmp_path_factory.mktemp("shadowed")
    marker = plant_shadows(cwd)
    launched, real = [], batchlab.distributed.launch

    def spy(*args, **kwargs):  # the real launch; its Measurement kept
        launched.append(real(*args, **kwargs))
        return launched[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.setattr(batchlab.distributed, "launch", spy)
        res = CliRunner().invoke(app, _measure_argv("--nproc", "2", "--accum", "1", *SHAPE), env={"COLUMNS": "300"})
    return res, launched, marker


@pytest.fixture(scope="module")
def runs(cli_run, external):
    res, launched, _ = cli_run
    assert res.exit_code == 0 and len(launched) == 1, res.output[-3000:]
    return {1: launched[0], EXTERNAL_ACCUM: external[0]}


def test_the_cli_prints_per_rank_memory_allreduce_and_scope(cli_run):
    res, _, _ = cli_run
    assert res.exit_code == 0, res.output[-3000:]
    out = res.output
    assert "global batch = micro-batch x accum x DP = 2 x 1 x 2 = 4" in out
    assert "peak memory per rank (allocator): rank 0 " in out and ", rank 1 " in out
    assert "gradient_as_bucket_view is on" in out
    assert "gradient all-reduce (gloo, 2 ranks): once per optimizer update" in out
    assert "all-reduce time per update (median, wall-clock" in out
    assert "loopback gloo on CPU says nothing about NCCL over NVLink or InfiniBand" in out


def test_ddp_ranks_do_not_import_the_working_directory(cli_run):
    """The CLI above ran in a folder of planted stdlib names: no rank (started with PYTHONSAFEPATH) ran one."""
    res, _, marker = cli_run
    assert not marker.exists(), marker.read_text()
    assert res.exit_code == 0, res.output[-3000:]


@pytest.mark.parametrize("accum", [1, EXTERNAL_ACCUM])
def test_gradients_are_all_reduced_once_per_update(runs, accum):
    m = runs[accum]
    assert m.ok, m.outcome_detail
    c = m.comm
    # every gradient crosses the wire once per update, whatever the accumulation (no_sync on the others)
    assert c.bytes_per_update == _parameter_bytes(BASE)
    assert c.rounds_per_update == 1
    assert c.calls_per_update == runs[1].comm.calls_per_update  # one hook call per DDP bucket
    assert not any("exactly one" in w for w in m.warnings)
    assert len(c.seconds) == len(m.time.samples) == len(m.time.probe_seconds) == OPTS.steps  # + the speed probe
    assert all(0 < a < t for a, t in zip(c.seconds, m.time.samples))
    assert c.backend == "gloo" and c.world_size == 2 and "NVLink" in c.scope
    assert m.environment["launcher"] == (forked.LAUNCHER if accum == 1 else "torchrun (external)")
    if accum == 1:  # ranks batchlab launched run in its allocator regime (freed memory kept: batchlab.host.regime)
        assert m.environment["allocator"] == regime.describe(regime.steady_env({}))


def test_memory_is_reported_per_rank_with_one_gradient_copy(runs):
    from batchlab.measure.harness import Trainer
    from batchlab.measure.memory import track_update

    mem = runs[EXTERNAL_ACCUM].memory
    assert len(mem.per_rank_peak_bytes) == 2 and mem.peak_bytes == max(mem.per_rank_peak_bytes)
    assert "gradient_as_bucket_view=True" in mem.method
    # the same update in one process (tracked the same way): DDP's buckets are the gradients, so a rank
    # holds one gradient copy like it; .grad beside the buckets would add a whole copy (parameter bytes)
    single = track_update(Trainer(BASE.replace(accum=EXTERNAL_ACCUM, dp=1), "cpu"))
    params = _parameter_bytes(BASE)
    assert mem.breakdown["gradients"] == params
    assert abs(mem.peak_bytes - single.peak_bytes) < params // 2, (mem.peak_bytes, single.peak_bytes)


def test_useful_tokens_are_summed_over_ranks(runs):
    for accum, m in runs.items():
        assert m.global_batch == BASE.micro_batch * accum * 2
        assert m.useful_tokens_per_update == m.global_batch * BASE.seq  # fixed-length data: all useful


def _forked_rank(folder: Path, request: dict, parent: int) -> int:
    """``_rank_main`` in a fork (forked.run's entry), its stdout to ``stdout<rank>.txt`` beside the results."""
    fd = os.open(folder.parent / f"stdout{os.environ['RANK']}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    _rank_main(str(folder.parent))
    return 0


def _rank_main(out: str) -> None:
    """One rank of ``external``: the measure command as a user's launcher starts it (no process group yet);
    then the same DDP build as a measurement, saving the first update's all-reduced gradients."""
    import runpy

    import torch
    import torch.distributed as dist

    from batchlab.distributed import measure_in_torchrun, worker
    from batchlab.measure.result import measurement_to_json

    sys.argv = ["batchlab", *_measure_argv("--accum", str(EXTERNAL_ACCUM), "--json", *SHAPE)]
    try:
        runpy.run_module("batchlab", run_name="__main__")  # python -m batchlab measure ...
    except SystemExit as e:
        assert e.code in (0, None), f"measure exited {e.code}"
    assert not dist.is_initialized(), "measure left its process group behind"
    # each further default group on a store of its own: a re-made one on torchrun's store reuses the first one's
    # keys (gloo then read a peer's stale address now and then; see test_advise_torch_script._forked_rank)
    first_port = int(os.environ["MASTER_PORT"])
    os.environ.update(MASTER_PORT=str(first_port + 1), TORCHELASTIC_USE_AGENT_STORE="False")
    fsdp = measure_in_torchrun(FSDP_CFG, FSDP_OPTS)
    assert not dist.is_initialized(), "measure_in_torchrun left its process group behind"
    if os.environ["RANK"] == "0":
        (Path(out) / "fsdp.json").write_text(measurement_to_json(fsdp))
    os.environ["MASTER_PORT"] = str(first_port + 2)
    device, _ = worker.init(GRAD_CFG, OPTS, 60)
    rank, world, _ = worker.env_ranks()
    trainer, monitor = worker.build(GRAD_CFG, device, rank, world)
    grads = {}

    class Capture:  # after the last backward, before clipping and the optimizer step
        def mark(self, phase):
            if phase == "optimizer":
                grads.update({n: p.grad.detach().clone() for n, p in trainer.raw_model.named_parameters()})

    trainer.update(listener=worker.Listeners(Capture(), monitor))
    torch.save(dict(grads=grads, rounds=monitor.updates[0].rounds), Path(out) / f"grads{rank}.pt")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # as batchlab's own ranks leave: DDP's reducer and gloo torn down at exit aborted now and then


def test_ddp_gradients_equal_the_single_process_gradient_of_the_global_batch(external):
    import torch

    from batchlab.measure.harness import Trainer

    ranks = [torch.load(external[1] / f"grads{r}.pt") for r in (0, 1)]
    single = GRAD_CFG.replace(dp=1)
    # the union of what each rank drew: the Trainer seeds rank k's data generator with k
    batches = [b for k in (0, 1) for b in Trainer(single, "cpu", rank=k).batches()]
    reference = Trainer(single, "cpu").gradients(batches)
    for r in ranks:
        assert r["rounds"] == 1
        assert r["grads"].keys() == reference.keys()
        for name, ref in reference.items():
            rel = (r["grads"][name] - ref).norm() / ref.norm()
            assert rel <= 1e-5, (name, float(rel))


def test_measure_runs_fsdp_under_torchrun_with_traffic_and_shards_reported(external):
    from batchlab.cli.render_dp import lines
    from batchlab.formula import estimate
    from batchlab.formula.params import count

    m = external[2]
    assert m.ok and m.traffic.engine == "fsdp" and m.traffic.matches_formula
    assert m.environment["launcher"] == "torchrun (external)" and len(m.memory.per_rank_peak_bytes) == 2
    assert m.traffic.parameter_shard_bytes == 4 * count(FSDP_CFG.model).total // 2
    assert m.memory.breakdown["parameters"] > m.traffic.parameter_shard_bytes  # gathered working copies too
    predicted = estimate(FSDP_CFG).memory.peak_tensor_bytes
    assert abs(predicted - m.memory.peak_bytes) <= 0.03 * m.memory.peak_bytes
    text = "\n".join(lines(m))
    assert "equal to the formula's" in text and "set_requires_gradient_sync(True)" in text


# forked ranks (the CPU default) and torchrun's (several nodes, CUDA; asked for here); the stuck rank's limit: a
# fork reaches its first update within a second of the launch (a torchrun rank spends 3-4 s importing first)
@pytest.mark.parametrize("fault, limit, launcher", [("2:kill", None, "torchrun"), ("2:kill", None, None),
                                                    ("0:hang", 3.0, None)])
def test_a_dead_or_stuck_rank_ends_the_measurement_with_no_process_left(monkeypatch, tmp_path, fault, limit,
                                                                       launcher):
    from batchlab.distributed import launch
    from batchlab.distributed.worker import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, f"1:{fault}")  # rank 1, just before that update (0: the first)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the temporary folder of torchrun and its ranks
    t0 = time.perf_counter()
    m = launch(BASE, OPTS, timeout_s=limit, launcher=launcher)
    assert m.environment["launcher"] == (launcher or forked.LAUNCHER)
    wall = time.perf_counter() - t0
    assert m.outcome is Outcome.FAILED
    if fault.endswith("kill"):
        assert m.outcome_detail.startswith("rank 1 (killed by SIGKILL"), m.outcome_detail
        assert wall < 60
    else:
        assert m.outcome_detail.startswith(f"timeout after {limit:g} s"), m.outcome_detail
        assert wall < limit + 20
    pids = m.environment["rank_pids"]
    assert len(pids) == 2
    deadline = time.time() + 5
    while any(_alive(p) for p in pids.values()) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids.values())
    if launcher == "torchrun":
        assert not _alive(m.environment["torchrun_pid"])
        # torchrun's default log folder; torchinductor_<user>, torch's one cache per user, may stay
        assert not list(tmp_path.glob("torchelastic_*")), "torchrun left its log folder behind"


@pytest.mark.gpu
def test_nccl_on_two_gpus_all_reduces_once_per_update():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    from batchlab.distributed import launch

    m = launch(BASE.replace(accum=4), MeasureOptions(warmup=1, steps=2, torch_device="cuda"))
    assert m.ok, m.outcome_detail
    assert m.comm.backend == "nccl" and m.comm.rounds_per_update == 1
    assert m.comm.bytes_per_update == _parameter_bytes(BASE)
    assert all(s > 0 for s in m.comm.seconds)  # CUDA events around each bucket
    assert "cuda max_memory_allocated" in m.memory.method and len(m.memory.per_rank_peak_bytes) == 2


if __name__ == "__main__":
    _rank_main(sys.argv[1])
