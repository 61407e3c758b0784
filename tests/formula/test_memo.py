"""The calculator's caches (formula/memo.py) change no figure: every estimate equals the uncached computation,
field by field, and a change to any config field reaches the figures (no cache key misses a field it reads)."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from batchlab.config import RunConfig, preset
from batchlab.formula import estimate
from batchlab.formula.memo import uncached
from batchlab.formula.oplist import micro_batch_ops, update_ops

LLAMA = preset("llama-2-7b", layers=4)


def grid() -> list[RunConfig]:
    """30 configs across accum, micro-batch, AC, precision, DP, ZeRO and seq, on the CPU and a GPU entry."""
    knobs = itertools.product((1, 3, 8), (1, 4), ("none", "full", "every:2", "selective"),
                              ("fp32", "bf16-mixed", "bf16"), ((1, 0), (4, 1), (4, 3)))
    out = []
    for i, (accum, mb, ac, precision, (dp, zero)) in enumerate(knobs):
        if i % 7 == 3:  # a spread of the 216 combinations
            gpu, seq = (i // 7) % 2 == 1, (64, 128)[(i // 14) % 2]
            out.append(RunConfig(model=LLAMA if gpu else preset("tiny"), device="h100-sxm" if gpu else "cpu", seq=seq,
                                 micro_batch=mb, accum=accum, ac=ac, precision=precision, dp=dp, zero=zero))
    return out[:30]


def fresh(cfg: RunConfig) -> dict:
    with uncached():
        return estimate(cfg).to_dict()


def test_grid_is_identical_with_and_without_the_caches():
    cfgs = grid()
    assert len(cfgs) == 30
    assert len({(c.accum, c.micro_batch, str(c.ac), c.precision, c.dp, c.zero, c.seq) for c in cfgs}) == 30
    reference = [fresh(c) for c in cfgs]
    first = [estimate(c).to_dict() for c in cfgs]  # fills the caches
    again = [estimate(c).to_dict() for c in cfgs]  # served from them
    for ref, a, b in zip(reference, first, again):
        assert a == ref and b == ref


# one other valid value for every RunConfig field, and for the model's fields the op list reads
BASE = RunConfig(seq=64, micro_batch=2, accum=2)
CHANGES = {
    "model": dict(model=preset("tiny", layers=3)), "model_source": dict(model=preset("gpt2", layers=2, hidden=128,
                                                                                    heads=4, vocab=512),
                                                                        model_source="hf:gpt2"),
    "seq": dict(seq=32), "micro_batch": dict(micro_batch=3), "accum": dict(accum=5), "dp": dict(dp=2),
    "precision": dict(precision="bf16-mixed"), "optimizer": dict(optimizer="sgd"), "ac": dict(ac="full"),
    "loss": dict(loss="chunked:4"), "zero": dict(dp=2, zero=1), "device": dict(device="h100-sxm"),
    "memory_budget": dict(memory_budget=2**20), "data": dict(data="padded"), "seed": dict(seed=3),
    "compile": dict(compile="blocks"), "fp8": dict(device="h100-sxm", precision="bf16-mixed", fp8="te"),
    "assumptions": dict(op_overhead_seconds=1e-5), "sharding": dict(dp=2, sharding="deepspeed-zero2"),
    "tp": dict(tp=2), "sequence_parallel": dict(tp=2, sequence_parallel=True),
    "tp_overlap": dict(tp=2, sequence_parallel=True, tp_overlap="async", device="h100-sxm"), "pp": dict(pp=2),
    "pp_schedule": dict(pp=2, pp_schedule="gpipe"), "pp_virtual": dict(pp=2, pp_schedule="interleaved-1f1b", pp_virtual=2),
    "optimizer_in_backward": dict(accum=1, optimizer_in_backward=True),
    "offload_activations": dict(device="h100-sxm", offload_activations=True),
    "deepspeed": dict(dp=2, sharding="deepspeed-zero3", deepspeed="hf-auto"),
}
MODEL_CHANGES = dict(layers=3, hidden=64, heads=8, kv_heads=2, ffn=256, mlp="swiglu", vocab=300,
                     tied_embeddings=False, norm="rmsnorm", dropout=0.1, attention="sdpa", position="rope",
                     max_positions=512, bias=False, qkv_bias=True)


def test_every_config_field_has_a_change_here():
    assert set(CHANGES) == {f.name for f in dataclasses.fields(RunConfig)}


@pytest.mark.parametrize("name", sorted(CHANGES) + [f"model.{k}" for k in MODEL_CHANGES])
def test_a_changed_field_is_never_served_the_base_configs_cached_figures(name):
    if name.startswith("model."):
        field = name.split(".", 1)[1]
        changed = BASE.replace(model=dataclasses.replace(BASE.model, **{field: MODEL_CHANGES[field]}))
    else:
        changed = BASE.replace(**CHANGES[name])
    with uncached():  # (empties the caches too)
        ops, whole, figures = micro_batch_ops(changed), update_ops(changed), estimate(changed).to_dict()
    estimate(BASE)  # the base config's entries in every cache
    assert micro_batch_ops(changed) == ops and update_ops(changed) == whole
    assert estimate(changed).to_dict() == figures


def test_a_changed_costs_field_is_never_served_the_base_costs_work():
    """price remembers each op shape's work per costs content: a costs differing in any field prices afresh."""
    from batchlab.formula.opcost import OpCosts, price
    from batchlab.formula.timing import nominal_costs

    ops = update_ops(BASE) + update_ops(BASE.replace(model=dataclasses.replace(BASE.model, attention="sdpa")))
    base = nominal_costs(BASE)
    twice = lambda curve: tuple((x, 2 * r) for x, r in curve)  # noqa: E731
    changes = dict(matmul={k: twice(v) for k, v in base.matmul.items()}, memory=twice(base.memory),
                   strided_bytes_per_s=base.strided_bytes_per_s / 3,
                   element_seconds={k: 2 * v for k, v in base.element_seconds.items()},
                   dispatch={k: 2 * v for k, v in base.dispatch.items()},
                   dtensor_seconds={"forward": 1e-4},
                   dispatch_autocast={k: 3 * v for k, v in base.dispatch.items()}, memory_low=((1.0, 1e9),),
                   memory_inplace=((1.0, 2e9),), matmul_start={"bmm-fp32": ((1e3, 1e-5),), "sdpa-fp32": ((1e3, 1e-5),)},
                   asynchronous=True, link_bytes_per_s=1e9, link_latency_s=1e-5, threads=2, cores=2,
                   contention={"compute": 1.5}, contention_processes=2, rank_skew=0.05,
                   link_cpu_seconds={"message": 1e-5, "byte": 1e-10}, link_warm_latency_s=2e-6,
                   link_chain_seconds={"0": 1e-3},
                   family_dispatch={"hf:gpt2": {"forward": 2.0}}, matmul_intensity=((1e6, 50.0), (1e9, 200.0)), whole_call_rate=True,
                   untimed={"graph-forward": "no C++ compiler"}, source="changed")
    assert set(changes) == {f.name for f in dataclasses.fields(OpCosts)}
    for name, value in changes.items():
        changed = dataclasses.replace(base, **{name: value})
        with uncached():
            reference = price(ops, changed)
        price(ops, base)
        assert price(ops, changed) == reference, name
        assert price(ops, dataclasses.replace(changed)) == reference, name  # an equal copy: the same figures


def test_the_engine_that_steps_fp32_copies_is_never_served_a_bf16_step():
    """Under pure bf16, FSDP2 steps bf16 weights and DeepSpeed fp32 copies: the same micro-batch ops, another step."""
    fsdp = RunConfig(seq=32, micro_batch=2, precision="bf16", dp=2, zero=2)
    deepspeed = fsdp.replace(sharding="deepspeed-zero2")
    with uncached():
        alone = update_ops(deepspeed)
    update_ops(fsdp)  # the FSDP2 update in the cache first
    assert update_ops(deepspeed) == alone
