"""What torch.distributed.pipelining's runtime leaves on a stage: the last stage's outputs (formula/pipeline.py
``keeps_outputs``), kept to the step's end by a torch whose ``schedule.step`` cannot drop them (before 2.10), only
the in-flight ones otherwise, checked by hand and against a live ``PipelineStage``; and FSDP2's gradient-shard pool,
empty while the stage's micro-batches run (formula/allocator.py ``gradient_shards_live``)."""
from __future__ import annotations

import pytest

from batchlab.config import Assumptions, RunConfig, preset
from batchlab.formula import estimate
from batchlab.formula.interleaved import steps


def _last_stage(schedule: str, **kw):
    cfg = RunConfig(model=preset("tiny"), seq=32, micro_batch=2, accum=4, pp=2, pp_schedule=schedule, **kw)
    return estimate(cfg).memory.ranks[-1]


def test_an_older_torch_keeps_every_micro_batchs_logits_on_the_last_stage():
    """1F1B, 2 stages, 4 micro-batches: the last stage runs F B F B ..., one micro-batch in flight; by its last
    backward it has made 4 outputs, each 32 x 2 tokens x the vocabulary in fp32 (CPU)."""
    logits = 32 * 2 * preset("tiny").vocab * 4
    now, old = _last_stage("1f1b"), _last_stage("1f1b", assumptions=Assumptions(torch_version="2.6"))
    assert now.parts["stage outputs"] == logits
    assert old.parts["stage outputs"] == 4 * logits
    assert old.peak_bytes - now.peak_bytes == 3 * logits


def test_gpipe_holds_them_all_in_flight_either_way():
    """GPipe's last stage holds all 4 micro-batches' outputs in flight at its first backward: nothing more kept."""
    old = _last_stage("gpipe", assumptions=Assumptions(torch_version="2.6"))
    assert _last_stage("gpipe").peak_bytes == old.peak_bytes


def test_interleaved_steps_count_each_chunks_forwards():
    """Rank 1 of 2, 2 chunks (stages 1 and 3), 4 micro-batches: every chunk ran 4 forwards by the step's end; the
    last chunk's fourth forward comes before its last backward."""
    order = steps(2, 2, 4, 1)
    assert order[-1].done == (4, 4)
    last_forward = max(i for i, s in enumerate(order) if s.chunk == 1 and not s.backward)
    assert order[last_forward].done[1] == 4 and order[last_forward].held[1] < 4


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_live_stage_keeps_each_output_unless_told_not_to(one_rank_group):
    """torch.distributed.pipelining itself: a one-stage pipeline (first and last) after ``step`` holds all m
    outputs in ``output_chunks``; ``return_outputs=False`` (torch 2.10) leaves none."""
    import torch
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage = PipelineStage(torch.nn.Linear(8, 16), 0, 1, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda y, t: (y - t).pow(2).mean())
    x, y = torch.randn(8, 8), torch.zeros(8, 16)
    schedule.step(x, target=y, losses=[])
    assert len(stage.output_chunks) == 4
    assert sum(o.untyped_storage().nbytes() for o in stage.output_chunks) == 4 * 2 * 16 * 4
    schedule.step(x, target=y, losses=[], return_outputs=False)
    assert stage.output_chunks == []


def _stage0_shard_bytes() -> int:
    """Stage 0 of tiny over 2 stages (embedding, learned positions, 2 blocks) by hand: its FSDP2 gradient shard on
    one of 2 ranks, reduced in fp32."""
    h, f, v, pos = 128, 512, 512, 256
    block = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)  # 2 norms, qkv, proj, fc1, fc2
    return (v * h + pos * h + 2 * block) // 2 * 4  # 989,696


def test_the_last_updates_gradient_shards_stay_reserved_while_the_micro_batches_run():
    """FSDP2 (ZeRO-2) under a 2-stage 1F1B pipeline on a GPU: no reduce-scatter runs before the update's last
    backward, so every peak inside the micro-batches leaves the whole of the last update's gradient shards (freed by
    zero_grad into the reduce-scatter stream's pool) reserved and empty; without a pipeline this update's shards
    refill that pool as each block's backward reduce-scatters.  With ``zero_grad(set_to_none=False)`` the shards
    stay live, zeroed in place, in the pool's blocks: counted once, as gradients, and the pool adds nothing."""
    part = "last update's gradient shards, cached in the reduce-scatter stream's pool"
    for pp, to_none, pooled, live in ((2, True, _stage0_shard_bytes(), 0), (1, True, 0, None),
                                      (2, False, 0, _stage0_shard_bytes())):
        cfg = RunConfig(model=preset("tiny"), seq=256, micro_batch=4, accum=2, pp=pp, pp_schedule="1f1b", dp=2,
                        zero=2, precision="bf16-fsdp", device="h100-sxm",
                        assumptions=Assumptions(zero_grad_set_to_none=to_none))
        mem = estimate(cfg).memory
        assert mem.at_peak["activations"] > 0
        assert mem.reserved_parts.get(part, 0) == pooled
        if live is not None:  # stage 0's first backward: none of this update's gradients made yet
            assert mem.most_loaded.startswith("pipeline stage 0") and mem.at_peak["gradients"] == live


def test_before_torch_2_8_every_stage_keeps_its_outputs_to_the_steps_end():
    """pytorch PR 153383 (torch 2.8) stopped the other stages appending to ``output_chunks``.  1F1B, 2 stages, 8
    micro-batches: stage 0 holds 2 in flight, but by its last steady backward it has sent on 8 outputs of
    32 x 2 tokens x hidden in fp32 (CPU), which an older torch keeps."""
    hidden = 32 * 2 * preset("tiny").hidden * 4

    def first_stage(version):
        cfg = RunConfig(model=preset("tiny"), seq=32, micro_batch=2, accum=8, pp=2, pp_schedule="1f1b",
                        assumptions=Assumptions(torch_version=version))
        return estimate(cfg).memory.ranks[0].parts

    assert first_stage("2.7")["stage outputs"] == 8 * hidden
    assert first_stage("2.8")["stage outputs"] == first_stage(None)["stage outputs"] == 2 * hidden


def test_the_estimate_says_which_stages_keep_their_outputs():
    """The notes name the rule the count used: every stage before 2.8, the last before 2.10, and on a current torch
    that a plain ``step()`` would still keep the last stage's; nothing without a pipeline."""
    from batchlab.formula import training_loop_notes

    def notes(version, pp=2):
        return " ".join(training_loop_notes(RunConfig(model=preset("tiny"), pp=pp, accum=4,
                                                      assumptions=Assumptions(torch_version=version))))

    assert "every stage of the pipeline keeps" in notes("2.7")
    assert "the last stage of the pipeline keeps" in notes("2.9")
    assert "return_outputs=False" in notes(None) and "keeps all" in notes("2.10")
    assert notes(None, pp=1) == ""
