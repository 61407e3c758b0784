"""The device catalogue (data) and its lookup: datasheet entries, aliases, ``custom:...`` and ``local``.

Pure Python: ``local`` asks batchlab.host (nvidia-smi), not torch.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

from batchlab import host
from batchlab.config.choices import Backend, ConfigError, Precision
from batchlab.config.values import finite_number, parse_bytes


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or a CPU).  Peak rates are dense datasheet figures; bandwidths one direction.

    ``memory_bytes`` is the capacity the card reports to PyTorch (``get_device_properties().total_memory``,
    the "total capacity" of a CUDA OOM message), not the marketing GB; ``memory_source`` says where it came
    from or that it is an estimate.  ``context_bytes``: what the CUDA context and loaded kernels take outside
    the caching allocator (part of what nvidia-smi shows).
    """

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
    memory_source: str = "datasheet"
    context_bytes: int = 0
    context_source: str = ""
    arch: str = ""  # volta, ampere, ada, hopper, blackwell, cdna2, cdna3, cpu: picks the cuBLAS workspace
    peak_flops_fp8: float = 0.0  # FLOP/s, dense FP8 tensor cores; 0: the card has none (--fp8 refused)
    fp8_source: str = ""
    # where a source gives the card's peak only as a range: the catalogue entry at its low end (its figures are
    # then the high end), so a prediction can say what it spans; "" where the peak is known
    peak_low: str = ""

    def __post_init__(self):
        object.__setattr__(self, "backend", Backend.parse("backend", self.backend))

    def peak_flops(self, precision: Precision) -> float:  # the 16-bit or fp32 rate (FP8: peak_flops_fp8)
        return self.peak_flops_fp32 if precision is Precision.FP32 else self.peak_flops_bf16


GB = 10**9
GiB = 2**30
MiB = 2**20
T = 10**12

# Sources (full citations in benchmarks/gpu_catalogue.toml, with quotes):
#   torch       the card's torch total_memory / the "total capacity" of a CUDA OOM message, quoted in a public source
#   smi         nvidia-smi's total column (MiB), via modal-labs/modal-client#2797 unless named
#   tt-utils    pytorch/torchtitan torchtitan/tools/utils.py @ b5bcd76c (dense bf16 peaks, vendor URLs beside each)
#   klockwood   glennklockwood.com/garden/processors/{h100,A100} (NVIDIA datasheet tables)
# Estimates, where no reported capacity was found, are labelled "estimate" and use one rule:
# nominal GiB x 0.9899, the H100 80GB's torch total (79.19 GiB, nanochat#443) over its 80 GiB of HBM.
_H100_RESERVE = 79.19 / 80
# CUDA context + kernels outside the allocator: 1343 MiB measured on a V100 with CUDA 11 before lazy loading
# (transformers docs model_memory_anatomy.md @ 249ef816: "GPU memory occupied: 1343 MB").  With CUDA >= 11.7
# lazy module loading (the default since PyTorch 2.0) it is smaller; no published figure found: estimate 0.5 GiB.
_CTX_V100 = (1343 * MiB, "measured on V100, CUDA 11 (transformers model_memory_anatomy.md @ 249ef816)")
_CTX_LAZY = (512 * MiB, "estimate: CUDA >= 11.7 lazy-loaded context, not found published; measure with gpu_check.sh")


def _gpu(name, arch, mem_gib, mem_source, bf16_tf, fp32_tf, hbm_gbs, link_gbs, net_gbs, source, context=_CTX_LAZY):
    return DeviceSpec(name, Backend.CUDA, int(mem_gib * GiB), bf16_tf * T, fp32_tf * T, hbm_gbs * GB, link_gbs * GB,
                      net_gbs * GB, source=source, memory_source=mem_source, context_bytes=context[0],
                      context_source=context[1], arch=arch)


def _est(nominal_gib: float) -> float:
    return nominal_gib * _H100_RESERVE


_EST = "estimate (not found): nominal GiB x 0.9899, the H100 80GB's reported share"
# NVLink figures are per direction (900 GB/s bidirectional on H100 = 450 each way); inter-node one NIC per GPU
# (400 Gb/s NDR = 50 GB/s on Hopper/Blackwell/MI300, 200 Gb/s HDR = 25 GB/s on A100); PCIe Gen4 x16 ~ 25 GB/s,
# Gen5 ~ 50 GB/s per direction.
_GPUS = (
    _gpu("v100-16gb", "volta", 15.78, "smi 16160 MiB = 15.78 GiB (transformers model_memory_anatomy.md @ 249ef816); torch "
         "not found (smi used)", 125, 15.7, 900, 150, 12.5,
         "NVIDIA tensor-core blog (125 TF fp16), fp32 15.7 TF secondary; HBM2 900 GB/s, NVLink2 300 GB/s bidir: "
         "datasheet figures not re-checked here", context=_CTX_V100),
    _gpu("v100-32gb", "volta", 31.73, "estimate: 31.73 GiB, the 'total capacity' of 32 GB-card CUDA OOM "
         "messages that do not name the card; V100 32GB not found",
         125, 15.7, 900, 150, 12.5, "as v100-16gb", context=_CTX_V100),
    _gpu("a10g", "ampere", 22.49 - 0.46, "estimate (not found): smi of the A10 is 23028 MiB (22.49 GiB) -> "
         "22.49 - 0.46 GiB smi-to-torch gap of the H100", 70, 31.2, 600, 25, 12.5,
         "bf16 and fp32 not found for the A10G (AWS throttles the A10): estimate = RTX 3090-class GA102 figures; "
         "600 GB/s GDDR6 (baseten blog)"),
    _gpu("l4", "ada", 22.49 - 0.0, "smi 23034 MiB = 22.49 GiB (modal-2797); torch not found (smi used)", 121, 30.3,
         300, 25, 12.5, "bf16 = half of 242 sparse, 300 GB/s GDDR6 (secondary sources)"),
    _gpu("rtx-3090", "ampere", 23.69, "estimate: 23.69 GiB, the 'total capacity' of unnamed 24 GB-card "
         "OOM messages; smi 24576 MiB (club-3090#1129)", 71, 35.6, 936, 25, 12.5,
         "bf16 71 TF with fp32 accumulate (nanochat#60, GA102 whitepaper); fp32 35.6 and 936 GB/s: datasheet, "
         "not re-checked here"),
    _gpu("rtx-4090", "ada", 23.64, "torch: 'GPU 0 has a total capacity of 23.64 GiB' (an OOM log naming a 24GB 4090)",
         165.2, 82.6, 1008, 25, 12.5, "165.2 TF bf16 fp32-accumulate (nanochat#60), fp32 82.6, 1008 GB/s (secondary)"),
    _gpu("titan-rtx", "turing", 23.69, "estimate (not found): as rtx-3090, the 'total capacity' of unnamed 24 GB-card "
         "OOM messages", 130, 16.3, 672, 12.5, 12.5,
         "130 TF 'deep learning' fp16 tensor (NVIDIA's launch figure, accumulate not stated), fp32 16.3 TF, "
         "672 GB/s GDDR6 (secondary: tomshardware, hothardware); PCIe Gen3 x16"),
    _gpu("rtx-a6000", "ampere", 47.54, "torch: 'GPU 0 has a total capacity of 47.54 GiB' (2xA6000 benchmark log)",
         154.85, 38.7, 768, 56, 12.5, "tt-utils (154.85 dense bf16); fp32 38.7 TF and 768 GB/s: datasheet, not "
         "re-checked here"),
    _gpu("a100-40gb", "ampere", 42405855232 / GiB, "cudaGetDeviceProperties totalGlobalMem 42405855232 B "
         "(upb-pc2 A100 40GB wiki)", 312, 19.5, 1555, 300, 25, "klockwood (NVIDIA A100 datasheet)"),
    _gpu("a100-80gb", "ampere", 79.15, "estimate: 79.15 GiB, the smallest 'total capacity' of unnamed 80 GB-card "
         "OOM messages (79.14-79.33 GiB); smi 81920 MiB (modal-2797)", 312, 19.5, 2039, 300, 25, "tt-utils, klockwood"),
    _gpu("a100-pcie-80gb", "ampere", 79.15, "estimate (not found): as a100-80gb (same 80 GB HBM2e)", 312, 19.5,
         1935, 32, 25, "tt-utils (312 TF); 1935 GB/s (secondary); PCIe Gen4"),
    _gpu("h100-sxm", "hopper", 79.19, "torch: 'GPU has 79.19 GiB total' (nanochat#443, 8x H100 80GB HBM3); "
         "smi 81559 MiB (NVIDIA/nccl#1264)", 989.4, 66.9, 3350, 450, 50, "klockwood (NVIDIA H100 datasheet)"),
    _gpu("h100-pcie", "hopper", 79.19, "estimate (not found): as h100-sxm (same 80 GB)", 756, 51, 2000, 64, 50,
         "tt-utils (756 TF); >2,000 GB/s (H100 PCIe product brief PB-11133-001); fp32 51 TF datasheet, not "
         "re-checked; PCIe Gen5"),
    _gpu("h100-nvl", "hopper", 99961274368 / GiB, "NVML total 99961274368 B = 93.1 GiB (fastfetch#1658); torch "
         "not found", 835, 60, 3900, 300, 50, "tt-utils (835 TF); 3.9 TB/s, NVLink bridge 600 GB/s (secondary)"),
    _gpu("h100-96gb", "hopper", 94.99, "torch: 'CUDA capacity: NVIDIA H100 with 94.99GiB memory' (torchtitan#1625)",
         989, 66.9, 2400, 450, 50, "torchtitan benchmarks/llama3_h100_202412 (2.4 TB/s, 400 Gb/s per GPU); bf16 "
         "peak is an upper bound (between SXM and NVL, 'we don't know its exact value')"),
    _gpu("h200", "hopper", 139.80, "torch: 'GPU 0 has a total capacity of 139.80 GiB' (H200 OOM messages)", 989,
         66.9, 4800, 450, 50, "tt-utils (989 TF); 4.8 TB/s and NVLink 450 GB/s per direction (secondary)"),
    _gpu("b200", "blackwell", 178.35, "cudaGetDeviceProperties 'Total Global Memory: 178.35 GB' [GiB] "
         "(pytorch/ao#4002); smi 183359 MiB (TensorRT-LLM#10278)", 2250, 75, 7672, 900, 50,
         "tt-utils (2.25 PF), 7.672 TB/s (pytorch/ao#4002); fp32 75 TF and NVLink5 1.8 TB/s bidir: datasheet, "
         "not re-checked"),
    _gpu("mi250x", "cdna2", _est(64), _EST + " (one GCD: 64 GB HBM2e)", 191.5, 47.9, 1638, 200, 25,
         "tt-utils (191.5 TF per GCD); fp32 47.9 and 1.6 TB/s per GCD: datasheet halves, not re-checked"),
    _gpu("mi300x", "cdna3", _est(192), _EST + " (192 GB HBM3)", 1307.4, 163.4, 5300, 448, 50,
         "1307.4 TF (tt-utils rounds to 1300), 5.3 TB/s (secondary)"),
    _gpu("mi325x", "cdna3", _est(256), _EST + " (256 GB HBM3e)", 1307.4, 163.4, 6000, 448, 50,
         "awesomeagents.ai MI325X table (secondary)"),
    _gpu("l40s", "ada", 46068 / 1024, "smi 46068 MiB = 44.99 GiB (modal-2797); torch not found (smi used)", 362,
         91.6, 864, 32, 25, "tt-utils (362 TF), 91.6 TF fp32, 864 GB/s (secondary)"),
)

# Dense FP8 peaks (no 2:4 sparsity; full quotes in benchmarks/gpu_catalogue.toml).  Where no figure for the card
# was found, the architecture's own ratio: FP8 tensor cores do twice the 16-bit dense rate on Hopper, Ada, CDNA3
# and Blackwell (H100 SXM 1978.9 vs 989.4 TF, klockwood-h100; B200 4.5 vs 2.25 PF, pytorch/ao#4002).
_DOUBLE = "not found for this card: 2 x its dense bf16 peak, the FP8/bf16 ratio of its architecture's datasheets"
_FP8 = {
    "h100-sxm": (1978.9, "klockwood-h100 (NVIDIA H100 datasheet): 'FP8 | 1978.9 | 3957.8'"),
    "h200": (1978.9, "klockwood-h100: the H100's die ('FP8 | 1978.9 | 3957.8')"),
    "h100-96gb": (1978.9, "as h100-sxm (an upper bound, as its bf16 peak)"),
    "h100-pcie": (2 * 756, _DOUBLE), "h100-nvl": (2 * 835, _DOUBLE),
    "b200": (4500, "pytorch/ao#4002 roofline_utils.py: 'fp8_peak_tops': 4.5e15"),
    "l4": (242.5, "half of the 485 TF sparse figure (secondary: grokipedia NVIDIA_L4_vs_L40S)"),
    "l40s": (2 * 362, _DOUBLE), "rtx-4090": (2 * 165.2, _DOUBLE + " (fp32 accumulate, as its bf16 entry)"),
    "mi300x": (2 * 1307.4, _DOUBLE), "mi325x": (2614.9, "awesomeagents.ai MI325X table (secondary)"),
}
_GPUS = tuple(dataclasses.replace(g, peak_flops_fp8=_FP8[g.name][0] * T, fp8_source=_FP8[g.name][1])
              if g.name in _FP8 else g for g in _GPUS)
# cards whose peak a source gives only as a range: (the card, the card whose peaks are its low end, the entry made
# for that end: the card's memory, HBM and links at the other's peaks)
_PEAK_RANGES = (("h100-96gb", "h100-nvl", "h100-96gb-low"),)


def _low_end(card: DeviceSpec, low: DeviceSpec, name: str) -> DeviceSpec:
    return dataclasses.replace(card, name=name, peak_low="", peak_flops_bf16=low.peak_flops_bf16,
                               peak_flops_fp32=low.peak_flops_fp32, peak_flops_fp8=low.peak_flops_fp8,
                               fp8_source=low.fp8_source,
                               source=f"{card.name} at the low end of its peak range: {low.name}'s peak rates")


_GPUS = tuple(dataclasses.replace(g, peak_low=next((n for c, _, n in _PEAK_RANGES if c == g.name), ""))
              for g in _GPUS)


def _cpu() -> DeviceSpec:
    """This machine's CPU: its memory (host.memory_bytes()); its nominal peak read from the host, cores x clock
    x vector FLOPs per cycle (host.cpu_peak_flops()); memory bandwidth a nominal 10 GB/s — run
    ``batchlab calibrate`` for measured rates.  DP ranks on one host all-reduce over loopback gloo at a nominal
    0.5 GB/s of bus bandwidth (docs/cpu.md, "Figures behind the code's choices")."""
    mem = host.memory_bytes()
    peak, how = host.cpu_peak_flops()
    return DeviceSpec("cpu", Backend.CPU, mem or 16 * GiB, peak, peak, 10e9, 0.5e9, 0.5e9, gpus_per_node=64,
                      source=f"nominal: {how} (run batchlab calibrate)",
                      memory_source="this machine's memory (/proc/meminfo MemTotal)" if mem else
                      "nominal 16 GiB (this machine's memory could not be read)", arch="cpu")


DEVICES: dict[str, DeviceSpec] = {d.name: d for d in _GPUS}
DEVICES |= {name: _low_end(DEVICES[card], DEVICES[low], name) for card, low, name in _PEAK_RANGES}
DEVICES["cpu"] = _cpu()
# the names users type -> catalogue entry
DEVICE_ALIASES = {
    "h100": "h100-sxm", "h100-80gb": "h100-sxm", "h100-sxm5": "h100-sxm", "h100-sxm-80gb": "h100-sxm",
    "h100-80gb-hbm3": "h100-sxm", "h100-pcie-80gb": "h100-pcie", "h100-nvl-94gb": "h100-nvl",
    "h100-sxm-96gb": "h100-96gb", "h200-sxm": "h200", "h200-141gb": "h200", "h200-sxm-141gb": "h200",
    "a100": "a100-80gb", "a100-80gb-sxm": "a100-80gb", "a100-sxm4-80gb": "a100-80gb", "a100-sxm-80gb": "a100-80gb",
    "a100-40gb-sxm": "a100-40gb", "a100-sxm4-40gb": "a100-40gb", "a100-pcie": "a100-pcie-80gb",
    "a100-80gb-pcie": "a100-pcie-80gb", "v100": "v100-32gb", "v100-sxm2-16gb": "v100-16gb",
    "v100-sxm2-32gb": "v100-32gb", "4090": "rtx-4090", "3090": "rtx-3090", "a6000": "rtx-a6000",
    "b200-180gb": "b200", "mi250": "mi250x", "mi300": "mi300x",
}
# GPU name (as the driver reports it) -> catalogue entry; first match wins
GPU_NAMES = (("H200", "h200"), ("H100 NVL", "h100-nvl"), ("H100 PCIe", "h100-pcie"), ("H100 96GB", "h100-96gb"),
             ("H100", "h100-sxm"), ("A100-SXM4-40GB", "a100-40gb"), ("A100-PCIE-40GB", "a100-40gb"),
             ("A100 80GB PCIe", "a100-pcie-80gb"), ("A100", "a100-80gb"), ("B200", "b200"), ("L40S", "l40s"),
             ("L4", "l4"), ("A10G", "a10g"), ("RTX A6000", "rtx-a6000"), ("TITAN RTX", "titan-rtx"), ("RTX 4090", "rtx-4090"),
             ("RTX 3090", "rtx-3090"), ("V100-SXM2-16GB", "v100-16gb"), ("V100", "v100-32gb"),
             ("MI250X", "mi250x"), ("MI300X", "mi300x"), ("MI325X", "mi325x"))


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


CUSTOM_FP32_ASSUMED = "custom; fp32 rate not given, assumed tflops/8 (give fp32_tflops=)"


def _custom_device(text: str) -> DeviceSpec:
    """``custom:mem=80GB,tflops=400,fp32_tflops=50,fp8_tflops=800,hbm=2e12,link=300e9,net=25e9,backend=cuda``."""
    known = {"mem", "tflops", "fp32_tflops", "fp8_tflops", "hbm", "link", "net", "backend"}
    values: dict[str, str] = {}
    for part in filter(None, text.split(":", 1)[1].split(",")):
        k, _, v = part.partition("=")
        if k.strip() not in known or not v:
            raise ConfigError("device", f"custom device takes {', '.join(sorted(known))} as key=value, got {part!r}")
        values[k.strip()] = v.strip()
    if "mem" not in values or "tflops" not in values:
        raise ConfigError("device", "custom device needs at least mem= and tflops=, e.g. custom:mem=80GB,tflops=400")
    rate = {k: finite_number(f"device {k}", values[k], positive=True, maximum=1e30)
            for k in ("tflops", "fp32_tflops", "fp8_tflops", "hbm", "link", "net") if k in values}  # one check: finite, > 0
    tf = rate["tflops"] * T
    return DeviceSpec(text, Backend.parse("device", values.get("backend", "cuda")),
                      parse_bytes("device mem", values["mem"]), tf, rate.get("fp32_tflops", rate["tflops"] / 8) * T,
                      rate.get("hbm", 1e12), rate.get("link", 100e9), rate.get("net", 25e9),
                      source="custom" if "fp32_tflops" in values else CUSTOM_FP32_ASSUMED,
                      peak_flops_fp8=rate.get("fp8_tflops", 0.0) * T, fp8_source="custom" if "fp8_tflops" in values else "")


@functools.lru_cache(maxsize=64)
def device(name: str) -> DeviceSpec:
    if name.strip().lower().startswith("custom:"):
        return _custom_device(name.strip())
    typed = name.strip().lower().replace("_", "-")
    key = DEVICE_ALIASES.get(typed, typed)
    if key == "local":
        key = local_device()
    if key not in DEVICES and re.fullmatch(r"(cuda|gpu|mps|xpu|hip|rocm)(:\d+)?", key):
        raise ConfigError("device", f"{name!r} is a torch device, not a card of the catalogue: use --device local "
                                    f"(this machine's GPU) or a card name (h100-sxm, a100-80gb, ...), and "
                                    f"--torch-device {name} to choose where measure and compare run")
    if key not in DEVICES:
        raise ConfigError("device", f"unknown device {name!r}; known: {', '.join(DEVICES)} "
                                    "(or custom:mem=80GB,tflops=400)")
    return DEVICES[key]


# Short names of the sources, for default terminal output (the full citations stay in ``source`` and
# ``memory_source``, shown under --verbose and in JSON).  Peak rates by catalogue entry:
_RATES_LABEL = {
    "v100-16gb": "NVIDIA blog", "v100-32gb": "NVIDIA blog", "a10g": "estimate", "l4": "secondary sources",
    "rtx-3090": "GA102 whitepaper", "rtx-4090": "secondary sources", "titan-rtx": "secondary sources", "rtx-a6000": "torchtitan table",
    "a100-40gb": "NVIDIA datasheet", "a100-80gb": "NVIDIA datasheet", "a100-pcie-80gb": "torchtitan table",
    "h100-sxm": "NVIDIA datasheet", "h100-pcie": "torchtitan table", "h100-nvl": "torchtitan table",
    "h100-96gb": "torchtitan benchmarks", "h100-96gb-low": "torchtitan table", "h200": "torchtitan table", "b200": "torchtitan table",
    "mi250x": "torchtitan table", "mi300x": "torchtitan table", "mi325x": "secondary sources",
    "l40s": "torchtitan table",
}
# capacity: the first word of ``memory_source`` (the vocabulary of the "Sources" comment above)
_MEMORY_LABEL = (("torch", "PyTorch-reported"), ("cudaGetDeviceProperties", "driver-reported"),
                 ("NVML", "driver-reported"), ("smi", "nvidia-smi"), ("estimate", "estimate"),
                 ("this machine's memory", "/proc/meminfo"), ("nominal", "nominal"))


def short_sources(spec: DeviceSpec) -> tuple[str, str]:
    """(peak rates, capacity) sources as short names: 'NVIDIA datasheet', 'PyTorch-reported', '/proc/meminfo'."""
    if spec.source.startswith("custom"):
        return "your --device", "your --device"
    if spec.backend is Backend.CPU:
        rates = "nominal (/proc/cpuinfo)" if "/proc/cpuinfo" in spec.source else "nominal"
    else:
        rates = _RATES_LABEL.get(spec.name, "catalogue")
    memory = next((label for prefix, label in _MEMORY_LABEL if spec.memory_source.startswith(prefix)), "catalogue")
    return rates, memory
