"""ZeRO 0-3 on PyTorch's engines (DDP, DDP + ZeroRedundancyOptimizer, FSDP2): per-rank memory against the
formula, every collective counted against the formula, parameters against DDP's.

The launch runs tiny shapes (2 ranks, gloo), every stage in one job, shared.
"""
from __future__ import annotations

import pytest

from batchlab.config import RunConfig, preset
from batchlab.formula import estimate
from batchlab.formula.params import count
from batchlab.formula.sharding import traffic, unsharded_gradient_bytes

# micro-batch 4 x seq 64: one FSDP2 block (0.76 MiB, by which the peak moves between runs as gloo's threads
# free buffers) stays under 4% of the peak
TINY = RunConfig(model=preset("tiny"), dp=2, micro_batch=4, seq=64)


# -- formula, by hand (no processes)
def test_zero3_traffic_is_two_gathers_and_one_reduce_scatter_per_micro_batch():
    # tiny's parameters by hand: 512 x 128 token + 256 x 128 position embeddings (98,304), 4 layers of 198,272
    # (two LayerNorms 512, qkv 128 x 384 + 384, proj 128 x 128 + 128, fc 128 x 512 + 512, fc-proj 512 x 128 + 128),
    # the final LayerNorm 256, the head tied: 891,648; every first dimension is even, so no FSDP2 padding
    n = 891_648
    t = traffic(TINY.replace(zero=3, accum=4))
    assert t.per_micro_batch == tuple(dict(all_gather=2 * 4 * n, reduce_scatter=4 * n, all_reduce=0, broadcast=0)
                                      for _ in range(4))
    assert traffic(TINY.replace(zero=2, accum=4)).per_update["all_gather"] == 4 * 4 * n
    ddp = traffic(TINY.replace(zero=1, accum=4))  # no_sync: one all-reduce; then ZeRO-1's broadcasts
    assert ddp.per_micro_batch[-1]["all_reduce"] == 4 * n and ddp.per_update == dict(
        all_gather=0, reduce_scatter=0, all_reduce=4 * n, broadcast=4 * n)
    # set_requires_gradient_sync(False): one reduce-scatter per update, an unsharded gradient kept per rank
    lazy = traffic(TINY.replace(zero=3, accum=4), sync_every_micro_batch=False)
    assert lazy.per_update["reduce_scatter"] == 4 * n
    assert unsharded_gradient_bytes(TINY.replace(zero=3, accum=4)) == 4 * n


def test_zero3_pays_its_gathers_at_every_micro_batch_in_the_time_model():
    """Issue 11 item 8: at accum 32 ZeRO-3 sends 32 x 3 parameter volumes, ZeRO-1 two; fit must see it.
    Whether the update gets slower is the engine's overlap (formula/efficiency.py): within a node at seq 4096
    FSDP2's prefetch hides the gathers behind compute; across nodes at seq 512 they outlast it."""
    big = RunConfig(model=preset("llama-2-7b"), seq=4096, micro_batch=1, accum=32, dp=8, device="h100-sxm",
                    precision="bf16-mixed")
    z1, z3 = estimate(big.replace(zero=1)).time, estimate(big.replace(zero=3)).time
    assert z3.allreduce_seconds > 10 * z1.allreduce_seconds
    assert z3.exposed_comm_seconds < 0.1 * z3.allreduce_seconds < z3.compute_seconds
    short = big.replace(seq=512, dp=64)
    s1, s3 = estimate(short.replace(zero=1)).time, estimate(short.replace(zero=3)).time
    assert s3.exposed_comm_seconds > s3.allreduce_seconds - s3.compute_seconds > 0
    assert s3.update_seconds > s1.update_seconds


def test_zero1_mixed_assumptions_say_where_pytorchs_engine_differs():
    """The formula counts ZeRO-1 as the paper does; under autocast PyTorch's engine replicates fp32 weights
    and gradients, and the estimate says so (only then)."""
    mixed = RunConfig(model=preset("tiny"), dp=2, zero=1, precision="bf16-mixed")
    note = [a for a in estimate(mixed).assumptions if "ZeroRedundancyOptimizer under autocast" in a]
    assert len(note) == 1 and "fp32 weights and gradients on every rank" in note[0]
    for other in (mixed.replace(precision="fp32"), mixed.replace(zero=3), mixed.replace(zero=0)):
        assert not any("under autocast" in a for a in estimate(other).assumptions)


def test_sharding_names_are_the_zero_stages_and_a_contradiction_is_refused():
    from batchlab.cli.common import build_config
    from batchlab.config import ConfigError

    assert [build_config(sharding=name, dp=2).zero for name in ("ddp", "zero1", "fsdp-grad-op", "fsdp")] == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="sharding"):
        build_config(sharding="fsdp", zero=1, dp=2)


def test_scope_says_what_gloo_cannot_tell_about_sharding_on_nccl():
    from batchlab.experiment.scope import scope

    changed = scope(TINY, TINY.replace(zero=3), {"cpu"}, True, None)
    assert any("ZeRO/FSDP measured on gloo" in line and "NCCL" in line for line in changed)
    assert not any("ZeRO/FSDP" in line for line in scope(TINY, TINY.replace(micro_batch=2), {"cpu"}, True, None))


# -- measured: every stage for two shapes in ONE 2-rank job (distributed.equivalence.check_shapes:
# parameters, memory by the measurement's tracker, collectives); an FSDP2 measurement itself (run_rank + merge)
# runs in test_distributed's torchrun job, whose ranks have torch and torch._dynamo imported already
ACCUM = TINY.replace(accum=2, micro_batch=1, seq=32)  # accumulation; dropout on: the masks must match too


@pytest.fixture(scope="module")
def shapes():
    from batchlab.distributed.equivalence import check_shapes

    return dict(zip(("tiny", "accum"), check_shapes((TINY, ACCUM), (1, 2, 3))))


@pytest.mark.distributed
@pytest.mark.slow
def test_per_rank_peak_falls_with_the_stage_and_the_formula_is_within_3_percent(shapes):
    stages = shapes["tiny"]
    peaks = [stages.memory[z]["peak_bytes"] for z in range(4)]
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3], peaks
    for z in range(4):
        predicted = estimate(TINY.replace(zero=z)).memory.peak_tensor_bytes
        assert abs(predicted - peaks[z]) <= 0.03 * peaks[z], (z, predicted, peaks[z])


@pytest.mark.distributed
@pytest.mark.slow
def test_collectives_counted_on_the_process_group_equal_the_formula(shapes):
    stages = shapes["tiny"]
    for z in range(4):
        predicted = traffic(TINY.replace(zero=z))
        assert stages.traffic[z]["per_update"] == predicted.per_update, z
        assert stages.traffic[z]["per_micro_batch"] == list(predicted.per_micro_batch), z
    assert stages.traffic[1]["calls_per_update"]["broadcast"] > 0  # ZeroRedundancyOptimizer's, after step
    n = count(TINY.model).total  # by hand: DDP all-reduces every fp32 gradient once; FSDP2 gathers each twice
    assert stages.traffic[0]["per_update"]["all_reduce"] == 4 * n
    assert stages.traffic[3]["per_update"]["all_gather"] == 2 * 4 * n


@pytest.mark.distributed
@pytest.mark.slow
def test_zero_1_2_3_parameters_equal_ddp_after_two_updates(shapes):
    from batchlab.distributed.equivalence import ATOL

    stages, check = shapes["tiny"], shapes["accum"]
    assert stages.equal, stages.text
    assert set(stages.max_abs_difference) == {1, 2, 3} and stages.tolerance == ATOL
    assert check.equal, check.text
    # each micro-batch's collectives as the formula says: DDP no_sync (one all-reduce, in the last
    # micro-batch), FSDP2 all-gathers and reduce-scatters in every micro-batch
    for z, seen in check.traffic.items():
        predicted = traffic(ACCUM.replace(zero=z))
        assert seen["per_micro_batch"] == list(predicted.per_micro_batch), z
        assert seen["per_update"] == predicted.per_update, z


@pytest.mark.distributed
@pytest.mark.slow
def test_compares_semantics_panel_runs_the_zero_check_for_a_stage_change(shapes, monkeypatch):
    """The panel calls same_parameters_as_ddp on a small fp32 2-rank copy of A; its verdict (here the real one
    of the shared job, whose shape the call must ask for) is what the panel says."""
    from batchlab.distributed import equivalence
    from batchlab.experiment.semantics import CheckKind, semantics

    asked = []

    def same_parameters_as_ddp(a, b):
        asked.append((a, b))
        return shapes["accum"]

    monkeypatch.setattr(equivalence, "same_parameters_as_ddp", same_parameters_as_ddp)
    a = TINY.replace(dp=4, accum=4, micro_batch=1, precision="bf16-mixed", seq=128)
    out = semantics(a, a.replace(zero=3))
    (small_a, small_b), = asked
    assert small_a == ACCUM.replace(zero=0) and small_b == ACCUM.replace(zero=3)
    check = out["gradient_check"]
    assert check["kind"] == CheckKind.ZERO.value and check["ran"] and check["passed"]
    assert "equal to DDP's" in check["detail"] and "no gradient equivalence" not in check["detail"]
    item = next(i for i in out["items"] if i["name"] == "sharding (ZeRO stage)")
    assert item["touched"] and item["verified"].startswith("verified: ")
    assert semantics(a.replace(dp=1), a.replace(dp=1, zero=3))["gradient_check"]["kind"] == CheckKind.NONE.value


@pytest.mark.parametrize("zero", [1, 3])
def test_the_engine_snippet_runs_as_printed(monkeypatch, zero):
    """One process (world 1, gloo): the printed code builds its engine and takes an update."""
    import torch
    import torch.distributed as dist

    from batchlab.distributed.sharding import engine_snippet
    from batchlab.models.gpt import GPT

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    from batchlab.host import free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # a fixed port collides with another suite on the machine
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = TINY.replace(dp=2, zero=zero, accum=2, seq=16, micro_batch=1)
    model = GPT(cfg.model)
    batch = [(torch.randint(0, cfg.model.vocab, (1, 16)),) * 2] * 2
    before = [p.detach().clone() for p in model.parameters()]
    env = dict(model=model, blocks=model.blocks, loader=[batch])
    try:
        exec(engine_snippet(cfg), env)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    after = [getattr(p, "full_tensor", lambda: p)() for p in model.parameters()]
    assert any(not torch.equal(a.detach(), b) for a, b in zip(after, before))


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_trace_runs_rank_0_of_a_sharded_world_in_one_process(zero):
    """estimate --trace with --dp/--zero: FSDP2 / ZeroRedundancyOptimizer on a fake process group."""
    from batchlab import trace

    cfg = TINY.replace(zero=zero)
    t = trace.estimate(cfg)
    n = count(cfg.model).total
    assert t.memory.optimizer_bytes == 8 * n // 2  # AdamW's m and v, this rank's half
    assert t.memory.parameters_bytes == (4 * n // 2 if zero == 3 else 4 * n)
    predicted = estimate(cfg).memory.peak_tensor_bytes
    assert abs(predicted - t.memory.peak_bytes) <= 0.03 * t.memory.peak_bytes
    assert any("fake process group" in note for note in t.notes)
