"""Compiled op lists: pointwise chains fused into one kernel (formula/fusion.py), checked against hand counts of the
bytes a fused kernel moves, FlopCounterMode on a real update (fusion leaves the matmuls' FLOPs alone), and the
launches a compiled graph issues.  No timed assertions."""
from __future__ import annotations

import pytest
from torch.utils.flop_counter import FlopCounterMode

from batchlab.config import RunConfig, preset
from batchlab.config.phase import Launch, Phase
from batchlab.formula import estimate
from batchlab.formula.fusion import KERNEL, fuse
from batchlab.formula.opcost import OpClass, OpCosts, OpCount, op_class, price
from batchlab.formula.oplist import update_ops

FWD = Phase.FORWARD
N = 1000  # elements of each activation in the hand-built graphs


def op(name: str, nbytes: int, elements: int = N, flops: int = 0, phase: Phase = FWD) -> OpCount:
    return OpCount(name, phase, op_class(name), flops=flops, bytes=nbytes, elements=elements)


def test_a_fused_chain_moves_its_inputs_and_output_once_by_hand():
    # y = x @ W; z = gelu(y); o = z * g (g another fp32 activation); x2 = o @ W2
    # eager: gelu reads y, writes z (8N bytes); mul reads z and g, writes o (12N): 20N
    # fused: one kernel reads y and g, writes o: 3 tensors of N fp32 elements = 12N; z never touches memory
    view = OpCount("view", FWD, OpClass.VIEW)
    chain = [op("mm", 0, flops=10**6), op("gelu", 8 * N), view, op("mul", 12 * N), op("mm", 0, flops=10**6)]
    out = fuse(chain, width=4)
    kernels = [o for o in out if o.name == KERNEL]
    assert len(kernels) == 1 and kernels[0].bytes == 12 * N and kernels[0].launch is Launch.COMPILED
    # the members remain, without a launch or bytes of their own: gelu's arithmetic is still there
    members = {o.name: o for o in out if o.launch is Launch.FUSED and o.cost_class is not OpClass.VIEW}
    assert set(members) == {"inductor_gelu", "mul"} and all(m.bytes == 0 for m in members.values())
    assert members["inductor_gelu"].elements == N  # gelu as inductor's loop computes it
    # the matmuls are untouched, issued by the compiled graph's wrapper
    mms = [o for o in out if o.name == "mm"]
    assert [o.flops for o in mms] == [10**6, 10**6] and all(o.launch is Launch.COMPILED for o in mms)


def test_a_reduction_ends_the_chain_and_a_matmul_splits_it():
    # add (residual, 12N) -> layer norm (reads N, writes N + 2 statistics per row) | mm | add 12N alone
    ln = op("native_layer_norm", 8 * N + 16)
    out = fuse([op("add", 12 * N), ln, op("mul", 12 * N), op("mm", 0, flops=1), op("add", 12 * N)], width=4)
    kernels = [o for o in out if o.name == KERNEL]
    # add + norm: the norm reads the sum from registers: inputs a, b (8N) + the norm's output (4N) + its statistics
    assert kernels[0].bytes == 12 * N + 8 * N + 16 - 2 * 4 * N
    # the mul after the norm opens a chain of its own (one op: itself), as does the add after the matmul
    singles = [o for o in out if o.name in ("mul", "add") and o.launch is Launch.COMPILED]
    assert [o.bytes for o in singles] == [12 * N, 12 * N]


def test_phases_keep_their_own_chains():
    ops = [op("gelu", 8 * N), op("gelu_backward", 12 * N, phase=Phase.BACKWARD), op("mul", 12 * N)]
    out = fuse(ops, width=4)
    fwd = [o for o in out if o.phase is FWD and o.name == KERNEL]
    assert len(fwd) == 1 and fwd[0].bytes == 8 * N + 12 * N - 2 * 4 * N
    assert [o.name for o in out if o.phase is Phase.BACKWARD] == ["inductor_gelu_backward"]  # alone: its own kernel


def test_launches_are_priced_by_who_issues_them():
    costs = OpCosts(matmul={"fp32": ((1.0, 1e10),)}, memory=((1.0, 1e10),), strided_bytes_per_s=5e9,
                    element_seconds={}, dispatch={"forward": 7e-6, "backward": 5e-6, "plain": 2e-6}, source="toy")
    eager = OpCount("add", FWD, OpClass.MEMORY, bytes=0)
    compiled = OpCount("add", FWD, OpClass.MEMORY, bytes=0, launch=Launch.COMPILED)
    fused = OpCount("add", FWD, OpClass.MEMORY, bytes=0, launch=Launch.FUSED)
    assert price([eager], costs).seconds == pytest.approx(7e-6)
    assert price([compiled], costs).seconds == pytest.approx(2e-6)  # a no-grad call from the graph's wrapper
    t = price([fused], costs)
    assert t.seconds == 0 and t.ops == 0


def test_compiled_op_list_keeps_flop_counter_flops():
    # FlopCounterMode over one real (eager) update: what the matmuls compute does not change when pointwise
    # chains are fused, so the compiled op list's FLOPs are the same count
    cfg = RunConfig(model=preset("tiny", layers=2, dropout=0.0), seq=32, micro_batch=2)
    from batchlab.measure.harness import Trainer

    trainer = Trainer(cfg)
    with FlopCounterMode(display=False) as counter:
        trainer.gradients(trainer.batches())
    compiled = update_ops(cfg.replace(compile="blocks"))
    counted = sum(o.flops * o.count for o in compiled if o.phase in (FWD, Phase.BACKWARD, Phase.RECOMPUTE))
    assert counted == pytest.approx(counter.get_total_flops(), rel=0.02)
    assert counted == sum(o.flops * o.count for o in update_ops(cfg) if o.phase is not Phase.OPTIMIZER)


def test_compiled_blocks_issue_fewer_launches_and_move_fewer_bytes():
    cfg = RunConfig(model=preset("tiny", layers=2), seq=64, micro_batch=2)
    eager, compiled = estimate(cfg).time.ops, estimate(cfg.replace(compile="blocks")).time.ops
    assert compiled.ops < eager.ops and compiled.bytes < eager.bytes
    assert compiled.flops == eager.flops
    # outside the blocks (embeddings, head, loss, optimizer) nothing changes under --compile blocks
    outside = [o for o in update_ops(cfg.replace(compile="blocks")) if o.phase is Phase.OPTIMIZER]
    assert all(o.launch is Launch.EAGER for o in outside)


def test_recompute_under_full_ac_is_compiled_too():
    cfg = RunConfig(model=preset("tiny", layers=2), seq=64, micro_batch=2, ac="full", compile="blocks")
    redo = [o for o in update_ops(cfg) if o.phase is Phase.RECOMPUTE]
    assert redo and all(o.launch is not Launch.EAGER for o in redo)
    assert any(o.name == KERNEL for o in redo)



def test_compiled_full_ac_recomputes_all_but_each_blocks_last_matmul_by_hand():
    # the partition drops from the recompute what backward never reads: the MLP's down-projection (its output only
    # enters the residual add).  By hand, tiny GPT, 2 blocks, h 128, seq 128, micro-batch 8 (T = 1024 tokens):
    # forward matmuls per block 2T·h·(3h + h + 4h + 4h) + 2·(2·b·s²·h) (scores and their product with v);
    # less the down-projection 2T·4h·h.  The compiled trace of the same config recomputes these FLOPs too
    # (benchmarks/compiled_time.py's trace column reads them from the partitioned backward graph).
    t, h, s, b = 1024, 128, 128, 8
    per_block = 2 * t * h * 12 * h + 2 * (2 * b * s * s * h) - 2 * t * 4 * h * h
    cfg = RunConfig(model=preset("tiny", layers=2), seq=s, micro_batch=b, ac="full", compile="blocks")
    assert sum(o.flops * o.count for o in update_ops(cfg) if o.phase is Phase.RECOMPUTE) == 2 * per_block


def test_compiled_dropout_draws_its_numbers_inside_the_blocks_kernels_by_hand():
    # tiny GPT, 2 blocks, h 128, 4 heads, seq 64, micro-batch 2: each block drops its attention probabilities
    # (b·a·s² = 2·4·64·64) and two residual branches (b·s·h = 2·64·128 each); compiled, inductor draws those numbers
    # inside the fused kernels (prims.inductor_random: no launch, no bytes of its own), while the embeddings'
    # dropout, outside the compiled blocks, stays ATen's bernoulli_
    cfg = RunConfig(model=preset("tiny", layers=2), seq=64, micro_batch=2, compile="blocks")
    drawn = [o for o in update_ops(cfg) if o.cost_class is OpClass.RANDOM and o.phase is FWD
             and o.name != "inductor_mask_store"]
    inside = [o for o in drawn if o.name == "inductor_random"]
    assert all(o.launch is Launch.FUSED and o.bytes == 0 for o in inside)
    assert sum(o.elements * o.count for o in inside) == 2 * (2 * 4 * 64 * 64 + 2 * 2 * 64 * 128)
    assert [(o.name, o.elements * o.count, o.launch) for o in drawn if o not in inside] == [
        ("bernoulli_", 2 * 64 * 128, Launch.EAGER)]


def test_inductors_rng_is_priced_at_its_own_rate_where_measured():
    # calibrate/compiled_rng.py caches the in-kernel RNG as "random/inductor_random:fp32"; without it, bernoulli_'s
    costs = OpCosts(matmul={"fp32": ((1.0, 1e10),)}, memory=((1.0, 1e10),), strided_bytes_per_s=5e9,
                    element_seconds={"random:fp32": 5e-9}, dispatch={"forward": 0.0, "backward": 0.0, "plain": 0.0})
    drawn = OpCount("inductor_random", FWD, op_class("inductor_random"), elements=N, launch=Launch.FUSED)
    assert price([drawn], costs).seconds == pytest.approx(N * 5e-9)
    measured = OpCosts(**{**costs.__dict__, "element_seconds": {"random:fp32": 5e-9,
                                                                "random/inductor_random:fp32": 12e-9}})
    assert price([drawn], measured).seconds == pytest.approx(N * 12e-9)


def test_a_forward_keeping_its_masks_stores_them_as_bool_and_a_recomputed_one_stores_none():
    # the same tiny GPT as above: compiled with AC none, its forward keeps every mask it draws for backward (a bool
    # per drawn element, stored inside the kernel: calibrate/compiled_rng.py); recomputed whole (AC full), inductor's
    # forward returns no mask and the backward draws every number again, the last dropout's too (past the block's
    # last matmul, inside its backward kernel: its generated code has no bool buffer at all)
    drawn = 2 * (2 * 4 * 64 * 64 + 2 * 2 * 64 * 128)
    kept = RunConfig(model=preset("tiny", layers=2), seq=64, micro_batch=2, compile="blocks")
    masks = [o for o in update_ops(kept) if o.name == "inductor_mask_store"]
    assert all(o.phase is FWD and o.launch is Launch.FUSED and o.cost_class is OpClass.RANDOM for o in masks)
    assert sum(o.elements * o.count for o in masks) == drawn and sum(o.bytes * o.count for o in masks) == drawn
    full = kept.replace(ac="full")
    assert not [o for o in update_ops(full) if o.name == "inductor_mask_store"]
    again = [o for o in update_ops(full) if o.name == "inductor_random" and o.phase is Phase.RECOMPUTE]
    assert sum(o.elements * o.count for o in again) == drawn
    assert not [o for o in update_ops(kept.replace(compile="none")) if o.name == "inductor_mask_store"]


def _in_update(cfg, name: str, phase: Phase) -> int:
    return sum(o.elements * o.count for o in update_ops(cfg) if o.name == name and o.phase is phase)


def test_a_kept_causal_mask_is_read_back_per_element_and_a_recomputed_one_is_made_from_indices_by_hand():
    # tiny GPT without dropout, 2 blocks, 4 heads, seq 64, micro-batch 2: each block's scores are b·a·s² = 32,768.
    # Inductor's plan of the block (tests/trace/test_compiled_trace.py, on its own causal softmax): with AC none the
    # forward saves the causal mask and its softmax kernel reads it back as bool in its max and exp passes (2 per
    # score), the backward once; under full AC no pass reads one: the mask comes from the loop's indices
    scores = 2 * 4 * 64 * 64
    kept = RunConfig(model=preset("tiny", layers=2, dropout=0.0), seq=64, micro_batch=2, compile="blocks")
    assert _in_update(kept, "inductor_mask_load", FWD) == 2 * 2 * scores
    assert _in_update(kept, "inductor_mask_load", Phase.BACKWARD) == 2 * scores
    full = kept.replace(ac="full")
    assert not [o for o in update_ops(full) if o.name == "inductor_mask_load" or o.cost_class is OpClass.MASKED]
    # eager PyTorch runs masked_fill itself, in every phase
    assert _in_update(full.replace(compile="none"), "masked_fill", Phase.RECOMPUTE) == 2 * scores


def test_a_kept_dropout_mask_is_read_back_by_the_backward_at_the_random_rate_by_hand():
    # tiny GPT, 2 blocks, 4 heads, seq 64, micro-batch 2, dropout 0.1, AC none: each block keeps its attention
    # dropout's mask (b·a·s² = 32,768 draws) and its two residual dropouts' (b·s·h = 16,384 each); the backward
    # reads each back as bool, the attention one twice (inductor's softmax-gradient kernel recomputes the dropout's
    # backward in its row-sum pass and its pointwise pass: tests/trace/test_compiled_trace.py reads its plan);
    # recomputed whole (AC full), nothing is kept and nothing read
    kept = RunConfig(model=preset("tiny", layers=2), seq=64, micro_batch=2, compile="blocks")
    assert _in_update(kept, "inductor_mask_load_random", Phase.BACKWARD) == 2 * (2 * 32_768 + 2 * 16_384)
    assert not _in_update(kept, "inductor_mask_load_random", FWD)
    assert not _in_update(kept.replace(ac="full"), "inductor_mask_load_random", Phase.BACKWARD)
    assert not _in_update(kept.replace(model=preset("tiny", layers=2, dropout=0.0)), "inductor_mask_load_random",
                          Phase.BACKWARD)


def test_a_full_ac_recomputes_last_chain_is_fused_into_its_gradients_kernel_by_hand():
    # the recompute of each block ends with fc1's gelu (b·s·4h = 2·64·512 = 65,536 outputs), whose output the
    # backward reads for the down-projection's weight gradient; inductor's backward computes it inside the
    # gelu-and-gelu_backward kernel (one tanh for both, its output written once: 65,536 x 4 bytes), no launch
    cfg = RunConfig(model=preset("tiny", layers=2, dropout=0.0), seq=64, micro_batch=2, ac="full", compile="blocks")
    redo = [o for o in update_ops(cfg) if o.phase is Phase.RECOMPUTE]
    assert not [o for o in redo if "gelu" in o.name and o.launch is not Launch.FUSED]
    gelu = [o for o in redo if o.name == "inductor_gelu"]
    assert gelu and all(o.cost_class is OpClass.MEMORY for o in gelu)  # its arithmetic is the gradient's
    into = [o for o in redo if o.name == KERNEL and o.launch is Launch.FUSED]
    assert sum(o.bytes * o.count for o in into) == 2 * 65_536 * 4
    # with dropout, the block's last dropout (past the down-projection) is drawn again in that backward too: the
    # written output is still the gelu's
    dropped = [o for o in update_ops(cfg.replace(model=preset("tiny", layers=2))) if o.phase is Phase.RECOMPUTE
               and o.name == KERNEL and o.launch is Launch.FUSED]
    assert sum(o.bytes * o.count for o in dropped) == 2 * 65_536 * 4


def test_a_fused_ops_arithmetic_is_priced_at_inductors_in_kernel_rate_where_timed_else_atens():
    costs = OpCosts(matmul={"fp32": ((1.0, 1e10),)}, memory=((1.0, 1e10),), strided_bytes_per_s=5e9,
                    element_seconds={"activation:fp32": 2e-9, "activation/tanh:fp32": 3.5e-9},
                    dispatch={"forward": 0.0, "backward": 0.0, "plain": 0.0})
    tanh = [o for o in fuse([op("mm", 0, flops=10), op("tanh", 8 * N), op("mm", 0, flops=10)], 4)
            if o.name == "inductor_tanh"]
    assert len(tanh) == 1 and tanh[0].launch is Launch.COMPILED
    # a lone tanh is its own kernel: the slower of its bytes at 1e10 B/s (0.8 ns per element) and its arithmetic
    assert price(tanh, costs).seconds == pytest.approx(N * 3.5e-9)  # ATen's tanh where not timed
    timed = OpCosts(**{**costs.__dict__, "element_seconds": {**costs.element_seconds,
                                                             "activation/inductor_tanh:fp32": 1.5e-9}})
    assert price(tanh, timed).seconds == pytest.approx(N * 1.5e-9)


def test_a_norm_inside_a_compiled_kernel_costs_its_bytes_not_atens_per_element_rate():
    # inductor computes a layer norm's mean and variance in its own vectorised loop (one Welford pass), fused with
    # the chain before it: a GPT block's lone layer norm kernel took its bytes' time, about two thirds of ATen's
    # native_layer_norm on the same rows in the same process (docs/accuracy/compiled-time.md); priced by its bytes
    costs = OpCosts(matmul={"fp32": ((1.0, 1e10),)}, memory=((1.0, 1e10),), strided_bytes_per_s=5e9,
                    element_seconds={"norm:fp32": 5e-9}, dispatch={"forward": 0.0, "backward": 0.0, "plain": 0.0})
    alone = fuse([op("mm", 0, flops=10), op("native_layer_norm", 8 * N), op("mm", 0, flops=10)], 4)
    assert price([o for o in alone if o.name == "native_layer_norm"], costs).seconds == pytest.approx(8 * N / 1e10)
    chained = fuse([op("add", 12 * N), op("native_layer_norm", 8 * N)], 4)
    assert price(chained, costs).seconds == pytest.approx((12 + 8 - 2 * 4) * N / 1e10)  # the chain's bytes once
    assert price([op("native_layer_norm", 8 * N)], costs).seconds == pytest.approx(N * 5e-9)  # eager: ATen's rate


def test_a_selective_policy_that_redraws_every_dropout_keeps_no_mask_and_a_branch_policy_keeps_them_all():
    # selective-op caches only matmul outputs (its catalogue entry): its recompute redraws every dropout, so, as under
    # full AC, inductor's forward returns no mask (the trace of the same block, inductor's own plan, prices its forward
    # as full AC's); selective-mlp recomputes the MLP branch up to its last matmul, the dropouts outside it stay kept
    drawn = 2 * (2 * 4 * 64 * 64 + 2 * 2 * 64 * 128)
    sel = RunConfig(model=preset("tiny", layers=2), seq=64, micro_batch=2, compile="blocks", ac="selective-op")
    assert not [o for o in update_ops(sel) if o.name == "inductor_mask_store"]
    assert _in_update(sel, "inductor_random", Phase.RECOMPUTE) == drawn
    assert _in_update(sel.replace(ac="selective-mlp"), "inductor_mask_store", FWD) == drawn


def test_blocks_dynamo_does_not_compile_run_their_ops_eagerly():
    # transformers' Llama block under checkpoint breaks dynamo's graph (the compiled table's entry, derived by tracing
    # it: "does not compile into one graph"): its ops are eager PyTorch's, the same list as without --compile
    from batchlab.formula.compiled import runs_eager

    llama = RunConfig(model=preset("llama-2-7b", layers=2, hidden=128, heads=4, ffn=352, vocab=1024, max_positions=256),
                      model_source="hf:llama", seq=64, micro_batch=2, ac="full", compile="blocks")
    assert runs_eager(llama) and not runs_eager(llama.replace(ac="none"))
    assert update_ops(llama) == update_ops(llama.replace(compile="none"))
    assert not runs_eager(RunConfig(model=preset("tiny", layers=2), ac="full", compile="blocks"))
