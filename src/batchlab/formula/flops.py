"""FLOPs per optimizer update: model FLOPs (MFU) and hardware FLOPs with recompute (HFU)."""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.config import ACMode, Applied, LossMode, RunConfig
from batchlab.formula.activations import implementation
from batchlab.formula.checkpointing import recompute_flops_per_token
from batchlab.formula.params import count


@dataclass(frozen=True)
class FlopsEstimate:
    model_flops_per_token: float  # 6N + 12·L·h·s: what MFU counts
    recompute_flops_per_token: float  # extra forward work of activation checkpointing
    model_flops_per_update: float  # all ranks
    hardware_flops_per_update: float  # model + recompute, all ranks: what HFU counts
    flops_per_micro_batch: float  # hardware FLOPs of one micro-batch on one rank
    provenance: str = "formula"


def compute_params(cfg: RunConfig) -> int:
    """N in 6N: non-embedding weights plus the LM head's matmul (a lookup table costs no FLOPs); a pooled
    classifier has no LM head."""
    c = count(cfg.model)
    head = 0 if cfg.loss.mode is LossMode.CLASSIFIER else cfg.model.vocab * cfg.model.hidden
    return c.non_embedding + head


def flops(cfg: RunConfig) -> FlopsEstimate:
    m, s = cfg.model, cfg.seq
    n = compute_params(cfg)
    # PaLM (Chowdhery et al. 2022) appendix B: 6N + 12·L·h·s per token, no causal halving.
    per_token = 6 * n + 12 * m.layers * m.hidden * s
    # Recompute re-runs forward: a wrapped layer 2·N_layer + 4·h·s per token (Korthikanti et al. 2022
    # sec. 5 give 8N + 16Lhs for full recompute), less the MLP's output projection (2·h·f): PyTorch's
    # non-reentrant checkpoint stops recomputing once every saved tensor is rebuilt (early stop), and that
    # last matmul's output is saved by nothing.  Selective re-runs only the attention core, 4·h·s.
    per_layer_forward = 2 * count(m).per_layer - 2 * m.hidden * m.ffn + 4 * m.hidden * s
    wrapped = len(cfg.ac.wrapped_layers(m.layers))
    impl = implementation(cfg.model_kind, m)
    recompute = wrapped * per_layer_forward + sum(n * recompute_flops_per_token(mode, m, s, impl)
                                                  for mode, n in cfg.ac.selective_kinds(m.layers).items())
    tokens = cfg.tokens_per_update
    return FlopsEstimate(
        model_flops_per_token=per_token, recompute_flops_per_token=recompute,
        model_flops_per_update=per_token * tokens, hardware_flops_per_update=(per_token + recompute) * tokens,
        flops_per_micro_batch=(per_token + recompute) * cfg.micro_batch * s)


def utilisation(flops_per_update: float, update_seconds: float, cfg: RunConfig) -> float | None:
    """Fraction of all ranks' peak FLOP/s one update used: MFU with model FLOPs, HFU with hardware FLOPs
    (Chowdhery et al. 2022, appendix B), over world size = DP x TP x PP devices.  Peak: the device's datasheet
    (or nominal) rate for the precision."""
    peak = cfg.device_spec.peak_flops(cfg.precision) * cfg.parallel.world_size
    return flops_per_update / (update_seconds * peak) if update_seconds > 0 and peak > 0 else None


def stage_flops_per_token(cfg: RunConfig, layers: tuple[int, ...], last: bool) -> float:
    """Hardware FLOPs per token of one pipeline stage's layers (with their recompute) and, on the last stage, the
    final norm and LM head: the terms of ``flops`` split by layer, so the stages add up to the whole model's."""
    m, s = cfg.model, cfg.seq
    c = count(m)
    impl = implementation(cfg.model_kind, m)
    modes = cfg.ac.layer_modes(m.layers)

    def layer(mode: ACMode) -> float:
        base = 6 * c.per_layer + 12 * m.hidden * s  # PaLM appendix B, one layer's share of 6N + 12·L·h·s
        if mode.spec.applied is Applied.WHOLE_BLOCK:
            return base + 2 * c.per_layer - 2 * m.hidden * m.ffn + 4 * m.hidden * s
        return base + (recompute_flops_per_token(mode, m, s, impl) if mode.spec.recomputes else 0)

    head = 6 * (compute_params(cfg) - c.non_embedding) + 6 * c.final_norm if last else 0
    return sum(layer(modes[i]) for i in layers) + head
