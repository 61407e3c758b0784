"""Saved activations offloaded to host memory (torchtune ``enable_activation_offloading``): what stays on the
device and what the copies cost (no torch).

torchtune training/_activation_offloading.py ``OffloadActivations``: a saved-tensors hook copies every saved
tensor of at least ``min_offload_size`` (1024) bytes that is not a parameter to pinned host memory on a side
stream; the forward keeps the last ``max_fwd_stash_size`` (5) offloaded tensors alive until their copies finish;
backward brings each back as its autograd node needs it and frees the previous node's.  The output projection
runs under a NoOpManager (training/_activation_offloading.py ``get_act_offloading_ctx_manager``): what the
layers' outside keeps (final norm, LM head input, loss) stays on the device.
"""
from __future__ import annotations

from batchlab.config import Precision, RunConfig
from batchlab.formula.activation_plan import ActivationPlan

FORWARD_STASH = 5  # OffloadActivations(max_fwd_stash_size=5)
BACKWARD_NODES = 2  # the current node's tensors and the previous node's, freed when the next node starts

# host link per GPU by architecture: PCIe x16 per direction (PCI-SIG: Gen3 8 GT/s, Gen4 16, Gen5 32; 128b/130b)
_PCIE_GEN = {"volta": 3, "turing": 3, "ampere": 4, "ada": 4, "cdna2": 4, "hopper": 5, "blackwell": 5, "cdna3": 5}


def host_link_bytes_per_s(cfg: RunConfig) -> float:
    return 16 * 2 ** (_gen(cfg) - 3) * 8e9 / 8 * 128 / 130


def _gen(cfg: RunConfig) -> int:
    return _PCIE_GEN.get(cfg.device_spec.arch, 4)


def host_link_text(cfg: RunConfig) -> str:
    """Where the copies' rate comes from: a PCIe generation assumed from the device's architecture."""
    arch = cfg.device_spec.arch or "unknown"
    return (f"PCIe Gen{_gen(cfg)} x16 assumed for the {arch} architecture, "
            f"{host_link_bytes_per_s(cfg) / 1e9:.1f} GB/s per direction")


def largest_saved(cfg: RunConfig, plan: ActivationPlan) -> int:
    """The largest tensor a layer saves: a recomputed layer's whole kept input, else its widest activation
    (the MLP's inner or the hidden width) as the forward computes it."""
    m, e = cfg.model, 4 if cfg.precision is Precision.FP32 else 2
    widest = cfg.seq * cfg.micro_batch * max(m.ffn, m.hidden) * e
    return max((min(k, widest) for k in plan.per_layer_kept), default=0)


def offloaded_bytes(cfg: RunConfig, plan: ActivationPlan) -> int:
    """Bytes copied to the host per micro-batch (and back): every layer's kept activations."""
    return sum(plan.per_layer_kept) if cfg.offload_activations else 0


def backward_on_device(cfg: RunConfig, plan: ActivationPlan) -> int | None:
    """The most of the layers' kept bytes back on the device during backward (None: nothing offloaded)."""
    return BACKWARD_NODES * largest_saved(cfg, plan) if cfg.offload_activations else None


def phases(cfg: RunConfig, phases: dict[str, dict[str, int]], plan: ActivationPlan,
           walked: bool = True) -> dict[str, dict[str, int]]:
    """The layers' kept activations leave the device: forward keeps the stash; backward (``walked``: placed by
    the backward walk layer by layer, else capped at its high point) the nodes in use."""
    if not cfg.offload_activations:
        return phases
    layers = sum(plan.per_layer_kept)
    on_device = {"forward": min(layers, FORWARD_STASH * largest_saved(cfg, plan))}
    if not walked:
        on_device["backward"] = min(layers, backward_on_device(cfg, plan))
    out = dict(phases)
    for ph, keep in on_device.items():
        parts = phases[ph]
        out[ph] = dict(parts, activations=max(parts["activations"] - layers, 0) + keep)
    return out


def exposed_seconds(cfg: RunConfig, compute_seconds: float) -> float:
    """Copy time not hidden behind compute: both directions over the host link, on a side stream that overlaps
    forward and backward (torchtune use_streams=True)."""
    return 0.0 if not cfg.offload_activations else max(0.0, _copy_seconds(cfg) - compute_seconds)


def _copy_seconds(cfg: RunConfig) -> float:
    from batchlab.formula.activation_plan import activation_plan

    return 2 * cfg.accum * offloaded_bytes(cfg, activation_plan(cfg)) / host_link_bytes_per_s(cfg)
