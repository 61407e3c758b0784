"""The time terms of tensor and pipeline layouts: what each rank sends per micro-batch, from the catalogue
(config.engines), priced as a latency per message plus bytes over the link.  References: Shoeybi et al. 2019 and
Korthikanti et al. 2022 sec. 4.2.2 for the per-layer collectives, and the collectives a real run issued
(DTensor's functional collectives of one update, counted on rank 0 of a fake process group with real tiny
tensors: the built-in GPT and a Hugging Face Llama)."""
from __future__ import annotations

import dataclasses

import pytest

from batchlab.config import RunConfig
from batchlab.config.engines import TENSOR_PARALLEL
from batchlab.formula.pipeline import Link, pp_seconds, pp_sends, tp_collectives, tp_seconds
from batchlab.formula.ranks import shares

TINY = dict(seq=64, micro_batch=4, accum=4)  # the built-in GPT: 4 layers, h 128, vocabulary 512, LayerNorm with biases
BSH = 4 * 64 * 128 * 4  # b·s·h fp32 bytes: 131,072
BS = 4 * 64 * 4  # one fp32 figure per token: the vocabulary-parallel loss's max, sum of exponentials, target logit
SMALL = "--seq 16 --micro-batch 2 --accum 2 --hidden 32 --heads 4 --vocab 64 --tp 2 "


def _per_layer(sp: bool) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for c in TENSOR_PARALLEL[sp].per_layer:
        out[(c.kind, c.phase)] = out.get((c.kind, c.phase), 0) + c.count
    return out


def test_forward_per_layer_is_korthikanti_with_and_without_sequence_parallelism():
    # Korthikanti et al. 2022 sec. 4.2.2: forward, 2 all-gathers + 2 reduce-scatters with SP where Megatron's
    # tensor parallelism has 2 all-reduces
    plain, sp = _per_layer(False), _per_layer(True)
    assert {k: v for k, v in plain.items() if k[1] == "forward"} == {("all_reduce", "forward"): 2}
    assert {k: v for k, v in sp.items() if k[1] == "forward"} == {("all_gather", "forward"): 2,
                                                                    ("reduce_scatter", "forward"): 2}
    # DTensor's backward: one all-reduce per column-parallel linear (the GPT's fused qkv and up: 2, as Megatron's f)
    cfg = RunConfig(**TINY, tp=2, model=dataclasses.replace(RunConfig().model, layers=1))
    assert tp_collectives(cfg, shares(cfg)[0])[("all_reduce", "backward")][0] == 2 + 1  # + the head's input


def test_separate_qkv_and_a_gated_mlp_all_reduce_each_linears_input_gradient():
    # Llama's layer: q, k, v, gate, up column-parallel: 5 backward all-reduces a layer (Megatron's f: 2); forward
    # 2 (o_proj, down_proj), as the GPT's
    llama = config("--model hf:llama --layers 2 --hidden 128 --heads 4 --kv-heads 2 --ffn 256 --vocab 512 --seq 64 "
                   "--micro-batch 4 --accum 2 --tp 2 --pp 2")
    middle = tp_collectives(llama, shares(llama)[1])  # the last stage: layer 1, the head and the loss
    assert middle == {("all_reduce", "forward"): (2 + 3, 2 * BSH + 3 * BS),
                      ("all_reduce", "backward"): (5 + 1, 6 * BSH)}


def test_a_middle_stage_sends_only_its_layers_collectives():
    # PP 4 x TP 2 over 8 layers: stage 1 holds layers 2-3, no embedding or head: 2 layers x 4 collectives of b·s·h
    cfg = RunConfig(**TINY, model=dataclasses.replace(RunConfig().model, layers=8), tp=2, pp=4)
    middle = shares(cfg)[1]
    assert tp_collectives(cfg, middle) == {("all_reduce", "forward"): (4, 4 * BSH),
                                           ("all_reduce", "backward"): (4, 4 * BSH)}


def config(flags: str) -> RunConfig:
    from batchlab.cli.common import config_from_command

    return config_from_command(["estimate", *flags.split()])


def _live_all_reduces(cfg: RunConfig, monkeypatch) -> dict[int, int]:
    """{bytes: calls} of DTensor's all-reduces in one micro-batch of rank 0 (a fake process group, real tensors)."""
    import torch
    import torch.distributed._functional_collectives as funcol

    from batchlab.distributed import layouts
    from batchlab.trace.sharded import fake_world

    seen: dict[int, int] = {}

    def counted(t, *args, **kwargs):
        n = t.numel() * t.element_size()
        seen[n] = seen.get(n, 0) + 1
        return real(t, *args, **kwargs)

    real = funcol.all_reduce
    with fake_world(cfg.parallel.world_size, 0):
        trainer, _ = layouts.build(cfg, torch.device("cpu"), 0)
        monkeypatch.setattr(funcol, "all_reduce", counted)  # DTensor's redistributions and loss_parallel call it
        trainer.update()
    return {n: c // cfg.accum for n, c in seen.items()}


@pytest.mark.parametrize("flags, whole", [
    ("--layers 2", 2 * (2 + 2) + 2),  # GPT: per layer 2 row-parallel outputs + qkv's and up's input gradients
    ("--layers 1 --model hf:llama --kv-heads 2 --ffn 64", 2 + 5 + 2),  # q, k, v, gate, up: 5 input gradients
])
def test_the_all_reduces_a_real_tensor_parallel_update_issues(flags, whole, monkeypatch):
    # + the embedding's output and the head's input gradient (whole); the loss's 3 of one fp32 figure a token
    cfg = config(SMALL + flags)
    bsh, bs = 2 * 16 * 32 * 4, 2 * 16 * 4
    assert _live_all_reduces(cfg, monkeypatch) == {bsh: whole, bs: 3}
    got = tp_collectives(cfg, shares(cfg)[0])
    assert {kind for kind, _ in got} == {"all_reduce"}
    assert sum(c for c, _ in got.values()) == whole + 3 and sum(b for _, b in got.values()) == whole * bsh + 3 * bs


def test_the_collectives_a_real_tensor_parallel_run_issued():
    # counted on 2 gloo ranks, per micro-batch: 18 all-reduces of b·s·h (4 per layer, the vocabulary-parallel
    # embedding's output, the column-parallel head's input gradient) and the loss's 3 of b·s fp32
    cfg = RunConfig(**TINY, tp=2)
    got = tp_collectives(cfg, shares(cfg)[0])
    assert sum(c for c, _ in got.values()) == 21 and sum(b for _, b in got.values()) == 18 * BSH + 3 * BS


def test_the_collectives_a_real_sequence_parallel_run_issued():
    # counted on 2 gloo ranks, per micro-batch: 18 all-gathers and 9 reduce-scatters of b·s·h, 8 all-reduces of
    # b·s·h (each layer's 2 column-parallel inputs' gradients), 18 all-reduces of one norm tensor's gradient
    # (h fp32 = 512 bytes: 9 LayerNorms x weight and bias), the loss's 3 of b·s fp32
    cfg = RunConfig(**TINY, tp=2, sequence_parallel=True)
    got = tp_collectives(cfg, shares(cfg)[0])
    by_kind: dict[str, list[int]] = {}
    for (kind, _), (calls, nbytes) in got.items():
        c = by_kind.setdefault(kind, [0, 0])
        c[0] += calls
        c[1] += nbytes
    assert by_kind == {"all_gather": [18, 18 * BSH], "reduce_scatter": [9, 9 * BSH],
                       "all_reduce": [30, 9 * BSH + 18 * 512 + 3 * BS]}


def test_each_collective_pays_its_ring_messages_and_bytes():
    link = Link(1e9, 1e-4, "hand")
    plain = RunConfig(**TINY, tp=2)
    # 18 all-reduces over 2 ranks: 2(t-1)/t x 131,072 B / 1 GB/s + 2(t-1) = 2 messages of 100 us each; the loss's
    # 3 of 1,024 B
    loss = 3 * (1024e-9 + 2e-4)
    assert tp_seconds(plain, shares(plain)[0], link) == pytest.approx(18 * (131072e-9 + 2e-4) + loss)
    sp = RunConfig(**TINY, tp=2, sequence_parallel=True)
    # all-gather and reduce-scatter: (t-1)/t of the bytes, t-1 = 1 message; the norms' all-reduces of 512 B
    expected = 27 * (65536e-9 + 1e-4) + 9 * (131072e-9 + 2e-4) + 18 * (512e-9 + 2e-4) + loss
    assert tp_seconds(sp, shares(sp)[0], link) == pytest.approx(expected)


def test_interleaving_sends_at_every_chunk_boundary():
    # PP 2: 1F1B, each stage one send a micro-batch (stage 0 its output, stage 1 its input gradient); interleaved
    # with 2 chunks per rank, 4 stages: rank 0 holds stages 0 and 2 (sends 0->1, 2->3 forward, 2->1 back), rank 1
    # stages 1 and 3 -- counted on a real run: 4 and 12 sends an update of 4 micro-batches from rank 0
    one = RunConfig(**TINY, pp=2)
    inter = RunConfig(**TINY, pp=2, pp_schedule="interleaved-1f1b", pp_virtual=2)
    assert [pp_sends(one, r) for r in shares(one)] == [1, 1]
    assert [pp_sends(inter, r) for r in shares(inter)] == [3, 3]
    link = Link(1e9, 1e-4, "hand")
    # 3 sends of 131,072 B and 3 receives posted, one message each
    assert pp_seconds(inter, shares(inter)[0], link) == pytest.approx(3 * (1e-4 + 131072e-9) + 3 * 1e-4)


def test_the_compare_verdict_names_the_bubble_and_what_moved_it():
    # p 4: (p-1)/(m+p-1) = 3/7 = 43% at m 4, 3/11 = 27% at m 8; interleaved, 2 chunks: 3/(2·8+3) = 16%
    from batchlab.formula.pipeline import bubble_change

    base = dict(seq=64, micro_batch=1, pp=4, model=dataclasses.replace(RunConfig().model, layers=8))
    m4, m8 = RunConfig(**base, accum=4), RunConfig(**base, accum=8)
    assert bubble_change(m4, m8) == ("the bubble falls from 43% to 27%: accumulation (micro-batches per flush, "
                                     "4 -> 8) shrinks it")
    gpipe = RunConfig(**base, accum=4, pp_schedule="gpipe")
    assert bubble_change(gpipe, m4).startswith("the bubble stays at 43%: 1F1B and GPipe keep the same bubble")
    inter = RunConfig(**base, accum=8, pp_schedule="interleaved-1f1b", pp_virtual=2)
    assert bubble_change(m8, inter) == "the bubble falls from 27% to 16%: 2 chunks per rank divide it by 2"
    assert bubble_change(RunConfig(**TINY), RunConfig(**dict(TINY, accum=8))) == ""  # no pipeline: no clause


def test_explain_says_what_accumulation_means_in_a_pipeline():
    # p 4, 1F1B, m 4 micro-batches per flush: bubble (p-1)/(m+p-1) = 3/7 = 42.9%
    from batchlab.formula.explain import explain_sections

    cfg = RunConfig(seq=64, micro_batch=1, accum=4, pp=4, model=dataclasses.replace(RunConfig().model, layers=8))
    text = " ".join(" ".join(s.lines) for s in explain_sections(cfg))
    assert "accum = 4 is the micro-batches of one pipeline flush" in text
    assert "a bubble of 42.9% of the update" in text and "interleaving v chunks per rank divides it by v" in text


def test_local_tensor_parallel_ranks_pay_the_calibrated_link_per_message():
    # a CPU host whose gloo link was calibrated at 1 GB/s + 20 us per message: TP 2's 18 all-reduces per micro-batch
    # each pay 131,072 B / 1 GB/s and 2 messages, the loss's 3 1,024 B and 2 messages; 4 micro-batches.  The 2 ranks
    # are the host's local ranks.
    from batchlab.formula import flops, memory, timing
    from batchlab.formula.opcost import OpCosts

    costs = OpCosts(matmul={"fp32": ((1.0, 1e10),)}, memory=((1.0, 1e10),), strided_bytes_per_s=5e9,
                    element_seconds={}, dispatch={"forward": 5e-6, "backward": 5e-6, "plain": 5e-6}, threads=1,
                    cores=2, link_bytes_per_s=1e9, link_latency_s=2e-5)
    cfg = RunConfig(**TINY, tp=2)
    t = timing(cfg, flops(cfg), memory(cfg), costs)
    assert t.tp_comm_seconds == pytest.approx(4 * (18 * (131072e-9 + 2 * 2e-5) + 3 * (1024e-9 + 2 * 2e-5)))
    assert "2 local rank(s) x 1 thread(s) on 2 cores" in t.model and "20 us per message" in t.model


def test_ranks_that_time_share_the_cores_pay_each_message_at_the_shared_speed():
    # the same host (2 cores, 1 GB/s + 20 us per message calibrated with a core per rank), now TP2 x DP2: 4 ranks of
    # 1 thread, 2 a core, so each rank's part of a message (wake-up, syscalls, copies) takes twice as long: per
    # micro-batch 18 all-reduces of 131,072 B at 0.5 GB/s + 2 messages of 40 us, the loss's 3 of 1,024 B
    from batchlab.formula import flops, memory, timing
    from batchlab.formula.opcost import OpCosts

    costs = OpCosts(matmul={"fp32": ((1.0, 1e10),)}, memory=((1.0, 1e10),), strided_bytes_per_s=5e9,
                    element_seconds={}, dispatch={"forward": 5e-6, "backward": 5e-6, "plain": 5e-6}, threads=1,
                    cores=2, link_bytes_per_s=1e9, link_latency_s=2e-5)
    cfg = RunConfig(**TINY, tp=2, dp=2)
    t = timing(cfg, flops(cfg), memory(cfg), costs)
    assert t.tp_comm_seconds == pytest.approx(4 * (18 * (2 * 131072e-9 + 2 * 4e-5) + 3 * (2 * 1024e-9 + 2 * 4e-5)))
    assert "40 us per message" in t.model and "x2 with the local ranks time-sharing the cores" in t.model


def test_ranks_that_time_share_the_cores_fill_each_others_bubble():
    # a stage's micro-batch: 10 ms of compute + 1 ms of messages, both at the shared speed.  p 2, m 8 (bubble 1/9):
    # alone, (m + p - 1) x 11 = 99 ms; 2 ranks a core: the critical path at a core's whole speed, 9 x 5.5 = 49.5 ms,
    # is shorter than m busy micro-batches, 8 x 11 = 88 ms, which the update then takes
    from batchlab.formula.pipeline import PipelineTime, StageTime

    stage = StageTime(stage=0, compute_seconds=8e-3, tp_comm_seconds=0.5e-3, pp_comm_seconds=0.5e-3,
                      dtensor_seconds=2e-3)
    one = PipelineTime(stages=(stage,), micro_batches=8, bubble_fraction=1 / 9, slowest=0)
    assert one.seconds == pytest.approx(99e-3)
    assert dataclasses.replace(one, time_shared=2.0).seconds == pytest.approx(88e-3)
    # p 4, m 2 (bubble 3/5): the path, 5 x 5.5 = 27.5 ms, is the longer
    few = PipelineTime(stages=(stage,), micro_batches=2, bubble_fraction=3 / 5, slowest=0, time_shared=2.0)
    assert few.seconds == pytest.approx(27.5e-3)


@pytest.mark.parametrize("flags, rank, tensors", [
    # TP2 x DP2, the GPT: a layer's 4 linears and 2 LayerNorms with biases (12) x 2, the embedding, the positions,
    # the final LayerNorm's 2 (the head tied)
    (SMALL + "--layers 2 --dp 2", 0, 2 * 12 + 4),
    # PP2 x DP2, Llama's last stage: its layer's 7 linears and 2 RMSNorms, the final norm, the untied head
    (SMALL + "--layers 2 --dp 2 --tp 1 --pp 2 --model hf:llama --kv-heads 2 --ffn 64", 2, 9 + 2),
])
def test_a_layouts_data_parallel_all_reduces_are_one_per_parameter_tensor(flags, rank, tensors):
    # counted on a real update (rank ``rank`` of a fake world, distributed/traffic.py's counter): all-reduces over
    # the data-parallel group after the last backward, one-element ones (token count, norms) apart
    import torch

    from batchlab.distributed import layouts
    from batchlab.distributed.traffic import TrafficCounter
    from batchlab.formula.pipeline import gradient_reductions
    from batchlab.trace.sharded import _static_shapes, fake_world

    cfg = config(flags)
    with fake_world(cfg.parallel.world_size, rank):
        trainer, _ = layouts.build(cfg, torch.device("cpu"), rank)
        if cfg.parallel.pipelined:
            _static_shapes(trainer.schedule, trainer.stages)
        trainer.update()
        counter = TrafficCounter()
        with counter:
            trainer.update(listener=counter)
    live = sum(c.kind == "all_reduce" and c.phase == "optimizer" for c in counter.calls)
    stage = rank // (cfg.parallel.dp * cfg.parallel.tp)
    assert gradient_reductions(cfg, shares(cfg)[stage]) == live == tensors


def test_every_functional_collective_of_a_real_sequence_parallel_update_is_priced_as_a_redistribution():
    # DTensor issues each TP collective as a functional collective (its redistributions, loss_parallel's, the
    # norms' gradients'): those of one real update on rank 0, as the profiler records them at the dispatcher
    # (the ones DTensor issues inside its own dispatch included), are the redistributions formula/dtensor.py prices
    import torch
    from torch.profiler import profile

    from batchlab.distributed import layouts
    from batchlab.formula.dtensor import redistributions
    from batchlab.trace.sharded import fake_world

    cfg = config(SMALL + "--layers 1 --accum 1 --sequence-parallel")
    with fake_world(cfg.parallel.world_size, 0):
        trainer, _ = layouts.build(cfg, torch.device("cpu"), 0)
        with profile() as prof:
            trainer.update()
    kinds = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
    issued = sum(e.name in {f"_c10d_functional::{k}" for k in kinds} for e in prof.events())
    rank = shares(cfg)[0]
    assert issued == cfg.accum * redistributions(cfg, rank, tp_collectives(cfg, rank))
