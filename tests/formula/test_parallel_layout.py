"""The formula per rank under tensor and pipeline parallelism, against numbers worked out by hand from the papers'
formulas (Korthikanti et al. 2022 Table 2; Narayanan et al. 2021's bubble; Megatron's parameter split)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from batchlab.cli import app
from batchlab.config import RunConfig, preset
from batchlab.formula import estimate
from batchlab.formula.activations import LayerActivations
from batchlab.formula.deepspeed import prefetch_buffers, resident_buffers, step_buffers
from batchlab.formula.ranks import share, shares, tp_layer_bytes

LLAMA = dict(model=preset("llama-2-7b"), device="h100", precision="bf16-mixed", micro_batch=1)


def korthikanti_parts(s: int, b: int, h: int, a: int) -> LayerActivations:
    """Megatron's layer as the paper lists it (sec. 4.1), in batchlab's parts: norms = both LayerNorm inputs (4sbh)
    + the QKV and MLP inputs they feed (2sbh each); masks = the two residual dropout masks (sbh each); qkv = Q, K
    (4sbh) and V (2sbh); scores = softmax output, dropout mask and output (5as²b); attn_out = projection input
    (2sbh); mlp = GELU input and output (8sbh each).  34sbh + 5as²b in all."""
    sbh, as2b = s * b * h, a * s * s * b
    return LayerActivations(norms=8 * sbh, qkv=6 * sbh, scores=5 * as2b, attn_out=2 * sbh, mlp=16 * sbh, masks=2 * sbh)


def test_korthikanti_table_2_at_t8_with_and_without_sequence_parallelism():
    # GPT-3 175B's layer: s 2048, b 1, h 12288, a 96 -> sbh = 25,165,824, as/h = 16
    parts = korthikanti_parts(2048, 1, 12288, 96)
    assert parts.total == 2048 * 12288 * (34 + 5 * 16)
    # no SP: sbh(10 + 24/8 + 5·16/8) = 23 sbh = 578,813,952
    assert tp_layer_bytes(parts, 8, sp=False) == 578_813_952
    # SP: sbh(34 + 5·16)/8 = 14.25 sbh = 358,612,992
    assert tp_layer_bytes(parts, 8, sp=True) == 358_612_992


def test_full_recompute_keeps_the_layer_input_split_only_with_sequence_parallelism():
    # llama-2-7b, seq 1024, bf16-mixed: the layer input is the fp32 residual, 1024 x 4096 x 4 = 16 MiB
    base = dict(LLAMA, seq=1024, accum=1, ac="full")
    assert set(estimate(RunConfig(**base, tp=2)).memory.activations_per_layer_bytes) == {16 * 2**20}
    assert set(estimate(RunConfig(**base, tp=2, sequence_parallel=True)).memory.activations_per_layer_bytes) == {
        8 * 2**20}


@pytest.mark.parametrize("schedule,in_flight,mib", [("1f1b", 4, 132), ("gpipe", 8, 264)])
def test_first_stage_holds_p_micro_batches_under_1f1b_and_all_m_under_gpipe(schedule, in_flight, mib):
    # pp 4 over 8 layers (2 a stage), accum 8, full AC: each layer keeps its 16 MiB input (seq 1024, fp32 residual),
    # and the stage its rotary cos and sin (1 x 1024 x 128 fp32: 0.5 MiB each), 33 MiB a micro-batch on stage 0
    # (no dropout: no embedding mask); 1F1B holds p = 4 of them, GPipe all 8
    cfg = RunConfig(**dict(LLAMA, model=preset("llama-2-7b", layers=8)), seq=1024, accum=8, ac="full", pp=4,
                    pp_schedule=schedule)
    first = estimate(cfg).memory.ranks[0]
    assert (first.stage, first.layers, first.in_flight) == (0, 2, in_flight)
    assert first.activations_bytes == mib * 2**20


def test_interleaving_shrinks_the_bubble_v_fold():
    # p 4, m 8: 1F1B (p-1)/(m+p-1) = 3/11; interleaved with v 2: (p-1)/(v·m+p-1) = 3/19
    base = dict(LLAMA, model=preset("llama-2-7b", layers=8), seq=1024, accum=8, pp=4)
    plain = estimate(RunConfig(**base)).time
    inter = estimate(RunConfig(**base, pp_schedule="interleaved-1f1b", pp_virtual=2)).time
    assert plain.bubble_fraction == pytest.approx(3 / 11) and inter.bubble_fraction == pytest.approx(3 / 19)
    # the bubble lasts (p-1) micro-batch times of the slowest stage, (p-1)/v with v chunks
    assert plain.bubble_seconds == pytest.approx(3 * max(plain.stage_seconds))
    assert inter.bubble_seconds == pytest.approx(1.5 * max(inter.stage_seconds))


def test_parameters_per_stage_add_up_to_the_model_plus_the_tied_copy():
    untied = estimate(RunConfig(**LLAMA, seq=1024, accum=4, pp=4))
    assert sum(r.parameters for r in untied.memory.ranks) == untied.params.total
    # GPT-2 ties its head to the embedding: the last stage holds a second copy, 50257 x 768 = 38,597,376
    tied = estimate(RunConfig(model=preset("gpt2"), seq=512, micro_batch=1, accum=2, pp=2))
    assert sum(r.parameters for r in tied.memory.ranks) == tied.params.total + 38_597_376


def test_a_tensor_parallel_rank_holds_the_split_matrices_over_t():
    # llama-2-7b per layer 4h² + 3hf + 2h = 202,383,360; the two RMSNorm weights (2h) stay whole:
    # (202,383,360 - 8192)/2 + 8192 = 101,195,776; x 32 layers + embedding and head (32000 x 4096 / 2 each)
    # + final norm 4096 = 3,369,340,928
    assert estimate(RunConfig(**LLAMA, seq=1024, tp=2)).memory.ranks[0].parameters == 3_369_340_928
    # GPT-2 layer 12h² + 13h = 7,087,872; TP 2: (12h² + 7h)/2 + 6h (two LayerNorms' weight and bias, the two
    # row-parallel biases) = 3,538,944 + 2,688 + 4,608 = 3,546,240
    gpt2 = RunConfig(model=preset("gpt2"), seq=512, micro_batch=1, tp=2)
    assert shares(gpt2)[0].per_layer == 3_546_240


def test_tensor_parallel_all_reduces_per_layer_per_micro_batch():
    # TP 2 over 32 layers, no recompute: all-reduces of b·s·h = 1 x 1024 x 4096 x 2 bytes = 8 MiB per layer per
    # micro-batch, forward 2 (the row-parallel outputs), backward 3 (DTensor: the input gradient of each
    # column-parallel linear, fused qkv, gate, up), + 2 at the vocabulary-parallel ends (the embedding's output, the
    # head's input gradient) and the loss's 3 of 1024 fp32 figures; ring 2(t-1)/t = 1 x bytes / 450 GB/s (h100
    # NVLink); 2 micro-batches
    t = estimate(RunConfig(**LLAMA, seq=1024, accum=2, tp=2)).time
    assert t.tp_comm_seconds == pytest.approx(2 * ((32 * 5 + 2) * 8 * 2**20 + 3 * 4096) / 450e9)


def test_one_rank_figures_are_one_stage_entry():
    e = estimate(RunConfig(**LLAMA, seq=1024, accum=2))
    (only,) = e.memory.ranks
    assert only.peak_bytes == e.memory.peak_bytes and only.parameters == e.params.total
    assert sum(only.parts.values()) == only.peak_bytes
    assert e.time.bubble_fraction == 0 and e.time.tp_comm_seconds == 0 and e.time.pp_comm_seconds == 0


def test_every_stage_parts_add_up_and_the_most_loaded_is_named():
    e = estimate(RunConfig(**LLAMA, seq=4096, accum=8, ac="full", tp=2, pp=2))
    for r in e.memory.ranks:
        assert sum(r.parts.values()) == r.peak_bytes
    assert e.memory.peak_bytes == max(r.peak_bytes for r in e.memory.ranks)
    # full recompute keeps little per micro-batch: the last stage's loss (loss_parallel's working set on the
    # logits' shard) and its stage outputs outweigh the first stage's second in-flight micro-batch
    worst = max(e.memory.ranks, key=lambda r: r.peak_bytes)
    assert worst.stage == 1 and e.memory.most_loaded.startswith("pipeline stage 1 (last")


def test_estimate_json_reports_the_layout_per_stage_and_the_bubble():
    r = CliRunner().invoke(app, ["estimate", "--model", "llama-2-7b", "--seq", "1024", "--micro-batch", "1",
                                 "--accum", "4", "--tp", "2", "--pp", "2", "--device", "h100", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["config"]["parallel"]["world_size"] == 4
    assert [s["stage"] for s in d["memory"]["ranks"]] == [0, 1]
    assert d["time"]["bubble_fraction"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1) = 1/5
    assert d["time"]["tp_comm_seconds"] > 0 and d["time"]["pp_comm_seconds"] > 0


@pytest.mark.parametrize("sharding,parts", [
    # llama-2-7b, 6,738,415,616 parameters over DP 8: the reduce bucket 5e8 elements x 2 bytes = 1e9 bytes
    # (stage 3 too: one flat ipg buffer, stage3.py _setup_for_real_optimizer); the fp32 gradient partition
    # 4 x N / 8 = 3,369,207,808 bytes at the step (stage 3: its one sub-group under sub_group_size 1e9, cast from
    # a 16-bit flat copy, 2 x N / 8 bytes); stage 3's gathered parameters (tests/formula/test_deepspeed_gather.py)
    ("deepspeed-zero1", {"deepspeed reduce bucket": 10**9, "deepspeed fp32 gradient partition": 3_369_207_808}),
    ("deepspeed-zero3", {"deepspeed reduce bucket": 10**9, "deepspeed live parameters": None,
                         "deepspeed fp32 gradient partition": 3_369_207_808,
                         "deepspeed 16-bit gradient flatten": 1_684_603_904}),
])
def test_deepspeed_buffers_at_its_config_defaults(sharding, parts):
    e = estimate(RunConfig(**LLAMA, seq=2048, accum=2, ac="full", dp=8, sharding=sharding))
    cfg, rank = e.config, share(e.config, 0)
    live = prefetch_buffers(cfg, rank)
    got = {**resident_buffers(cfg, rank), **step_buffers(cfg, rank), **live.get("backward", {})}
    assert {k: v for k, v in got.items() if parts[k] is not None} == {k: v for k, v in parts.items() if v is not None}
    if live:  # the prefetch runs ahead to stage3_max_live_parameters (1e9) and an on-demand fetch may come on top:
        # at most the limit, one bucket (5e7) and the largest module (the LM head, 32000 x 4096) in 16 bits
        for ph in ("forward", "backward"):
            assert 2 * 10**9 <= live[ph]["deepspeed live parameters"] <= 2 * (10**9 + 5 * 10**7 + 32000 * 4096)
    # each a part of its own at the peak; PyTorch's engine of the same stage has none of them
    assert {k for k in e.memory.at_peak if k.startswith("deepspeed")} == set(parts)
    assert sum(e.memory.at_peak.values()) == e.memory.peak_tensor_bytes
    pytorch = estimate(RunConfig(**LLAMA, seq=2048, accum=2, ac="full", dp=8, zero=int(sharding[-1])))
    assert not any(k.startswith("deepspeed") for k in pytorch.memory.at_peak)


def test_deepspeeds_reduce_bucket_is_its_configured_size_even_for_a_small_model():
    # stage_1_and_2.py backward(): torch.empty(int(self.reduce_bucket_size), dtype=self.dtype): 5e8 elements x 2 bytes
    # of fp16 = 1e9 bytes, though the built-in GPT has under a million parameters (stage 3: one such buffer); ZeRO-3
    # gathers all of them (the first prefetch, a 5e7-element bucket, scans the whole trace and marks each use, so
    # nothing is freed before its last one): the 16-bit model, 2 bytes each, at the loss
    from batchlab.formula.params import count

    cfg = RunConfig(seq=64, micro_batch=2, dp=2, sharding="deepspeed-zero3", precision="fp16-mixed", device="a100-80gb")
    rank = share(cfg, 0)
    assert resident_buffers(cfg, rank) == {"deepspeed reduce bucket": 10**9}
    assert prefetch_buffers(cfg, rank)["forward"] == {"deepspeed live parameters": 2 * count(cfg.model).total}


def test_deepspeed_zero1_sends_16_bit_gradients_and_weights_and_hides_none_of_it():
    # GPT-2 124,439,808 parameters (Hugging Face num_parameters()), fp16 under DeepSpeed, DP 2 on A100s' NVLink
    # (300 GB/s each way, the A100 datasheet): a reduce-scatter of the 16-bit gradients at the accumulation boundary
    # and an all-gather of the 16-bit weights after the step, each (n-1)/n x 248,879,616 B / 300 GB/s = 0.41480 ms
    # (nccl-tests PERFORMANCE.md); overlap_comm is off by default below stage 3, so nothing is hidden
    from batchlab.config import preset

    cfg = RunConfig(model=preset("gpt2"), seq=1024, micro_batch=4, accum=2, dp=2, sharding="deepspeed-zero1",
                    precision="fp16-mixed", device="a100-80gb")
    t = estimate(cfg).time
    assert t.collective_bytes["reduce_scatter"] == t.collective_bytes["all_gather"] == 248_879_616
    assert t.allreduce_seconds == pytest.approx(2 * 0.41480e-3, rel=1e-3)
    assert t.exposed_comm_seconds == pytest.approx(t.allreduce_seconds)


def test_deepspeed_zero2_keeps_no_reduce_stream_pool_at_its_default_config():
    # stage_1_and_2.py average_tensor: with overlap_comm off (its default below stage 3) the reduction runs on the
    # current stream, so no second stream's pool caches the gradient shards, as FSDP2's foreach_reduce stream does
    # (its 16-bit gradient partition is smaller than the fp32 shards FSDP2's pool would hold: the case it priced)
    ds = estimate(RunConfig(**dict(LLAMA, precision="fp16-mixed"), seq=2048, accum=2, dp=8,
                            sharding="deepspeed-zero2"))
    assert not [k for k in ds.memory.reserved_parts if "stream" in k]


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_pipelined_fsdp_holds_fp8_gathered_blocks_at_one_byte(schedule, virtual):
    """torchao's fp8 all-gather (enable_fsdp_float8_all_gather): fsdp_post_all_gather wraps the gathered fp8 bytes
    as the unsharded weight, so a pipeline stage that keeps its blocks gathered (reshard_after_forward=False, as
    torchtitan shards under a pipeline) holds them at 1 byte per element, as the unpipelined walk does.  By hand:
    16 Llama-3-8B blocks per stage of 218,112,000 parameters each, 2 bytes in bf16, 1 in fp8."""
    cfg = RunConfig(model=preset("llama-3-8b"), seq=4096, micro_batch=1, accum=4, dp=2, zero=2, pp=2,
                    pp_schedule=schedule, pp_virtual=virtual, precision="bf16-fsdp", device="h100-sxm", ac="full")
    bf16 = estimate(cfg.replace(fp8="tensorwise")).memory.ranks
    fp8 = estimate(cfg.replace(fp8="tensorwise-allgather")).memory.ranks
    assert [a.parts["parameters"] - b.parts["parameters"] for a, b in zip(bf16, fp8)] == [16 * 218_112_000] * 2
