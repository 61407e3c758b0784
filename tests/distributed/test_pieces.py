"""batchlab.distributed pieces that need no process group: interval union, merging, world-size checks,
torchrun command line, root-cause selection.  Launches are in test_ddp_on_gloo.py."""
from __future__ import annotations

import json
import signal

import pytest

from batchlab.config import ConfigError, RunConfig
from batchlab.distributed.comm import UpdateComm
from batchlab.distributed.failures import diagnose
from batchlab.distributed.launcher import check_world, nnodes_of, torchrun_command
from batchlab.distributed.merge import merge
from batchlab.measure.result import Outcome


def test_allreduce_time_is_the_union_of_bucket_intervals():
    # (0,1) and (0.5,2) overlap -> 2 s; (3,4) contains (3.2,3.5) -> 1 s
    u = UpdateComm(intervals=[(3.2, 3.5), (0.0, 1.0), (3.0, 4.0), (0.5, 2.0)])
    assert u.seconds() == pytest.approx(3.0)
    assert UpdateComm().seconds() == 0.0


def _rank(rank, samples, comm_s, tokens, peak):
    return dict(rank=rank, world=2, host="h", backend="gloo", device="cpu", torch="x", threads=1, warmup=1,
                samples=samples, cpu_seconds=[s / 2 for s in samples], useful_tokens=tokens,
                phase_seconds=[{"forward": s / 3, "backward": s / 3} for s in samples],
                comm=dict(calls=[2] * len(samples), rounds=[1] * len(samples), bytes=[100] * len(samples),
                          seconds=comm_s, last_micro_batch_only=True),
                memory=dict(peak_bytes=peak, activations_bytes=1, peak_phase="backward", breakdown={}, method="t"))


def test_merge_times_each_update_by_its_slowest_rank_and_sums_useful_tokens():
    cfg = RunConfig(dp=2, micro_batch=2, seq=32)
    r0 = _rank(0, [1.0, 4.0, 2.0], [0.1, 0.4, 0.2], [60, 60, 60], peak=500)
    r1 = _rank(1, [3.0, 2.0, 2.5], [0.3, 0.2, 0.5], [64, 64, 64], peak=700)
    m = merge(cfg, [r1, r0])
    assert m.time.samples == [3.0, 4.0, 2.5]
    assert m.comm.seconds == [0.3, 0.4, 0.5]  # the slowest rank's own split
    assert m.comm.compute_seconds == pytest.approx([2.7, 3.6, 2.0])
    assert m.useful_tokens_per_update == 124
    assert m.tokens_per_second == pytest.approx(124 / 3.0)  # median update time 3.0 s
    assert m.memory.peak_bytes == 700 and m.memory.per_rank_peak_bytes == [500, 700]
    assert m.memory.rank_spread_bytes == 200
    assert m.global_batch == 2 * 1 * 2 and m.comm.rounds_per_update == 1
    assert not any("exactly one" in w for w in m.warnings)


def test_merge_warns_when_a_rank_all_reduced_more_than_once_per_update():
    cfg = RunConfig(dp=2, micro_batch=2, seq=32, accum=2)
    r0, r1 = _rank(0, [1.0], [0.1], [10], 5), _rank(1, [1.0], [0.1], [10], 5)
    r1["comm"].update(rounds=[2], last_micro_batch_only=False)
    assert any("rank 1" in w and "exactly one" in w for w in merge(cfg, [r0, r1]).warnings)


def test_world_size_must_be_the_configs_dp():
    cfg = RunConfig(dp=4)
    check_world(cfg, 4, 1)
    check_world(cfg, 2, nnodes_of(["--nnodes", "2", "--node-rank", "1"]))
    with pytest.raises(ConfigError) as e:
        check_world(cfg, 2, 1)
    assert e.value.field == "dp"
    with pytest.raises(ConfigError) as e:
        nnodes_of(["--nnodes=1:4"])
    assert e.value.field == "nnodes"


def test_the_world_is_dp_x_tp_x_pp_and_nproc_derives_dp_over_it():
    from batchlab.cli.measure import dp_from_world

    cfg = RunConfig(tp=2, pp=2, accum=2)
    check_world(cfg, 4, 1)
    with pytest.raises(ConfigError) as e:
        check_world(cfg, 2, 1)
    assert e.value.field == "nproc" and "DP x TP x PP = 1 x 2 x 2 = 4 ranks" in str(e.value)
    assert dp_from_world(cfg, 8, None, frozenset()).dp == 2  # 8 ranks over replicas of tp x pp = 4
    with pytest.raises(ConfigError) as e:
        dp_from_world(cfg, 6, None, frozenset())
    assert e.value.field == "nproc"


def test_rank_coordinates_follow_torchs_row_major_mesh():
    """Rank r of a (pp, dp, tp) mesh sits where init_device_mesh puts it: torch.arange(world).view(pp, dp, tp)."""
    import torch

    from batchlab.distributed.mesh import coordinates

    layout = RunConfig(dp=2, tp=2, pp=2, accum=2).parallel
    grid = torch.arange(8).view(2, 2, 2)
    for r in range(8):
        c = coordinates(layout, r)
        assert int(grid[c["pp"], c["dp"], c["tp"]]) == r


def test_merge_reports_every_rank_with_its_coordinates_and_the_most_loaded_peak():
    cfg = RunConfig(tp=2, pp=2, accum=2)
    ranks = []
    for r, (pp, tp, peak) in enumerate([(0, 0, 300), (0, 1, 310), (1, 0, 200), (1, 1, 205)]):
        rec = _rank(r, [1.0 + r / 10, 1.1], [0.0, 0.0], [64, 64], peak)
        rec.pop("comm")
        rec.update(coordinates=dict(pp=pp, dp=0, tp=tp), parameter_shard_bytes=100 + pp)
        ranks.append(rec)
    m = merge(cfg, ranks)
    assert [(x.rank, x.pp, x.tp, x.peak_bytes) for x in m.ranks] == [(0, 0, 0, 300), (1, 0, 1, 310), (2, 1, 0, 200),
                                                                     (3, 1, 1, 205)]
    assert m.memory.peak_bytes == 310 and m.ranks[3].update_seconds_median == pytest.approx(1.2)
    assert m.traffic is None  # the formula's collectives are the DP engines'


def test_merge_says_a_tp_overlap_it_did_not_run():
    # --tp-overlap is formula only: the measured ranks run DTensor's collectives in the critical path
    cfg = RunConfig(tp=2, sequence_parallel=True, tp_overlap="async")
    ranks = []
    for r in range(2):
        rec = _rank(r, [1.0], [0.0], [64], 100)
        rec.pop("comm")
        rec.update(coordinates=dict(pp=0, dp=0, tp=r))
        ranks.append(rec)
    assert any(w.startswith("ignored: tp_overlap: async") for w in merge(cfg, ranks).warnings)
    plain = RunConfig(tp=2, sequence_parallel=True)
    assert not any("tp_overlap" in w for w in merge(plain, ranks).warnings)


def test_launch_refuses_a_mismatched_world_before_starting_anything():
    from batchlab.distributed import launch

    with pytest.raises(ConfigError) as e:
        launch(RunConfig(dp=2), nproc=3)
    assert e.value.field == "dp"


def test_ranks_are_forked_on_one_cpu_node_only_and_fork_elsewhere_is_refused():
    from batchlab.distributed import launch
    from batchlab.distributed.launcher import forkable
    from batchlab.measure.options import MeasureOptions

    cpu, multi = MeasureOptions(), ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h:29500"]
    assert forkable(RunConfig(dp=2), cpu, [])
    assert not forkable(RunConfig(dp=2), cpu, multi)
    assert not forkable(RunConfig(dp=2), MeasureOptions(torch_device="cuda"), [])
    assert not forkable(RunConfig(dp=2, device="h100"), cpu, [])  # the device's backend: CUDA
    for bad in (dict(opts=MeasureOptions(torch_device="cuda:0")), dict(torchrun_args=multi, nproc=1)):
        with pytest.raises(ConfigError) as e:
            launch(RunConfig(dp=2), launcher="fork", **bad)
        assert e.value.field == "launcher"
    with pytest.raises(ConfigError) as e:
        launch(RunConfig(dp=2), launcher="mpirun")
    assert e.value.field == "launcher" and "fork, torchrun" in e.value.message


def test_standalone_only_without_a_rendezvous_endpoint(tmp_path):
    single = torchrun_command(2, [], tmp_path / "s.json", tmp_path)
    assert "--standalone" in single and single[single.index("--nproc-per-node") + 1] == "2"
    multi = torchrun_command(4, ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h:29500"],
                             tmp_path / "s.json", tmp_path)
    assert "--standalone" not in multi and "--rdzv-endpoint" in multi
    assert multi[multi.index("-m", multi.index("--max-restarts")) + 1] == "batchlab.distributed"


def _write(tmp_path, name, obj):
    (tmp_path / name).write_text(json.dumps(obj) if not isinstance(obj, str) else obj)


def test_root_cause_is_the_killed_rank_not_the_peer_that_lost_it(tmp_path):
    for r in (0, 1):
        _write(tmp_path, f"rank{r}.pid", str(1000 + r))
    # rank 0 noticed its peer vanish and raised first-in-time; rank 1 was SIGKILLed and wrote nothing
    _write(tmp_path, "rank0.error.json", dict(rank=0, time=1.0, type="DistBackendError",
                                              message="Connection closed by peer", oom=None))
    log = f"rank      : 1 (local_rank: 1)\n  exitcode  : -{int(signal.SIGKILL)} (pid: 1001)\n"
    f = diagnose(tmp_path, 1, log)
    assert (f.outcome, f.rank) == (Outcome.FAILED, 1) and "SIGKILL" in f.reason
    assert f.detail.startswith("rank 1 (killed by SIGKILL")


def test_root_cause_prefers_a_ranks_own_error_and_keeps_oom_an_oom(tmp_path):
    for r in (0, 1, 2):
        _write(tmp_path, f"rank{r}.pid", str(1000 + r))
    _write(tmp_path, "rank0.error.json", dict(rank=0, time=2.0, type="DistBackendError",
                                              message="Connection reset by peer", oom=None))
    _write(tmp_path, "rank2.error.json", dict(rank=2, time=3.0, type="OutOfMemoryError",
                                              message="CUDA out of memory.", oom="device allocator"))
    # rank 1 ended by the SIGTERM torchrun sends to survivors: a consequence, not the cause
    log = f"rank      : 1 (local_rank: 1)\n  exitcode  : -{int(signal.SIGTERM)} (pid: 1001)\n"
    f = diagnose(tmp_path, 1, log)
    assert (f.outcome, f.rank) == (Outcome.OOM, 2)
    assert diagnose(tmp_path, None, log, timeout_s=5).reason.startswith("timeout after 5 s")


def test_pipelines_cut_llama_family_hf_models_and_refuse_other_classes_naming_pp():
    """A Hugging Face LlamaForCausalLM splits into stages holding its own parts; GPT-2 (no rotary embedding, no
    model.layers) is refused when the rank builds it, one ConfigError naming pp."""
    from batchlab.config import resolve_model
    from batchlab.distributed import measurable, pipeline
    from batchlab.models import build_workload

    def cfg_of(source, **shape):
        model, source = resolve_model(source, layers=2, hidden=64, heads=2, vocab=128, **shape)
        return RunConfig(model=model, model_source=source, seq=16, micro_batch=1, pp=2, accum=2)

    llama = cfg_of("hf:llama", kv_heads=1, ffn=128)
    measurable.check(llama)  # no longer refused before the ranks start
    model = build_workload(llama).model
    (first_index, first), = pipeline.split(model, llama, 0)
    (last_index, last), = pipeline.split(model, llama, 1)
    assert (first_index, last_index) == (0, 1)
    assert first.embed is model.model.embed_tokens and not hasattr(first, "head")
    assert last.head is model.lm_head and last.norm_f is model.model.norm and not hasattr(last, "embed")
    assert list(first.blocks) == [model.model.layers[0]] and list(last.blocks) == [model.model.layers[1]]
    gpt2 = cfg_of("hf:gpt2")
    with pytest.raises(ConfigError) as e:
        pipeline.split(build_workload(gpt2).model, gpt2, 0)
    assert e.value.field == "pp" and "\n" not in str(e.value.message)
