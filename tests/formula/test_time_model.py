"""The per-op time model: op accounting (against FlopCounterMode and by hand), the calculator's op list against
the ops the real code runs, and the model's ratios on controlled toy cases.  No timed assertions."""
from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from batchlab.config import RunConfig
from batchlab.formula import estimate, flops, memory, timing
from batchlab.formula.attribution import attribute
from batchlab.formula.opcost import OpClass, OpCosts, OpCount, interpolate_log, op_class, price
from batchlab.config.phase import Phase
from batchlab.formula.oplist import update_ops
from batchlab.measure.harness import Trainer
from batchlab.trace.flops import register_cpu_attention_flops
from batchlab.trace.ops import OpRecorder, record_update

FLAT = OpCosts(matmul={"fp32": ((1.0, 1e10),)}, memory=((1.0, 1e10),), strided_bytes_per_s=5e9,
               element_seconds={}, dispatch={"forward": 1e-5, "backward": 1e-5, "plain": 1e-5}, source="toy")


def recorded(cfg: RunConfig) -> tuple[OpCount, ...]:
    trainer = Trainer(cfg)
    trainer.update()  # AdamW's state exists: the steady update
    return record_update(trainer)


def totals(ops, key):
    out = collections.Counter()
    for op in ops:
        out[key(op)] += op.count
    return out


def test_one_linear_layer_by_hand():
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    with OpRecorder() as rec:
        rec.mark("forward")
        y = lin(x)
        rec.mark("backward")
        y.sum().backward()
    ops = {(o.phase, o.name): o for o in rec.result()}
    addmm = ops[(Phase.FORWARD, "addmm")]
    assert addmm.cost_class is OpClass.MATMUL and addmm.flops == 2 * 2 * 4 * 3
    assert addmm.bytes == (3 + 2 * 4 + 4 * 3 + 2 * 3) * 4  # bias, x, w^T read; y written (fp32)
    assert addmm.elements == 6
    assert ops[(Phase.FORWARD, "t")].cost_class is OpClass.VIEW and ops[(Phase.FORWARD, "t")].bytes == 0
    # backward: grad x = g @ w (2x3 @ 3x4), grad w = g^T @ x (3x2 @ 2x4): 48 FLOPs each
    assert sum(o.flops * o.count for o in rec.result() if o.phase is Phase.BACKWARD) == 2 * 48


def test_out_variant_moves_its_output_once_by_hand():
    """Inductor's wrapper calls its extern matmuls into planned buffers (``mm(a, b, out=buf)``): the buffer is
    written, not read, so the call moves what the functional ``mm`` moves; an in-place op still reads and writes."""
    a, b, buf = torch.randn(5, 4), torch.randn(4, 3), torch.empty(5, 3)
    with OpRecorder() as rec:
        rec.mark("forward")
        torch.mm(a, b, out=buf)
        buf.add_(1.0)
    ops = {o.name: o for o in rec.result()}
    assert ops["mm"].bytes == (5 * 4 + 4 * 3 + 5 * 3) * 4  # a, b read; buf written once (fp32)
    assert ops["add_"].bytes == 2 * 5 * 3 * 4  # buf read and written


@pytest.mark.parametrize("kw", [dict(), dict(ac="full"), dict(ac="selective"), dict(attention="sdpa", dropout=0.0)])
def test_recorded_flops_per_phase_match_flop_counter_mode(kw):
    cfg = RunConfig(seq=32, micro_batch=2).replace(**kw)
    trainer = Trainer(cfg)
    trainer.update()
    register_cpu_attention_flops()
    rec = OpRecorder(trainer.raw_model)
    with FlopCounterMode(display=False) as counter, rec:
        trainer.update(listener=rec)
    rec.close()
    ops = rec.result()
    assert sum(o.flops * o.count for o in ops) == counter.get_total_flops()
    if kw.get("ac"):
        assert sum(o.flops * o.count for o in ops if o.phase is Phase.RECOMPUTE) > 0


VARIANTS = [dict(), dict(attention="sdpa", dropout=0.0), dict(precision="bf16-mixed"), dict(ac="full"),
            dict(ac="selective"), dict(micro_batch=1, accum=3),
            dict(attention="sdpa", dropout=0.0, mlp="swiglu", norm="rmsnorm", position="rope", bias=False,
                 tied_embeddings=False, ffn=256, kv_heads=2)]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "tiny")
def test_the_calculators_op_list_is_the_one_the_code_runs(kw):
    _same_op_list(RunConfig(seq=32, micro_batch=2).replace(**kw))


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_calculators_op_list_for_hf_gpt2_is_the_one_its_code_runs(precision):
    # transformers' GPT-2 writes gelu_new in Python ops (mul, pow, add, tanh, ...): with batchlab's fused
    # GELU in its place the calculator counted 25% fewer element-wise bytes than the real update moves
    from batchlab.config import preset

    spec = preset("gpt2", layers=2, hidden=64, heads=4, vocab=256, max_positions=64)
    cfg = RunConfig(model=spec, model_source="hf:gpt2", seq=32, micro_batch=2, precision=precision)
    real, formula = recorded(cfg), update_ops(cfg)
    for phase in Phase:
        assert sum(o.flops * o.count for o in formula if o.phase is phase) == \
            sum(o.flops * o.count for o in real if o.phase is phase)
    moved = lambda ops: sum(o.bytes * o.count for o in ops if o.cost_class not in (OpClass.MATMUL, OpClass.VIEW))  # noqa: E731
    assert moved(formula) == pytest.approx(moved(real), rel=0.10)
    # non-view ops per phase and class within 3; HF's mask and position building (cumsum, eq, ne, sub, all,
    # cat, sum on b x s tensors: ~10 tiny ops a forward) and its views (Conv1D, head splits) are not modelled
    r, f = (totals((o for o in ops if o.cost_class is not OpClass.VIEW), lambda o: (o.phase, o.cost_class))
            for ops in (real, formula))
    for key in set(r) | set(f):
        slack = 12 if key == (Phase.FORWARD, OpClass.MEMORY) else 3
        assert abs(r[key] - f[key]) <= slack, (key, r[key], f[key])


def _same_op_list(cfg: RunConfig) -> None:
    real, formula = recorded(cfg), update_ops(cfg)
    # every matmul FLOP, per phase, exactly
    flops = lambda o: o.flops * o.count  # noqa: E731
    for phase in Phase:
        assert sum(flops(o) for o in formula if o.phase is phase) == sum(flops(o) for o in real if o.phase is phase)
    # op counts per phase within 8% (view ops are the loose part), non-view ops per class within 3
    for phase in (Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE, Phase.OPTIMIZER):
        n_real = sum(o.count for o in real if o.phase is phase)
        n_formula = sum(o.count for o in formula if o.phase is phase)
        assert n_formula == pytest.approx(n_real, rel=0.08, abs=2), phase
    # (a copy of a transposed size-1 dimension is contiguous: strided and plain copies are counted together)
    merged = lambda o: OpClass.MEMORY if o.cost_class is OpClass.STRIDED else o.cost_class  # noqa: E731
    by_class = lambda ops: totals((o for o in ops if o.cost_class is not OpClass.VIEW), lambda o: (o.phase, merged(o)))  # noqa: E731
    r, f = by_class(real), by_class(formula)
    for key in set(r) | set(f):
        assert abs(r[key] - f[key]) <= 3 + 0.05 * r[key], (key, r[key], f[key])
    # bytes moved by memory-bound and per-element ops within 10%
    moved = lambda ops: sum(o.bytes * o.count for o in ops if o.cost_class not in (OpClass.MATMUL, OpClass.VIEW))  # noqa: E731
    assert moved(formula) == pytest.approx(moved(real), rel=0.10)
    # the ops selective checkpointing's dispatch mode sees (forward and recompute of the blocks), per phase
    for phase in Phase:
        seen = [sum(o.count for o in ops if o.sac_dispatched and o.phase is phase) for ops in (real, formula)]
        assert seen[1] == pytest.approx(seen[0], rel=0.08, abs=2), (phase, seen)
        assert not seen[0] or (cfg.ac.mode.value == "selective" and phase in (Phase.FORWARD, Phase.RECOMPUTE))


def test_ops_under_selective_checkpointing_pay_its_dispatch_mode():
    # forward-sac 40 us and recompute-sac 30 us per op against 10 us plain: the ops dispatched through SAC's mode
    # (counted in the op list, checked against the real code above) pay the difference, every other op as before
    sac = OpCosts(**{**FLAT.__dict__, "dispatch": {**FLAT.dispatch, "forward-sac": 4e-5, "recompute-sac": 3e-5}})
    cfg = RunConfig(seq=32, micro_batch=2, ac="selective")
    ops = update_ops(cfg)
    n_fwd = sum(o.count for o in ops if o.sac_dispatched and o.phase is Phase.FORWARD)
    n_rec = sum(o.count for o in ops if o.sac_dispatched and o.phase is Phase.RECOMPUTE)
    assert n_fwd > 0 and n_rec > 0
    assert price(ops, sac).seconds - price(ops, FLAT).seconds == pytest.approx(n_fwd * 3e-5 + n_rec * 2e-5)
    # full checkpointing runs no dispatch mode: the same price either way
    full = update_ops(cfg.replace(ac="full"))
    assert price(full, sac).seconds == pytest.approx(price(full, FLAT).seconds)
    # uncalibrated, the nominal figures price the mode too (host-side Python on every backend)
    from batchlab.formula.timing import nominal_costs

    nominal = nominal_costs(cfg)
    assert nominal.dispatch_seconds(Phase.FORWARD, True) > 3 * nominal.dispatch_seconds(Phase.FORWARD)


def test_formula_and_trace_predict_the_same_update_time():
    from batchlab.trace import estimate as trace_estimate

    cfg = RunConfig(seq=64, micro_batch=2, ac="full")
    f, t = estimate(cfg).time.ops, trace_estimate(cfg).time
    assert t.provenance == "trace" and f.provenance == "formula"
    assert f.seconds == pytest.approx(t.seconds, rel=0.03)
    assert f.flops == t.flops


def test_op_classes():
    assert op_class("addmm") is OpClass.MATMUL and op_class("_scaled_dot_product_flash_attention_for_cpu") is OpClass.MATMUL
    assert op_class("gelu") is OpClass.ACTIVATION and op_class("gelu_backward") is OpClass.ACTIVATION_GRAD
    assert op_class("sqrt") is OpClass.MEMORY and op_class("add_") is OpClass.MEMORY
    assert op_class("bernoulli_") is OpClass.RANDOM and op_class("native_layer_norm") is OpClass.NORM
    assert op_class("_unsafe_view") is OpClass.VIEW and op_class("transpose", is_view=True) is OpClass.VIEW
    assert op_class("clone", strided=True) is OpClass.STRIDED and op_class("clone") is OpClass.MEMORY
    assert op_class("_log_softmax") is OpClass.LOSS and op_class("_softmax") is OpClass.SOFTMAX
    assert op_class("masked_fill") is OpClass.MASKED


def test_in_place_ops_use_their_own_bandwidth():
    # 1 MB moved: out of place into fresh memory at 5 GB/s, in place at 20 GB/s
    costs = OpCosts(**{**FLAT.__dict__, "memory": ((1.0, 5e9),), "memory_inplace": ((1.0, 2e10),)})
    fresh, inplace = (OpCount(n, Phase.OPTIMIZER, OpClass.MEMORY, bytes=10**6) for n in ("add", "add_"))
    assert costs.work_seconds(fresh) == pytest.approx(2e-4) and costs.work_seconds(inplace) == pytest.approx(5e-5)
    assert FLAT.work_seconds(inplace) == FLAT.work_seconds(fresh)  # no in-place curve: one bandwidth


def test_fused_attention_backward_has_its_own_rate_and_a_cost_per_call():
    # 16 (batch, head) entries of 2 MFLOP forward / 5 MFLOP backward each (s 128, d 32: 4 s^2 d per entry)
    flops_per_matmul = 4 * 128 * 128 * 32
    fwd = OpCount("_scaled_dot_product_flash_attention_for_cpu", Phase.FORWARD, OpClass.MATMUL, flops=16 * flops_per_matmul,
                  low_precision=True, flops_per_matmul=flops_per_matmul)
    bwd = OpCount("_scaled_dot_product_flash_attention_for_cpu_backward", Phase.BACKWARD, OpClass.MATMUL,
                  flops=int(2.5 * 16 * flops_per_matmul), low_precision=True, flops_per_matmul=flops_per_matmul)
    costs = OpCosts(**{**FLAT.__dict__, "matmul": {**FLAT.matmul, "sdpa-bf16": ((1.0, 1e11),),
                                                  "sdpa-backward-bf16": ((1.0, 1e10),)},
                       "matmul_start": {"sdpa-backward-bf16": ((1.0, 3e-4),)}})
    assert costs.work_seconds(fwd) == pytest.approx(16 * flops_per_matmul / 1e11)  # no start curve: none added
    assert costs.work_seconds(bwd) == pytest.approx(2.5 * 16 * flops_per_matmul / 1e10 + 3e-4)
    # a calibration with no backward curve prices the backward at the forward's rate, not the linear layers'
    forward_only = OpCosts(**{**costs.__dict__, "matmul": {**FLAT.matmul, "sdpa-bf16": ((1.0, 1e11),)},
                              "matmul_start": {}})
    assert forward_only.work_seconds(bwd) == pytest.approx(2.5 * 16 * flops_per_matmul / 1e11)
    # ranks slowing each other (contention) stretch the start as they stretch the work
    from batchlab.formula.timing import contended

    slow = contended(costs, {"compute": 2.0})
    assert slow.work_seconds(bwd) == pytest.approx(2 * costs.work_seconds(bwd))


def test_local_ranks_share_the_cores_and_the_loopback_link():
    base = RunConfig(seq=64, micro_batch=2)
    cpu = OpCosts(**{**FLAT.__dict__, "threads": 2, "cores": 2, "link_bytes_per_s": 1e9, "link_latency_s": 2e-5,
                     "link_cpu_seconds": {"message": 1e-5, "byte": 0.5e-9}})
    def timed(cfg, costs):
        return timing(cfg, flops(cfg), memory(cfg), costs)

    one, two = timed(base, cpu), timed(base.replace(dp=2), cpu)
    # 2 ranks x 2 threads on 2 cores: each rank's ops take twice as long
    assert two.ops.seconds == pytest.approx(2 * one.ops.seconds, rel=1e-9)
    assert "2 local rank(s) x 2 thread(s) on 2 cores, ops x2.00" in two.model
    # ring all-reduce of the fp32 gradients over the 1 GB/s link, 2 messages of 20 us per collective: DDP's two
    # buckets (the first of 1 MiB, the rest under 25 MiB) and the harness's all-reduce of the token count; the
    # ranks' CPU part of it (10 us a message, 0.5 ns a byte) runs at half speed: 30 us a message, 1.5 ns a byte
    grads = 4 * sum(p.numel() for p in Trainer(base).raw_model.parameters())  # the real model's fp32 gradients
    assert 2**20 < grads < 26 * 2**20
    assert two.allreduce_seconds == pytest.approx(grads * 1.5e-9 + 3 * 2 * 3e-5, rel=1e-6)
    assert "667 MB/s + 30 us a message" in two.model  # util.units.fmt_count, 3 digits
    # the ranks' threads fill the cores, which gloo's copies and sums need: nothing of it is hidden
    assert two.exposed_comm_seconds == two.allreduce_seconds and "nothing hidden" in two.overlap_source
    single_thread = OpCosts(**{**cpu.__dict__, "threads": 1})
    assert timed(base.replace(dp=2), single_thread).ops.seconds == pytest.approx(one.ops.seconds)
    # 2 ranks x 1 thread on 4 cores leave two idle cores to gloo: DDP's overlap rules apply
    roomy = timed(base.replace(dp=2), OpCosts(**{**cpu.__dict__, "threads": 1, "cores": 4}))
    assert roomy.overlap_source.startswith("DDP buckets: hidden behind backward")


def test_the_update_waits_for_the_slowest_local_rank():
    # ranks calibrated 4% apart over the same work: each local rank's ops priced 4% longer; one rank alike as before
    base = RunConfig(seq=64, micro_batch=2)
    quiet = OpCosts(**{**FLAT.__dict__, "threads": 1, "cores": 2})
    apart = OpCosts(**{**quiet.__dict__, "rank_skew": 0.04})
    def timed(cfg, costs):
        return timing(cfg, flops(cfg), memory(cfg), costs)

    assert timed(base.replace(dp=2), apart).ops.seconds == pytest.approx(1.04 * timed(base.replace(dp=2), quiet).ops.seconds)
    assert timed(base, apart).ops == timed(base, quiet).ops
    assert "the slowest rank computes 4.0% longer" in timed(base.replace(dp=2), apart).model


def test_ddp_buckets_follow_its_defaults():
    from batchlab.formula.timing import ddp_buckets

    mib = 2**20
    assert [ddp_buckets(b) for b in (0, mib // 2, mib, mib + 1, 26 * mib, 26 * mib + 1, 100 * mib)] == [0, 1, 1, 2, 2, 3, 5]


def test_local_ranks_running_at_once_slow_each_op_by_its_kinds_calibrated_contention():
    base = RunConfig(seq=64, micro_batch=2)
    per_element = {f"{k.value}:fp32": 1e-3 for k in OpClass}  # 1 ms per element: never bytes-bound
    quiet = OpCosts(**{**FLAT.__dict__, "threads": 1, "cores": 2, "element_seconds": per_element})
    busy = OpCosts(**{**quiet.__dict__, "contention": {"compute": 1.5, "memory": 2.0, "dispatch": 3.0},
                      "contention_processes": 2})
    def timed(cfg, costs):
        return timing(cfg, flops(cfg), memory(cfg), costs)

    one, two = timed(base, busy), timed(base.replace(dp=2), busy)
    assert one.ops == timed(base, quiet).ops  # one rank: nothing runs beside it
    # 2 ranks x 1 thread on 2 cores share no core; each op class slows by the kind it contends like
    kind = {"memory": 2.0, "strided-copy": 2.0, "dispatch": 3.0, "view": 1.0}
    assert set(one.ops.by_class) == set(two.ops.by_class) and {"matmul", "memory", "dispatch"} <= set(one.ops.by_class)
    for cost_class, seconds in one.ops.by_class.items():
        assert two.ops.by_class[cost_class] == pytest.approx(kind.get(cost_class, 1.5) * seconds, rel=1e-9), cost_class
    assert two.ops.seconds == pytest.approx(sum(two.ops.by_class.values()), rel=1e-9)
    assert "compute x1.50, memory x2.00, dispatch x3.00" in two.model and "slowest rank" in two.model
    assert "slow each other" not in one.model
    # a factor below 1 is sampling noise: no rank runs faster beside another
    noisy = OpCosts(**{**quiet.__dict__, "contention": {"compute": 0.9, "memory": 0.8, "dispatch": 0.95},
                       "contention_processes": 2})
    assert timed(base.replace(dp=2), noisy).ops.seconds == pytest.approx(timed(base.replace(dp=2), quiet).ops.seconds)


def test_a_skinny_linear_layer_pays_its_bytes_beyond_the_calibrated_shapes_at_the_out_of_cache_rate():
    # calibrated on (256, 128, 128) and (1024, 256, 256); the call (64, 128, 512) has (256, 128, 128)'s FLOPs
    costs = OpCosts(**{**FLAT.__dict__, "memory": ((1e5, 4e10), (1e8, 1e10)),
                       "matmul_intensity": ((2 * 256 * 128 * 128, 2 * 256 * 128 * 128 / (4 * 81920)),
                                            (2 * 1024 * 256 * 256, 2 * 1024 * 256 * 256 / (4 * 589824)))})
    flops = 2 * 64 * 128 * 512  # = 2 * 256 * 128 * 128
    square = OpCount("mm", Phase.FORWARD, OpClass.MATMUL, flops=flops, bytes=4 * (256 * 128 + 128 * 128 + 256 * 128))
    skinny = OpCount("mm", Phase.FORWARD, OpClass.MATMUL, flops=flops, bytes=4 * (64 * 128 + 128 * 512 + 64 * 512))
    # by hand: 425,984 bytes against the square shape's 327,680, the 98,304 extra at 1e10 B/s (the largest size's)
    assert costs.work_seconds(square) == pytest.approx(flops / 1e10)
    assert costs.work_seconds(skinny) - costs.work_seconds(square) == pytest.approx(98304 / 1e10)
    # in bf16 both move half the bytes; a fatter call than the calibrated shape gets no credit
    half = OpCount("mm", Phase.FORWARD, OpClass.MATMUL, flops=flops, bytes=425984 // 2, low_precision=True)
    assert costs.excess_bytes(half) == pytest.approx(49152)
    assert costs.excess_bytes(OpCount("mm", Phase.FORWARD, OpClass.MATMUL, flops=flops, bytes=100000)) == 0
    # attention's batched matmuls and fused attention are priced on curves timed on their own shapes
    bmm = OpCount("bmm", Phase.FORWARD, OpClass.MATMUL, flops=flops, bytes=10**7, flops_per_matmul=flops // 8)
    assert costs.work_seconds(bmm) == pytest.approx(flops / 1e10)
    assert FLAT.excess_bytes(skinny) == 0  # nominal figures: no calibrated shapes, no term


def test_a_calibration_prices_with_the_shapes_its_curve_was_timed_on():
    from batchlab.calibrate import Calibration

    cal = Calibration(device="cpu", hardware="x", torch_device="cpu", matmul_flops_fp32=1e10, matmul_flops_bf16=None,
                      memory_bytes_per_s=1e10, matmul_curve={"fp32": [[1e6, 1e10]]}, memory_curve=[[1e5, 1e10]],
                      strided_bytes_per_s=1e9, dispatch_seconds={"forward": 1e-6, "backward": 1e-6, "plain": 1e-6},
                      matmul_shapes=[[1024, 256, 256], [32, 32, 32]])
    assert cal.op_costs().matmul_intensity == ((65536, 65536 / 12288), (134217728, 134217728 / 2359296))
    assert Calibration.from_dict(cal.to_dict()).op_costs() == cal.op_costs()


def test_interpolation_in_log_flops():
    pts = ((1e6, 10.0), (1e8, 30.0))
    assert interpolate_log(pts, 1e7) == pytest.approx(20.0)  # halfway in log
    assert interpolate_log(pts, 1e3) == 10.0 and interpolate_log(pts, 1e12) == 30.0  # flat outside


def test_dispatch_bound_and_flop_bound_toys():
    # 1000 tiny element-wise ops: 10 ms of dispatch, 1 µs of bytes; one 1 GFLOP matmul: 100 ms of work
    tiny = OpCount("add", Phase.FORWARD, OpClass.MEMORY, bytes=12, count=1000)
    big = OpCount("mm", Phase.FORWARD, OpClass.MATMUL, flops=10**9)
    t_tiny, t_big = price([tiny], FLAT), price([big], FLAT)
    assert t_tiny.seconds == pytest.approx(1000 * (1e-5 + 12 / 1e10))
    assert t_tiny.dispatch_share > 0.99 and t_big.dispatch_share < 1e-3
    assert t_big.seconds == pytest.approx(0.1 + 1e-5)
    # on an asynchronous device a launch hides behind a longer kernel
    gpu = OpCosts(**{**FLAT.__dict__, "asynchronous": True})
    assert price([big], gpu).seconds == pytest.approx(0.1) and price([tiny], gpu).seconds == pytest.approx(0.01)


def test_micro_batch_ratio_follows_the_dispatch_share():
    # at a fixed global batch, 8 micro-batches of 1 run 8x the forward/backward ops of 1 micro-batch of 8
    a = RunConfig(seq=32, micro_batch=8, accum=1)
    b = a.replace(micro_batch=1, accum=8)
    dispatch_bound = OpCosts(**{**FLAT.__dict__, "dispatch": dict.fromkeys(FLAT.dispatch, 1e-3)})
    no_dispatch = OpCosts(**{**FLAT.__dict__, "dispatch": dict.fromkeys(FLAT.dispatch, 0.0)})
    ra = price(update_ops(b), dispatch_bound).seconds / price(update_ops(a), dispatch_bound).seconds
    rb = price(update_ops(b), no_dispatch).seconds / price(update_ops(a), no_dispatch).seconds
    assert 4 < ra < 8  # the optimizer's ops do not multiply
    # same FLOPs, flat rates: only the bytes of per-micro-batch work on whole weights (gradient accumulation,
    # the embedding's dense gradient) remain
    assert 1.0 < rb < 1.15


def test_attribution_parts_add_up_and_name_recompute():
    a = RunConfig(seq=64)
    ea, eb = estimate(a).time, estimate(a.replace(ac="full")).time
    att = attribute(ea, eb)
    assert sum(p.delta for p in att.parts) == pytest.approx(eb.update_seconds - ea.update_seconds)
    assert att.ratio == pytest.approx(eb.update_seconds / ea.update_seconds)
    assert 0.2 < att.recompute_flops_share < 0.4  # a full forward again, less the early-stopped tail
    assert att.text.startswith("the time model predicts B/A = ") and "recompute adds" in att.text
    assert "dispatch is" in att.text


def test_every_prediction_states_the_time_models_assumptions():
    e = estimate(RunConfig())
    line = next(a for a in e.assumptions if a.startswith("time model:"))
    assert "ops per update" in line and "source: nominal" in line and "µs per" in line
    assert e.time.ops.by_phase and sum(e.time.ops.by_phase.values()) == pytest.approx(e.time.ops.seconds)
    assert sum(e.time.ops.by_class.values()) == pytest.approx(e.time.ops.seconds)


def test_a_transcendental_kernel_calibrated_by_name_is_priced_at_its_own_rate():
    e = 1_000_000
    costs = OpCosts(**{**FLAT.__dict__, "element_seconds": {
        "activation:fp32": 2e-9, "activation:bf16": 3e-9, "activation/silu:fp32": 6e-10,
        "activation-grad:fp32": 2e-9, "activation-grad/tanh_backward:fp32": 1.4e-10}})
    def op(name, cost_class=OpClass.ACTIVATION, low=False):
        return OpCount(name, Phase.FORWARD, cost_class, elements=e, bytes=1, low_precision=low)

    assert costs.work_seconds(op("silu")) == pytest.approx(e * 6e-10)  # its own kernel
    assert costs.work_seconds(op("silu", low=True)) == pytest.approx(e * 6e-10)  # bf16 unmeasured: its fp32 rate
    assert costs.work_seconds(op("gelu")) == pytest.approx(e * 2e-9)  # the class's representative (tanh-GELU)
    assert costs.work_seconds(op("gelu", low=True)) == pytest.approx(e * 3e-9)
    assert costs.work_seconds(op("tanh_backward", OpClass.ACTIVATION_GRAD)) == pytest.approx(e * 1.4e-10)
