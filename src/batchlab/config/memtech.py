"""torchtune's memory techniques beyond activation checkpointing, as run options: the optimizer step fused into
backward (``optimizer_in_backward``) and saved activations offloaded to host memory (``offload_activations``);
where each cannot run, one ConfigError naming its field."""
from __future__ import annotations

from batchlab.config.choices import Backend, ConfigError, Precision
from batchlab.config.values import flag


def check(cfg) -> None:
    for name in ("optimizer_in_backward", "offload_activations"):
        flag(name, getattr(cfg, name))
    if cfg.optimizer_in_backward:
        if cfg.accum > 1:
            # torchtune recipes/full_finetune_single_device.py: "Gradient accumulation is not supported with
            # optimizer in bwd."
            raise ConfigError("optimizer_in_backward", f"needs --accum 1 (got {cfg.accum}): each parameter steps and "
                                                       "frees its gradient as backward makes it, so nothing is left "
                                                       "to accumulate (torchtune refuses it too)")
        if cfg.dp * cfg.tp * cfg.pp > 1:
            raise ConfigError("optimizer_in_backward", "is worked out for one rank only: give --dp 1 --tp 1 --pp 1")
        if cfg.precision is Precision.FP16_MIXED:
            # GradScaler.unscale_ checks every gradient for inf/nan before any step: no step may run early
            raise ConfigError("optimizer_in_backward", "cannot run with fp16-mixed (the loss scaler checks all "
                                                       "gradients before stepping): give bf16-mixed, bf16 or fp32")
    if cfg.offload_activations and cfg.device_spec.backend is not Backend.CUDA:
        raise ConfigError("offload_activations", "moves saved activations from a CUDA GPU to host memory: it needs "
                                                 f"a GPU --device ({cfg.device} has no separate memory to offload to)")
