"""DeepSpeed ZeRO-3's model states and step buffers as its source allocates them (deepspeed/runtime/zero/stage3.py
@ edaa72212): the 16-bit weight partition beside the fp32 master, a 16-bit gradient partition held from init, and
the fp32 gradients of one optimizer sub-group at a time.  References are hand counts from that source."""
from __future__ import annotations

from batchlab.config import RunConfig
from batchlab.config.model import preset
from batchlab.formula import deepspeed
from batchlab.formula.ranks import share

N = 6_738_415_616  # llama-2-7b's parameters (Hugging Face num_parameters())


def _cfg(**kw) -> RunConfig:
    base = dict(model=preset("llama-2-7b"), seq=256, micro_batch=1, dp=2, sharding="deepspeed-zero3",
                precision="bf16-mixed", ac="full", device="a100-80gb")
    return RunConfig(**{**base, **kw})


def test_stage3_steps_one_sub_group_of_fp32_gradients_at_a_time():
    # partition N / 2 = 3,369,207,808 elements > sub_group_size 1e9: _prepare_fp32_grad_for_sub_group builds
    # flatten(16-bit grads of 1e9 elements) -> 2e9 bytes, then .to(fp32) -> 4e9 bytes, freed by _release_sub_group
    cfg = _cfg()
    assert deepspeed.step_buffers(cfg, share(cfg, 0)) == {"deepspeed fp32 gradient partition": 4 * 10**9,
                                                          "deepspeed 16-bit gradient flatten": 2 * 10**9}
    # in fp32 the cast returns the flat copy itself: 4 bytes an element once
    cfg = _cfg(precision="fp32")
    assert deepspeed.step_buffers(cfg, share(cfg, 0)) == {"deepspeed fp32 gradient partition": 4 * 10**9,
                                                          "deepspeed 16-bit gradient flatten": 0}
    # stage 1 and 2 step on the whole partition at once (stage_1_and_2.py single_partition_of_fp32_groups)
    cfg = _cfg(sharding="deepspeed-zero2")
    assert deepspeed.step_buffers(cfg, share(cfg, 0)) == {"deepspeed fp32 gradient partition": 4 * N // 2}


def test_stage3_keeps_16_bit_weight_and_gradient_partitions_beside_the_fp32_master():
    # what FSDP2's phases hold under bf16 mixed precision at the step: fp32 shards as master, fp32 gradient shards
    # and AdamW's per-tensor temporaries; DeepSpeed's stage 3 holds instead the bf16 partition of the weights
    # (fp16_partitioned_groups_flat, 2 x N / 2 bytes), the bf16 gradient partition (grad_partitions_flat_buffer,
    # gradient_accumulation_dtype = the model's dtype) and steps FusedAdam in place over the flat sub-group
    cfg = _cfg()
    fsdp = {"optimizer": {"parameters": 0, "master": 4 * N // 2, "gradients": 4 * N // 2, "optimizer": 8 * N // 2,
                          "temporaries": 123, "activations": 0},
            "forward": {"parameters": 5, "master": 4 * N // 2, "gradients": 0, "optimizer": 8 * N // 2,
                        "temporaries": 7, "activations": 11}}
    out = deepspeed.engine_states(cfg, share(cfg, 0), fsdp)
    assert out["optimizer"] == {"parameters": N, "master": 2 * N, "gradients": N, "optimizer": 4 * N,
                                "temporaries": 0, "activations": 0}
    # the gradient partition is allocated at init: live in the first forward too; FSDP2's gathered units (the 5
    # bytes) give way to DeepSpeed's own gathered parameters (deepspeed live parameters): the partition alone stays
    assert out["forward"]["gradients"] == N and out["forward"]["parameters"] == N
    assert out["forward"]["temporaries"] == 7
    # fp32: the master is the partition itself (_create_fp32_partitions reuses it), gradients fp32
    cfg = _cfg(precision="fp32")
    fp32 = {"optimizer": dict(fsdp["optimizer"], parameters=4 * N // 2, master=0)}
    out = deepspeed.engine_states(cfg, share(cfg, 0), fp32)["optimizer"]
    assert out["parameters"] == 4 * N // 2 and out["gradients"] == 4 * N // 2 and out["temporaries"] == 0


def test_deepspeed_mixed_precision_runs_the_cast_module_without_autocast():
    # engine.py _configure_distributed_model casts the module (module.bfloat16()) and accelerate turns native AMP
    # off under DeepSpeed: a fully recomputed block keeps its input in bf16 (s x b x h x 2 bytes), where autocast
    # keeps the fp32 residual stream (x 4) under PyTorch's own engines
    from batchlab.formula.activation_plan import activation_plan
    ds, fsdp = _cfg(), _cfg(sharding=None, zero=3)
    assert activation_plan(ds).per_layer_kept[0] == 256 * 4096 * 2
    assert activation_plan(fsdp).per_layer_kept[0] == 256 * 4096 * 4


def test_a_sub_group_holds_at_least_one_parameters_partition():
    # sub_group_size typed at 1e6: _create_fp16_sub_groups closes a sub-group at the first parameter that reaches it,
    # so the embedding's partition (32,000 x 4,096 / 2 = 65,536,000 elements) is one sub-group on its own
    from batchlab.config.deepspeed import DeepSpeedSettings

    cfg = _cfg(deepspeed=DeepSpeedSettings(sub_group_size=10**6))
    assert deepspeed.step_buffers(cfg, share(cfg, 0)) == {"deepspeed fp32 gradient partition": 4 * 65_536_000,
                                                          "deepspeed 16-bit gradient flatten": 2 * 65_536_000}


def test_a_sub_groups_floor_is_this_ranks_largest_parameter():
    # under TP 2 the embedding holds 32,000 / 2 rows on each rank: 16,000 x 4,096 / 2 DP ranks = 32,768,000 elements
    from batchlab.config.deepspeed import DeepSpeedSettings

    cfg = _cfg(deepspeed=DeepSpeedSettings(sub_group_size=10**6), tp=2)
    assert deepspeed.step_buffers(cfg, share(cfg, 0))["deepspeed fp32 gradient partition"] == 4 * 32_768_000
