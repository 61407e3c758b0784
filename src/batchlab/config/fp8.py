"""The FP8 training recipes (``--fp8``): what each library casts, keeps and sends when the transformer blocks'
linear layers run as FP8 GEMMs; attention, norms, the LM head and the optimizer stay in the run's precision.

Torch-free data; the formula reads it (formula/fp8.py): the GEMMs' rate, the casts' traffic, what the layers save
for backward and keep between micro-batches, the width of FSDP2's all-gather.  Formula only: no CPU has FP8
tensor cores, so nothing here is measured by batchlab (``measure`` refuses it).
"""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.config.choices import Choice, ConfigError, Precision


class FP8Recipe(Choice):
    NONE = "none"
    # torchao Float8Linear, recipe "tensorwise": one dynamic scale per tensor (torchao/float8/config.py)
    TENSORWISE = "tensorwise"
    # the same with enable_fsdp_float8_all_gather and precompute_float8_dynamic_scale_for_fsdp (torchtitan's
    # float8 options): FSDP2 casts each weight shard to fp8 before gathering it
    TENSORWISE_ALLGATHER = "tensorwise-allgather"
    # torchao recipe "rowwise": a scale per row of each operand (axiswise granularity)
    ROWWISE = "rowwise"
    # NVIDIA Transformer Engine's te.Linear / LayerNormLinear / LayerNormMLP under fp8_autocast (NeMo,
    # Megatron-Core --fp8-format hybrid): delayed scaling from an amax history
    TE = "te"


@dataclass(frozen=True)
class FP8Spec:
    """One recipe: bytes per element of what it casts, saves and sends (bf16 operands: 2 bytes in)."""

    library: str
    # bytes one GEMM operand's cast moves per element: torchao's dynamic scaling reads the bf16 tensor for its
    # amax, then reads it again and writes the fp8 copy (2 + 2 + 1); TE's delayed scaling takes the scale from
    # the amax history and writes the fp8 copy and its transpose in one cast-transpose kernel (2 + 1 + 1)
    cast_bytes: int
    # each block linear's input as saved for backward: torchao saves the high-precision input
    # (float8_linear.py, matmul_with_hp_or_float8_args: ctx.save_for_backward(input_hp, weight_hp_t)); TE saves
    # its fp8 cast (module/linear.py: saved_inputmat = inputmat, the quantized input, columnwise usage only)
    saved_input_fp8: bool
    # TE keeps each weight's fp8 copy and its transpose between micro-batches (is_first_microbatch: the weight is
    # cast once per update): bytes per block linear parameter; torchao casts it in every forward and backward
    weight_cache_bytes: int
    fsdp_fp8_all_gather: bool  # the weight shards are cast to fp8 before FSDP2's all-gather (1 byte gathered)

    @property
    def weight_cast_per_update(self) -> bool:
        return self.weight_cache_bytes > 0


SPECS: dict[FP8Recipe, FP8Spec] = {
    FP8Recipe.TENSORWISE: FP8Spec("torchao Float8Linear (tensorwise)", 5, False, 0, False),
    FP8Recipe.TENSORWISE_ALLGATHER: FP8Spec("torchao Float8Linear (tensorwise, fp8 all-gather)", 5, False, 0, True),
    FP8Recipe.ROWWISE: FP8Spec("torchao Float8Linear (rowwise)", 5, False, 0, False),
    FP8Recipe.TE: FP8Spec("Transformer Engine", 4, True, 2, False),
}


def spec(recipe: FP8Recipe) -> FP8Spec | None:
    return SPECS.get(recipe)


def check(cfg) -> None:
    """One ConfigError naming --fp8 where the recipe cannot run: a device without FP8 tensor cores, fp32 weights,
    or an fp8 all-gather without FSDP2 sharding the parameters."""
    if cfg.fp8 is FP8Recipe.NONE:
        return
    dev = cfg.device_spec
    if not dev.peak_flops_fp8:
        raise ConfigError("fp8", f"{cfg.fp8} needs a device with FP8 tensor cores (h100-sxm, h200, h100-96gb, "
                                 f"b200, l40s, l4, mi300x, ... or custom:...,fp8_tflops=N); {dev.name} has none")
    if cfg.precision is Precision.FP32:
        raise ConfigError("fp8", "FP8 linear layers run inside 16-bit training: give --precision bf16-mixed, bf16 "
                                 "or bf16-fsdp")
    spec_ = SPECS[cfg.fp8]
    if spec_.fsdp_fp8_all_gather and not cfg.parallel.fsdp:
        raise ConfigError("fp8", "tensorwise-allgather is FSDP2's fp8 all-gather: it needs --zero 2 or 3 (FSDP2) "
                                 "with --dp > 1; use tensorwise otherwise")
