"""DeepSpeed's bf16 / fp16 modes cast the module to 16 bits and run it without autocast (runtime/engine.py
``module.bfloat16()`` / ``module.half()``): the time model prices the ops that run, counted here by hand on the
tiny GPT (4 blocks, h 128, ffn 512, vocabulary 512, biases; micro-batch 8 x 128 tokens = 1,024 tokens)."""
from __future__ import annotations

import pytest

from batchlab.config import RunConfig
from batchlab.config.phase import Phase
from batchlab.formula.oplist import micro_batch_ops

T, H = 8 * 128, 128


def _casts(cfg: RunConfig, phase: Phase) -> int:
    return sum(o.count for o in micro_batch_ops(cfg) if o.name == "_to_copy" and o.phase is phase)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_deepspeed_16_bit_module_pays_no_autocast_casts(precision):
    fsdp = RunConfig(precision=precision, dp=2, zero=2)
    ds = RunConfig(precision=precision, dp=2, zero=2, sharding="deepspeed-zero2")
    # autocast (FSDP2's mixed precision): per block 4 linears x (weight, bias) + the two norm outputs fed to qkv and
    # fc1, then the head's weight and input: 4 x 10 + 2 = 42 casts to 16 bits in forward (+ logits.float())
    assert sum(o.count for o in micro_batch_ops(fsdp) if o.name == "_to_copy" and o.phase is Phase.FORWARD
               and o.low_precision) == 42
    # DeepSpeed's 16-bit module: nothing to cast, either way
    assert _casts(ds, Phase.FORWARD) == _casts(ds, Phase.BACKWARD) == 0


def test_deepspeed_norms_and_matmuls_move_16_bit_bytes():
    ds = RunConfig(precision="bf16-mixed", dp=2, zero=2, sharding="deepspeed-zero2")
    ops = micro_batch_ops(ds)
    norms = [o for o in ops if o.name == "native_layer_norm" and o.phase is Phase.FORWARD]
    # 2 per block + the final norm; each reads x and writes y (1,024 x 128 x 2 bytes each), reads its weight and
    # bias (128 x 2 each), writes fp32 mean and rstd (1,024 x 4 each)
    assert sum(o.count for o in norms) == 9
    assert {o.bytes for o in norms} == {2 * T * H * 2 + 2 * H * 2 + 2 * T * 4}
    # forward matmuls: qkv 128->384, proj 128->128, fc1 128->512, fc2 512->128 (addmm: input, weight, output, bias)
    # per block, and the head 128->512 without bias, all 2 bytes an element
    block = sum(T * i + i * o + T * o + o for i, o in ((128, 384), (128, 128), (128, 512), (512, 128)))
    head = T * 128 + 128 * 512 + T * 512
    assert sum(o.bytes * o.count for o in ops if o.name in ("mm", "addmm") and o.phase is Phase.FORWARD) \
        == (4 * block + head) * 2
    assert all(o.low_precision for o in ops if o.name in ("mm", "addmm"))
