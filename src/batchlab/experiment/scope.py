"""What a local result cannot support, generated from the devices and configs that produced it.  Torch-free."""
from __future__ import annotations

from batchlab.config import Backend, RunConfig
from batchlab.config.devices import short_sources

SMALL_MODEL_PARAMS = 100_000_000
SMALL_HIDDEN = 1024


def scope(a: RunConfig, b: RunConfig, torch_devices: set[str], measured: bool, parameters: int | None) -> list[str]:
    out: list[str] = []
    if not measured:
        out.append("Formula only: nothing was run; every figure is a paper derivation under the stated "
                   "assumptions, not an observation.")
    kinds = {d.split(":")[0] for d in torch_devices} or {a.device_spec.backend.value}
    if not measured:
        rates = short_sources(a.device_spec)[0]  # the full citation: the formula's assumptions in the record
        out.append(f"The formula's figures are for device {a.device} ({rates}); they say nothing "
                   "about what this machine or any other will measure until a run confirms them.")
    elif "cpu" in kinds or "mps" in kinds:
        what = " and ".join(sorted(k.upper() for k in kinds & {"cpu", "mps"}))
        out.append(f"Measured on {what}: says nothing about GPU kernels (tensor cores, HBM bandwidth, launch "
                   "overhead, the CUDA caching allocator's fragmentation) or cluster communication.")
    if max(a.dp, b.dp) == 1:
        out.append("One device: says nothing about the gradient all-reduce or its overlap with backward.")
    elif "dp" in a.diff(b) or max(a.dp, b.dp) > 1:
        backend = "gloo over loopback" if "cpu" in kinds else "this node's link"
        out.append(f"DP measured with {backend} on one host: says nothing about NCCL over NVLink or InfiniBand, "
                   "nor about multi-node all-reduce time.")
    if measured and max(a.zero, b.zero) > 0 and max(a.dp, b.dp) > 1 and "cpu" in kinds:
        out.append("ZeRO/FSDP measured on gloo over loopback: its all-gathers and reduce-scatters ran on the CPU at "
                   "memory-copy speed and barely overlapped compute; NCCL on GPUs runs them on their own streams, "
                   "prefetching the next block's all-gather behind this block's compute, over links whose "
                   "bandwidth and latency decide the time paid. The memory saved transfers; the time paid does not "
                   "(the collective bytes, counted exactly, do).")
    if a.device_spec.backend is not Backend.CPU and "cpu" in kinds:
        out.append(f"The config names device {a.device} but the run used the CPU: the formula's figures are for "
                   f"{a.device}, the measured ones for this machine.")
    n = parameters or 0
    if measured and (a.model.hidden < SMALL_HIDDEN or (n and n < SMALL_MODEL_PARAMS)):
        size = f"{n / 1e6:.2g} M parameters, " if n else ""
        out.append(f"A small model ({size}hidden {a.model.hidden}): its kernels are dominated by per-op "
                   "overhead, so its kernel efficiency and batch-size effects do not transfer to large models.")
    if measured:
        out.append("A few updates per process: says nothing about convergence, loss curves or generalisation "
                   "at either global batch.")
    return out

