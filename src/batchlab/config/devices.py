"""The device catalogue (data) and its lookup: datasheet entries, aliases, ``custom:...`` and ``local``.

Pure Python: ``local`` asks batchlab.host (nvidia-smi), not torch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from batchlab import host
from batchlab.config.choices import Backend, ConfigError, Precision
from batchlab.config.values import finite_number, parse_bytes


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or a CPU).  Peak rates are dense datasheet figures; bandwidths one direction."""

    name: str
    backend: Backend
    memory_bytes: int
    peak_flops_bf16: float  # FLOP/s, dense tensor-core bf16/fp16
    peak_flops_fp32: float  # FLOP/s, fp32 (non-TF32) — what fp32 training gets without TF32
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float  # per-GPU link to peers in the node (NVLink / Infinity Fabric / PCIe)
    inter_node_bytes_per_s: float  # per-GPU network bandwidth between nodes
    gpus_per_node: int = 8
    source: str = "datasheet"

    def __post_init__(self):
        object.__setattr__(self, "backend", Backend.parse("backend", self.backend))

    def peak_flops(self, precision: Precision) -> float:
        return self.peak_flops_fp32 if precision is Precision.FP32 else self.peak_flops_bf16


GB = 10**9
GiB = 2**30
T = 10**12

# NVIDIA / AMD datasheets (dense, no sparsity).  NVLink figures are per-direction (900 GB/s bidirectional
# on H100 = 450 GB/s each way); inter-node is one 400 Gb/s NDR (H100/H200/MI300X) or 200 Gb/s HDR (A100)
# NIC per GPU.
DEVICES: dict[str, DeviceSpec] = {
    "h100-sxm": DeviceSpec("h100-sxm", Backend.CUDA, 80 * GB, 989 * T, 67 * T, 3.35e12, 450 * GB, 50 * GB),
    "h200": DeviceSpec("h200", Backend.CUDA, 141 * GB, 989 * T, 67 * T, 4.8e12, 450 * GB, 50 * GB),
    "a100-40gb": DeviceSpec("a100-40gb", Backend.CUDA, 40 * GB, 312 * T, 19.5 * T, 1.555e12, 300 * GB, 25 * GB),
    "a100-80gb": DeviceSpec("a100-80gb", Backend.CUDA, 80 * GB, 312 * T, 19.5 * T, 2.039e12, 300 * GB, 25 * GB),
    "l40s": DeviceSpec("l40s", Backend.CUDA, 48 * GB, 362 * T, 91.6 * T, 0.864e12, 32 * GB, 25 * GB),
    "mi300x": DeviceSpec("mi300x", Backend.CUDA, 192 * GB, 1307 * T, 163.4 * T, 5.3e12, 448 * GB, 50 * GB),
    # A generic CPU: memory is a nominal 16 GiB unless a budget is given; rates are nominal for a 2-core
    # AVX-512 server VM (2 cores x 2.6 GHz x 32 fp32 FLOP/cycle ~ 160 GFLOP/s; measured matmuls reach 64-87) —
    # run `batchlab calibrate` for measured ones.  DP ranks on one host all-reduce over loopback gloo
    # (~0.5 GB/s bus bandwidth seen here under load).
    "cpu": DeviceSpec("cpu", Backend.CPU, 16 * GiB, 160e9, 160e9, 10e9, 0.5e9, 0.5e9, gpus_per_node=64,
                      source="nominal (run batchlab calibrate)"),
}
DEVICE_ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb"}
# GPU name (as the driver reports it) -> catalogue entry; first match wins
GPU_NAMES = (("H200", "h200"), ("H100", "h100-sxm"), ("A100-SXM4-40GB", "a100-40gb"), ("A100-PCIE-40GB", "a100-40gb"),
             ("A100", "a100-80gb"), ("L40S", "l40s"), ("MI300X", "mi300x"))


def catalogue_key(gpu_name: str) -> str | None:
    return next((key for pattern, key in GPU_NAMES if pattern in gpu_name), None)


@functools.lru_cache(maxsize=1)
def local_device() -> str:
    """``--device local``: this machine's first NVIDIA GPU as its catalogue entry, else ``cpu``.  A GPU the
    catalogue does not know is an error, never a silent guess."""
    names = host.gpu_names()
    if not names:
        return "cpu"
    key = catalogue_key(names[0])
    if key is None:
        raise ConfigError("device", f"the local GPU {names[0]!r} is not in the catalogue; give "
                                    "--device custom:mem=...,tflops=... (and run batchlab calibrate)")
    return key


def _custom_device(text: str) -> DeviceSpec:
    """``custom:mem=80GB,tflops=400,fp32_tflops=50,hbm=2e12,link=300e9,net=25e9,backend=cuda``."""
    known = {"mem", "tflops", "fp32_tflops", "hbm", "link", "net", "backend"}
    values: dict[str, str] = {}
    for part in filter(None, text.split(":", 1)[1].split(",")):
        k, _, v = part.partition("=")
        if k.strip() not in known or not v:
            raise ConfigError("device", f"custom device takes {', '.join(sorted(known))} as key=value, got {part!r}")
        values[k.strip()] = v.strip()
    if "mem" not in values or "tflops" not in values:
        raise ConfigError("device", "custom device needs at least mem= and tflops=, e.g. custom:mem=80GB,tflops=400")
    rate = {k: finite_number(f"device {k}", values[k], positive=True, maximum=1e30)
            for k in ("tflops", "fp32_tflops", "hbm", "link", "net") if k in values}  # one check: finite, > 0
    tf = rate["tflops"] * T
    return DeviceSpec(text, Backend.parse("device", values.get("backend", "cuda")),
                      parse_bytes("device mem", values["mem"]), tf, rate.get("fp32_tflops", rate["tflops"] / 8) * T,
                      rate.get("hbm", 1e12), rate.get("link", 100e9), rate.get("net", 25e9), source="custom")


@functools.lru_cache(maxsize=64)
def device(name: str) -> DeviceSpec:
    if name.strip().lower().startswith("custom:"):
        return _custom_device(name.strip())
    key = DEVICE_ALIASES.get(name.strip().lower(), name.strip().lower())
    if key == "local":
        key = local_device()
    if key not in DEVICES:
        raise ConfigError("device", f"unknown device {name!r}; known: {', '.join(DEVICES)} "
                                    "(or custom:mem=80GB,tflops=400)")
    return DEVICES[key]
