"""Which tensor / pipeline layouts batchlab measures, and how each rank runs them.  Torch-free: the launcher
refuses the rest with one ConfigError naming the field before it starts a rank.

Measured: tensor parallelism (with or without sequence parallelism) and pipeline parallelism (GPipe, 1F1B,
interleaved 1F1B) on the built-in GPT, alone or together, with data parallelism over them as FSDP2 (``--zero 2/3``)
or as one gradient all-reduce per update (``--zero 0``); tensor parallelism (no sequence parallelism) and pipeline
parallelism on a Llama-family Hugging Face model (other Hugging Face classes are refused when the rank builds the
model, ``hf_stage.check_llama_like``).  Refused: factory models, ZeroRedundancyOptimizer
with tensor or pipeline ranks, fp16's loss scaling with them, a pipeline with the chunked loss, DeepSpeed's engines.
"""
from __future__ import annotations

from typing import Any

from batchlab.config import CompileMode, ConfigError, Implementation, LossMode, ModelSource, Precision, RunConfig


def applies(cfg: RunConfig) -> bool:
    """Does the config have tensor or pipeline ranks (else the data-parallel engines of engines.py run it)?"""
    return cfg.parallel.tensor_parallel or cfg.parallel.pipelined


def _builtin(cfg: RunConfig) -> bool:
    return cfg.model_kind is ModelSource.BUILTIN and cfg.model.impl is Implementation.BATCHLAB


def check(cfg: RunConfig) -> None:
    """The layouts measured here; one ConfigError naming the field for the rest."""
    layout = cfg.parallel
    if layout.dp > 1 and not layout.engine_spec.measured:
        runner = "Megatron-LM" if layout.engine_spec.megatron else "DeepSpeed"
        raise ConfigError("sharding", f"{layout.engine.value} is priced by the formula only ({runner} is not run "
                                      "here): measure its PyTorch counterpart, --zero "
                                      f"{layout.engine_spec.stage}, or use `batchlab estimate`")
    if cfg.compile is not CompileMode.NONE and layout.world_size > 1:  # models/compiled.py refuses it in a rank too
        raise ConfigError("compile", "a compiled run is measured and traced in one process for now (DP = 1); "
                                     "compiled DDP/FSDP runs are future work")
    if not applies(cfg):
        return
    if layout.pipelined and not _builtin(cfg) and cfg.model_kind is not ModelSource.HF:
        raise ConfigError("pp", "measured pipeline parallelism cuts the built-in GPT or a Llama-family Hugging Face "
                                "model into stages; for a factory model use `batchlab estimate`")
    if layout.tensor_parallel and not _builtin(cfg) and cfg.model_kind is not ModelSource.HF:
        raise ConfigError("tp", "measured tensor parallelism splits the built-in GPT's or a Llama-family Hugging Face "
                                "model's layers; for other models use `batchlab estimate`")
    if layout.sequence_parallel and not _builtin(cfg):
        raise ConfigError("sequence_parallel", "measured sequence parallelism is planned for the built-in GPT only; "
                                               "measure the Hugging Face model with --tp alone")
    if layout.pipelined and cfg.loss.mode is not LossMode.FULL:
        raise ConfigError("loss", "a measured pipeline computes the full loss on its last stage: use --loss full")
    if layout.sequence_parallel and cfg.loss.mode is not LossMode.FULL:
        raise ConfigError("loss", "the chunked loss reads the final norm's output, which sequence parallelism leaves "
                                  "split over the ranks: measure --sequence-parallel with --loss full")
    if cfg.precision is Precision.FP16_MIXED:  # GradScaler's unscale takes no mix of sharded and plain gradients
        raise ConfigError("precision", "fp16-mixed's loss scaling is not run over tensor or pipeline ranks here: "
                                       "measure bf16-mixed, bf16 or fp32")
    if layout.sequence_parallel and cfg.seq % layout.tp:
        raise ConfigError("seq", f"{cfg.seq} does not split into {layout.tp} equal sequence-parallel slices")
    if layout.dp > 1 and layout.engine_spec.shards_optimizer and not layout.fsdp:
        raise ConfigError("zero", "ZeroRedundancyOptimizer (ZeRO-1) is not combined with tensor or pipeline ranks "
                                  "here: measure --zero 0 (gradients all-reduced over DP) or --zero 2/3 (FSDP2)")


def describe(cfg: RunConfig) -> dict[str, Any]:
    """The per-rank ``engine`` record (as engines.describe gives it for pure data parallelism)."""
    layout = cfg.parallel
    parts = []
    if layout.tensor_parallel:
        parts.append("DTensor parallelize_module (Colwise/Rowwise"
                     + (", SequenceParallel)" if layout.sequence_parallel else ")"))
    if layout.pipelined:
        parts.append(f"torch.distributed.pipelining {layout.schedule_spec.api}, {cfg.accum} micro-batches"
                     + (f", {layout.virtual} stages per rank" if layout.chunks > 1 else ""))
    if layout.fsdp:
        parts.append(f"FSDP2 fully_shard on the dp mesh, reshard_after_forward={layout.reshards_after_forward}")
    elif layout.dp > 1:
        parts.append("gradients all-reduced over the dp group once per update, after the last backward")
    return dict(stage=layout.stage, name=layout.engine.value if layout.dp > 1 else "none", engine="; ".join(parts),
                accumulation="pipeline schedule" if layout.pipelined else "micro-batch loop",
                sync_every_micro_batch=layout.fsdp)
