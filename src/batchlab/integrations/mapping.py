"""The framework's configuration (``Settings``) mapped to a RunConfig, with the reasons where it does not map.

Torch-free: the callbacks pass plain values (the HF model config as a dict).
"""
from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from batchlab.config import ACPolicy, ConfigError, ModelSpec, OptimizerKind, Precision, RunConfig, \
    local_device, model_from_hf_config
from batchlab.config.acpolicies import whole_block
from batchlab.config.optimizers import from_live
from batchlab.experiment.observed import Settings

# the frameworks' precision names -> batchlab's (Lightning "32-true", HF TrainingArguments bf16/fp16 flags)
PRECISION = {"fp32": Precision.FP32, "32-true": Precision.FP32, "32": Precision.FP32,
             "bf16-mixed": Precision.BF16_MIXED, "16-mixed": Precision.FP16_MIXED,
             "fp16-mixed": Precision.FP16_MIXED, "bf16-true": Precision.BF16}


def model_from_hf_dict(raw: dict[str, Any]) -> ModelSpec:
    """A ModelSpec from an HF config dict (``model.config.to_dict()``), read by config.model_from_hf_config."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(raw))
        spec = model_from_hf_config(path)
    return dataclasses.replace(spec, name=f"hf:{raw.get('model_type', 'model')}")


def hf_checkpointing(model) -> bool:
    """Whether a Hugging Face model recomputes activations (transformers 5 renamed the deprecated
    ``is_gradient_checkpointing`` to ``is_activation_checkpointing``)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _ac(s: Settings) -> ACPolicy:
    if not s.gradient_checkpointing:
        return ACPolicy()
    return ACPolicy.every_kth(s.checkpoint_every) if s.checkpoint_every > 1 else ACPolicy(whole_block())


def run_config(s: Settings, hf_config: dict[str, Any] | None = None,
               momentum: float | None = None) -> tuple[RunConfig | None, list[str]]:
    """(RunConfig or None, what did not map).  None when the model shape, micro-batch or sequence is unknown:
    the formula needs all three."""
    unmapped: list[str] = []
    model = None
    if hf_config is not None:
        try:
            model = model_from_hf_dict(hf_config)
        except ConfigError as e:
            unmapped.append(f"model: {e}")
    else:
        unmapped.append(f"model: {s.model or 'the module'} is not a Hugging Face GPT-2 / Llama-family model; "
                        "the formula needs its shape")
    if s.micro_batch is None or s.accum is None:
        unmapped.append("micro-batch / accumulation: the framework did not report them")
    if s.seq is None:
        unmapped.append("seq: the inputs were not token sequences (input_ids)")
    precision = PRECISION.get(s.precision)
    if precision is None:
        unmapped.append(f"precision {s.precision!r}: no batchlab equivalent; fp32 assumed for the formula")
    optimizer = from_live(s.optimizer, momentum)  # the optimizer catalogue recognises it
    if optimizer is None:
        unmapped.append(f"optimizer {s.optimizer or '?'}: no batchlab equivalent; AdamW assumed for the formula")
    if s.gradient_checkpointing is None:
        unmapped.append("activation checkpointing: not detectable in this model; none assumed for the formula")
    try:
        device = "cpu" if s.device.startswith("cpu") else local_device()
    except ConfigError as e:
        unmapped.append(f"device: {e}; cpu assumed for the formula")
        device = "cpu"
    if model is None or s.micro_batch is None or s.accum is None or s.seq is None:
        return None, unmapped
    try:
        cfg = RunConfig(model=model, model_source=model.name, seq=s.seq, micro_batch=s.micro_batch, accum=s.accum,
                        dp=s.world_size, precision=precision or Precision.FP32,
                        optimizer=optimizer or OptimizerKind.ADAMW, device=device,
                        ac=_ac(s))
    except ConfigError as e:
        unmapped.append(str(e))
        return None, unmapped
    return cfg, unmapped
