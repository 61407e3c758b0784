"""The one run configuration shared by the calculator, the harness, experiments and the advisor.

Pure Python: importing this module must never import torch (the calculator runs where torch is absent).
Sizes are bytes, times seconds, rates per second; GiB appears only in display code.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A user error in a configuration: one line naming the field and what is allowed."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


class _Choice(str, enum.Enum):
    """A closed set whose values are the spellings users type."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, field_name: str, value: Any):
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ConfigError(field_name, f"{value!r} is not one of: {allowed}") from None


class Precision(_Choice):
    FP32 = "fp32"
    BF16_MIXED = "bf16-mixed"  # bf16 compute, fp32 master weights
    FP16_MIXED = "fp16-mixed"  # fp16 compute, fp32 master weights, dynamic loss scaling
    BF16 = "bf16"  # pure bf16: weights, grads and optimizer state in bf16

    @property
    def compute_bytes(self) -> int:
        """Bytes of one activation element."""
        return 4 if self is Precision.FP32 else 2

    @property
    def mixed(self) -> bool:
        return self in (Precision.BF16_MIXED, Precision.FP16_MIXED)


class OptimizerKind(_Choice):
    ADAMW = "adamw"
    SGD = "sgd"  # plain SGD, no state
    SGD_MOMENTUM = "sgd-momentum"  # one momentum buffer per parameter


class MLPKind(_Choice):
    GELU = "gelu"  # 2 matrices h->ffn->h (GPT-2, Megatron)
    SWIGLU = "swiglu"  # 3 matrices: gate, up, down (Llama)


class NormKind(_Choice):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class AttentionImpl(_Choice):
    EAGER = "eager"  # s x s scores materialised (softmax, dropout mask kept for backward)
    SDPA = "sdpa"  # fused scaled_dot_product_attention: no s^2 term kept


class PositionKind(_Choice):
    LEARNED = "learned"  # GPT-2 position embedding table
    ROPE = "rope"  # rotary (Llama): no parameters


class ACMode(_Choice):
    NONE = "none"
    FULL = "full"
    EVERY = "every"
    SELECTIVE = "selective"


@dataclass(frozen=True)
class ACPolicy:
    """Activation checkpointing: recompute inside one step to save memory.

    Not the training checkpoint (the file saved to disk for recovery).  Spellings: ``none``, ``full``
    (every layer), ``every:K`` (every K-th layer, counting from the first), ``selective`` (every layer keeps
    its matmul outputs and recomputes the cheap element-wise and attention-core ops).
    """

    mode: ACMode = ACMode.NONE
    every: int = 1

    def __post_init__(self):
        if self.every < 1:
            raise ConfigError("ac", f"every:K needs K >= 1, got {self.every}")
        if self.mode is not ACMode.EVERY and self.every != 1:
            raise ConfigError("ac", "K is only meaningful for every:K")

    @classmethod
    def parse(cls, value: Any) -> "ACPolicy":
        if isinstance(value, ACPolicy):
            return value
        text = str(value).strip().lower()
        m = re.fullmatch(r"every:(\d+)", text)
        if m:
            return cls(ACMode.EVERY, int(m.group(1)))
        if text == "every":
            raise ConfigError("ac", "every needs a K: every:K, e.g. every:2")
        try:
            mode = ACMode(text)
        except ValueError:
            raise ConfigError("ac", f"{value!r} is not one of: none, full, every:K, selective") from None
        return cls(mode)

    def __str__(self) -> str:
        return f"every:{self.every}" if self.mode is ACMode.EVERY else self.mode.value

    def wrapped_layers(self, n_layers: int) -> tuple[int, ...]:
        """Indices of the layers whose whole block is recomputed in backward (the one place this is decided)."""
        if self.mode is ACMode.FULL:
            return tuple(range(n_layers))
        if self.mode is ACMode.EVERY:
            return tuple(range(0, n_layers, self.every))
        return ()

    def selective_layers(self, n_layers: int) -> tuple[int, ...]:
        return tuple(range(n_layers)) if self.mode is ACMode.SELECTIVE else ()


class Backend(_Choice):
    CPU = "cpu"
    CUDA = "cuda"  # NVIDIA, and AMD through ROCm's torch.cuda
    MPS = "mps"


def _pos(name: str, value: Any, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be a whole number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(name, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer shape: the calculator's model and the built-in GPT's constructor input."""

    name: str = "custom"
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int | None = None  # None: same as heads (multi-head attention)
    ffn: int | None = None  # None: 4h for GELU, Llama's rounded 8h/3 for SwiGLU
    mlp: MLPKind = MLPKind.GELU
    vocab: int = 512
    tied_embeddings: bool = True
    norm: NormKind = NormKind.LAYERNORM
    dropout: float = 0.0
    attention: AttentionImpl = AttentionImpl.EAGER
    position: PositionKind = PositionKind.LEARNED
    max_positions: int = 1024
    bias: bool = True  # biases on linear layers and norms (GPT-2 yes, Llama no)

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "mlp", MLPKind.parse("mlp", self.mlp))
        set_(self, "norm", NormKind.parse("norm", self.norm))
        set_(self, "attention", AttentionImpl.parse("attention", self.attention))
        set_(self, "position", PositionKind.parse("position", self.position))
        for name in ("layers", "hidden", "heads", "vocab", "max_positions"):
            _pos(name, getattr(self, name))
        if self.kv_heads is None:
            set_(self, "kv_heads", self.heads)
        _pos("kv_heads", self.kv_heads)
        if self.hidden % self.heads:
            raise ConfigError("heads", f"must divide hidden ({self.hidden}), got {self.heads}")
        if self.heads % self.kv_heads:
            raise ConfigError("kv_heads", f"must divide heads ({self.heads}), got {self.kv_heads}")
        if self.ffn is None:
            set_(self, "ffn", default_ffn(self.hidden, self.mlp))
        _pos("ffn", self.ffn)
        for name in ("tied_embeddings", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be true or false, got {getattr(self, name)!r}")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout!r}")
        set_(self, "dropout", float(self.dropout))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_hidden(self) -> int:
        return self.kv_heads * self.head_dim


def default_ffn(hidden: int, mlp: MLPKind) -> int:
    if mlp is MLPKind.GELU:
        return 4 * hidden
    # Llama: 2/3 of 4h, rounded up to a multiple of 256 (Touvron et al. 2023, model code)
    return 256 * ((int(2 * 4 * hidden / 3) + 255) // 256)


_GPT2 = dict(mlp="gelu", norm="layernorm", position="learned", bias=True, tied_embeddings=True,
             vocab=50257, max_positions=1024, dropout=0.0, attention="sdpa")
_LLAMA = dict(mlp="swiglu", norm="rmsnorm", position="rope", bias=False, tied_embeddings=False,
              dropout=0.0, attention="sdpa")

# Shapes from the papers / released configs.  "tiny" and "small" are batchlab's own built-in models.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(layers=4, hidden=128, heads=4, vocab=512, max_positions=256, dropout=0.1,
                 attention="eager", mlp="gelu", norm="layernorm", position="learned", bias=True,
                 tied_embeddings=True),
    "small": dict(layers=6, hidden=384, heads=6, vocab=4096, max_positions=512, dropout=0.1,
                  attention="eager", mlp="gelu", norm="layernorm", position="learned", bias=True,
                  tied_embeddings=True),
    "gpt2": dict(_GPT2, layers=12, hidden=768, heads=12),
    "gpt2-medium": dict(_GPT2, layers=24, hidden=1024, heads=16),
    "gpt2-large": dict(_GPT2, layers=36, hidden=1280, heads=20),
    "gpt2-xl": dict(_GPT2, layers=48, hidden=1600, heads=25),
    "llama-2-7b": dict(_LLAMA, layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000, max_positions=4096),
    "llama-2-13b": dict(_LLAMA, layers=40, hidden=5120, heads=40, ffn=13824, vocab=32000, max_positions=4096),
    "llama-2-70b": dict(_LLAMA, layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000,
                        max_positions=4096),
    "llama-3-8b": dict(_LLAMA, layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                       max_positions=8192),
    "llama-3-70b": dict(_LLAMA, layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256,
                        max_positions=8192),
    # Megatron / Korthikanti et al. 2022 Table 3: 96 layers, h 12288, 96 heads, s 2048
    "gpt3-175b": dict(_GPT2, layers=96, hidden=12288, heads=96, vocab=51200, max_positions=2048,
                      tied_embeddings=True),
}


def preset(name: str, **overrides: Any) -> ModelSpec:
    key = name.strip().lower()
    if key not in PRESETS:
        raise ConfigError("model", f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    values = dict(PRESETS[key])
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ModelSpec(name=key, **values)


def model_from_hf_config(path: str | Path, **overrides: Any) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (GPT-2 or Llama families) from disk; no network, no transformers."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError("hf_config", f"no such file: {p}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError("hf_config", f"cannot read {p} as JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError("hf_config", f"{p} does not hold a JSON object")
    kind = str(raw.get("model_type", "")).lower()
    try:
        if kind in ("gpt2",):
            values = dict(_GPT2, layers=raw["n_layer"], hidden=raw["n_embd"], heads=raw["n_head"],
                          vocab=raw["vocab_size"], max_positions=raw.get("n_positions", 1024),
                          ffn=raw.get("n_inner") or None, tied_embeddings=raw.get("tie_word_embeddings", True),
                          dropout=float(raw.get("resid_pdrop", 0.0) or 0.0))
        elif kind in ("llama", "mistral", "qwen2"):
            values = dict(_LLAMA, layers=raw["num_hidden_layers"], hidden=raw["hidden_size"],
                          heads=raw["num_attention_heads"],
                          kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
                          ffn=raw["intermediate_size"], vocab=raw["vocab_size"],
                          max_positions=raw.get("max_position_embeddings", 4096),
                          tied_embeddings=bool(raw.get("tie_word_embeddings", False)),
                          bias=bool(raw.get("attention_bias", False)))
        else:
            raise ConfigError("hf_config", f"model_type {kind!r} is not supported; supported: gpt2, llama, mistral, qwen2")
    except KeyError as e:
        raise ConfigError("hf_config", f"{p} lacks the field {e.args[0]!r}") from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ModelSpec(name=f"hf:{p}", **values)


# ---------------------------------------------------------------------------------------------- devices

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
    """``--device local``: this machine's first NVIDIA GPU as its catalogue entry (asked of nvidia-smi, so no
    torch import), else ``cpu``.  A GPU the catalogue does not know is an error, never a silent guess."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
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
    try:
        tf = float(values["tflops"]) * T
        return DeviceSpec(text, Backend.parse("device", values.get("backend", "cuda")),
                          parse_bytes("device", values["mem"]), tf,
                          float(values.get("fp32_tflops", float(values["tflops"]) / 8)) * T,
                          float(values.get("hbm", 1e12)), float(values.get("link", 100e9)),
                          float(values.get("net", 25e9)), source="custom")
    except ValueError as e:
        raise ConfigError("device", f"custom device: {e}") from None


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


def parse_bytes(field_name: str, text: Any) -> int:
    """'2GiB', '512MiB', '80GB', '1e9' -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*", str(text))
    if not m:
        raise ConfigError(field_name, f"{text!r} is not a size (examples: 2GiB, 512MiB, 80GB)")
    units = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    try:
        return int(float(m.group(1)) * units[m.group(2)])
    except (ValueError, KeyError):
        raise ConfigError(field_name, f"{text!r} is not a size (examples: 2GiB, 512MiB, 80GB)") from None


# ------------------------------------------------------------------------------------------ run config

class DataKind(_Choice):
    FIXED = "fixed"  # every sequence full length
    PADDED = "padded"  # variable lengths padded to seq; only non-padding tokens are useful


@dataclass(frozen=True)
class Assumptions:
    """The calculator's stated assumptions (printed with every estimate)."""

    achievable_fraction: float = 0.4  # of peak FLOP/s reached by real kernels (MFU-like)
    comm_overlap: float = 0.0  # fraction of the all-reduce hidden behind backward
    allocator_margin: float = 0.05  # fragmentation / caching-allocator slack on top of tensor bytes
    optimizer_bytes_per_param: float | None = None  # overrides the optimizer's own state size
    op_overhead_seconds: float | None = None  # fixed cost per op (dispatch/launch); None: the backend's default

    def __post_init__(self):
        for name, lo, hi in (("achievable_fraction", 0.0, 1.0), ("comm_overlap", 0.0, 1.0),
                             ("allocator_margin", 0.0, 1.0)):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not (lo <= v <= hi) or (name == "achievable_fraction" and v == 0):
                raise ConfigError(name, f"must be a fraction in ({lo}, {hi}], got {v!r}")
        if self.optimizer_bytes_per_param is not None and self.optimizer_bytes_per_param < 0:
            raise ConfigError("optimizer_bytes_per_param", "must be >= 0")
        if self.op_overhead_seconds is not None and not (0 <= self.op_overhead_seconds < 1):
            raise ConfigError("op_overhead_seconds", "must be seconds in [0, 1)")


# Fields users may name in --change / --vary / replace(); model fields route into ModelSpec.
MODEL_FIELDS = tuple(f.name for f in fields(ModelSpec) if f.name != "name")


@dataclass(frozen=True)
class RunConfig:
    """Everything that decides a training step's memory and time.  Frozen and validated.

    ``global_batch`` (sequences per optimizer update) = micro_batch x accum x dp, derived, never stored.
    """

    model: ModelSpec = field(default_factory=lambda: preset("tiny"))
    # which code trains it: "builtin", "hf:<gpt2|path/config.json>", or "package.module:factory"
    model_source: str = "builtin"
    seq: int = 128
    micro_batch: int = 8
    accum: int = 1
    dp: int = 1
    precision: Precision = Precision.FP32
    optimizer: OptimizerKind = OptimizerKind.ADAMW
    ac: ACPolicy = field(default_factory=ACPolicy)
    zero: int = 0  # ZeRO stage over the dp ranks (1: optimizer, 2: +grads, 3: +params; FSDP ~ 3)
    device: str = "cpu"
    memory_budget: int | None = None  # bytes; replaces the device's memory (CPU: a tracked-bytes budget)
    data: DataKind = DataKind.FIXED
    seed: int = 0
    assumptions: Assumptions = field(default_factory=Assumptions)

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "precision", Precision.parse("precision", self.precision))
        set_(self, "optimizer", OptimizerKind.parse("optimizer", self.optimizer))
        set_(self, "ac", ACPolicy.parse(self.ac))
        set_(self, "data", DataKind.parse("data", self.data))
        for name in ("seq", "micro_batch", "accum", "dp"):
            _pos(name, getattr(self, name))
        if not isinstance(self.model_source, str) or not self.model_source:
            raise ConfigError("model_source", "must be builtin, hf:NAME_OR_CONFIG or package.module:factory")
        _pos("zero", self.zero, allow_zero=True)
        _pos("seed", self.seed, allow_zero=True)
        if not isinstance(self.device, str):
            raise ConfigError("device", f"must be a device name, got {self.device!r}")
        if self.zero > 3:
            raise ConfigError("zero", f"must be 0, 1, 2 or 3, got {self.zero}")
        if self.seq > self.model.max_positions:
            raise ConfigError("seq", f"{self.seq} is beyond the model's max_positions ({self.model.max_positions})")
        if self.ac.mode is ACMode.EVERY and self.ac.every > self.model.layers:
            raise ConfigError("ac", f"every:{self.ac.every} asks for K > layers ({self.model.layers})")
        spec = device(self.device)  # raises on an unknown device
        set_(self, "device", spec.name)
        if self.memory_budget is not None:
            set_(self, "memory_budget", parse_bytes("memory_budget", self.memory_budget))
            _pos("memory_budget", self.memory_budget)

    # -- derived
    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accum * self.dp

    @property
    def tokens_per_update(self) -> int:
        return self.global_batch * self.seq

    @property
    def device_spec(self) -> DeviceSpec:
        return device(self.device)

    @property
    def memory_capacity(self) -> int:
        """Bytes available to one rank: the budget if given, else the device's memory."""
        return self.memory_budget if self.memory_budget is not None else self.device_spec.memory_bytes

    def global_batch_text(self) -> str:
        return (f"global batch = micro-batch x accum x DP = {self.micro_batch} x {self.accum} x {self.dp} "
                f"= {self.global_batch} sequences ({self.tokens_per_update:,} tokens per update)")

    # -- changing
    def replace(self, **changes: Any) -> "RunConfig":
        """A validated new config; model field names (layers, hidden, ...) route into the model spec."""
        model_changes = {k: changes.pop(k) for k in list(changes) if k in MODEL_FIELDS}
        unknown = [k for k in changes if k not in RUN_FIELDS and k not in ASSUMPTION_FIELDS]
        if unknown:
            raise ConfigError(unknown[0], f"unknown field; known: {', '.join(CHANGEABLE_FIELDS)}")
        assumption_changes = {k: changes.pop(k) for k in list(changes) if k in ASSUMPTION_FIELDS}
        if model_changes:
            changes["model"] = dataclasses.replace(self.model, **model_changes)
        if assumption_changes:
            changes["assumptions"] = dataclasses.replace(self.assumptions, **assumption_changes)
        return dataclasses.replace(self, **changes)

    def with_global_batch(self, global_batch: int, micro_batch: int | None = None) -> "RunConfig":
        """Re-derive accum so that micro x accum x dp == global_batch (the micro-batch kept unless given)."""
        mb = self.micro_batch if micro_batch is None else micro_batch
        return self.replace(micro_batch=mb, accum=derive_accum(global_batch, mb, self.dp))

    def diff(self, other: "RunConfig") -> dict[str, tuple[Any, Any]]:
        """Changed user-facing fields, model fields by their own names: {field: (self's, other's)}."""
        out: dict[str, tuple[Any, Any]] = {}
        for name in MODEL_FIELDS:
            a, b = getattr(self.model, name), getattr(other.model, name)
            if a != b:
                out[name] = (a, b)
        for name in ASSUMPTION_FIELDS:
            a, b = getattr(self.assumptions, name), getattr(other.assumptions, name)
            if a != b:
                out[name] = (a, b)
        for f in fields(self):
            if f.name in ("model", "assumptions"):
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                out[f.name] = (a, b)
        return out

    def to_dict(self) -> dict[str, Any]:
        return to_jsonable(self)


RUN_FIELDS = tuple(f.name for f in fields(RunConfig))
ASSUMPTION_FIELDS = tuple(f.name for f in fields(Assumptions))
CHANGEABLE_FIELDS = (tuple(n for n in RUN_FIELDS if n not in ("model", "assumptions")) + MODEL_FIELDS
                     + ASSUMPTION_FIELDS)


def derive_accum(global_batch: int, micro_batch: int, dp: int) -> int:
    _pos("global_batch", global_batch)
    _pos("micro_batch", micro_batch)
    _pos("dp", dp)
    per_step = micro_batch * dp
    if global_batch % per_step:
        raise ConfigError("global_batch", f"{global_batch} is not divisible by micro-batch x DP = "
                                          f"{micro_batch} x {dp} = {per_step}")
    return global_batch // per_step


def to_jsonable(obj: Any) -> Any:
    """Dataclasses/enums/policies to plain JSON values (the one serialiser for --json and the notebook)."""
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, ACPolicy):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:  # NaN is not JSON
        return None
    return obj


def config_from_dict(d: dict[str, Any]) -> RunConfig:
    """Inverse of ``to_dict`` (used by subprocess runners, TOML experiment files and the notebook)."""
    d = dict(d)
    model = d.pop("model", None)
    if isinstance(model, dict):
        model = ModelSpec(**model)
    elif isinstance(model, str):
        model = preset(model)
    assumptions = d.pop("assumptions", None)
    if isinstance(assumptions, dict):
        assumptions = Assumptions(**assumptions)
    unknown = [k for k in d if k not in RUN_FIELDS]
    if unknown:
        raise ConfigError(unknown[0], f"unknown field; known: {', '.join(RUN_FIELDS)}")
    kw: dict[str, Any] = dict(d)
    if model is not None:
        kw["model"] = model
    if assumptions is not None:
        kw["assumptions"] = assumptions
    return RunConfig(**kw)


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


@functools.lru_cache(maxsize=1)
def _field_hints() -> dict[str, Any]:
    import typing

    hints: dict[str, Any] = {}
    for cls in (Assumptions, ModelSpec, RunConfig):
        hints.update(typing.get_type_hints(cls))
    return hints


def parse_field_value(name: str, text: Any) -> Any:
    """A --change/--vary/TOML value typed for its field (``micro_batch`` '4' -> 4, ``kv_heads`` 'none' ->
    None); enums and policies are parsed by the config itself."""
    import typing

    if name not in CHANGEABLE_FIELDS:
        raise ConfigError(name, f"unknown field; known: {', '.join(CHANGEABLE_FIELDS)}")
    if not isinstance(text, str):
        return text  # TOML already typed it
    text = text.strip()
    args = typing.get_args(_field_hints()[name]) or (_field_hints()[name],)
    base = next(a for a in args if a is not type(None))
    if type(None) in args and text.lower() == "none":
        return None
    if name == "memory_budget":
        return parse_bytes(name, text)
    if base is bool:
        if text.lower() not in _TRUE | _FALSE:
            raise ConfigError(name, f"{text!r} is not true or false")
        return text.lower() in _TRUE
    for kind, word in ((int, "a whole number"), (float, "a number")):
        if base is kind:
            try:
                return kind(text)
            except ValueError:
                raise ConfigError(name, f"{text!r} is not {word}") from None
    return text


class Keep(_Choice):
    """What a one-variable change holds fixed besides everything else."""

    GLOBAL_BATCH = "global-batch"  # accum re-derived when micro_batch or dp changes
    ACCUM = "accum"  # accum fixed: the global batch (and so the training run) changes


BATCH_FIELDS = ("micro_batch", "accum", "dp")


def keep_global_batch(base: RunConfig, cfg: RunConfig, names: list[str] | tuple[str, ...]) -> RunConfig:
    """cfg (base with ``names`` changed) brought back to base's global batch: a micro-batch or DP change
    re-derives accum, an accum change re-derives the micro-batch (the one place this rule lives)."""
    if not set(names) & set(BATCH_FIELDS):
        return cfg
    g = base.global_batch
    if "micro_batch" in names and "accum" in names:
        raise ConfigError("keep", "micro_batch and accum both change: the global batch cannot be kept by "
                                  "re-deriving one of them; use --keep accum")
    if "accum" in names:
        per = cfg.accum * cfg.dp
        if g % per:
            raise ConfigError("global_batch", f"{g} is not divisible by accum x DP = {cfg.accum} x {cfg.dp} = {per}")
        return cfg.replace(micro_batch=g // per)
    return cfg.with_global_batch(g)


def apply_change(cfg: RunConfig, name: str, value: Any, keep: Keep = Keep.GLOBAL_BATCH) -> RunConfig:
    """cfg with one field changed; with Keep.GLOBAL_BATCH the global batch is kept (keep_global_batch)."""
    new = cfg.replace(**{name: parse_field_value(name, value)})
    return keep_global_batch(cfg, new, [name]) if Keep.parse("keep", keep) is Keep.GLOBAL_BATCH else new


# hf:FAMILY -> the preset whose shape transformers' default config for that family has
HF_FAMILIES = {"llama": "llama-2-7b", "gpt2": "gpt2"}


def resolve_model(arg: str, **overrides: Any) -> tuple[ModelSpec, str]:
    """``--model``'s value -> (shape for the calculator, model_source for the harness)."""
    if not isinstance(arg, str) or not arg.strip():
        raise ConfigError("model", "must be a preset name, hf:NAME_OR_CONFIG.json or package.module:factory")
    arg = arg.strip()
    if arg.startswith("hf:"):
        target = HF_FAMILIES.get(arg[3:], arg[3:])
        spec = model_from_hf_config(target, **overrides) if target.endswith(".json") else preset(target, **overrides)
        return spec, arg
    if ":" in arg:  # package.module:factory — the calculator cannot see inside it; the shape is a stand-in
        return preset("tiny", **overrides), arg
    return preset(arg, **overrides), "builtin"


def config_from_table(table: Any, base: RunConfig | None = None) -> RunConfig:
    """A TOML ``[config]`` table (what ``batchlab fit`` writes, what experiment files hold) on top of ``base``.

    RunConfig field names; ``model`` is a preset name, ``hf:...``/``package.module:factory``, or a
    ``[config.model]`` table of ModelSpec fields; model and assumption fields may also be given flat;
    ``global_batch`` re-derives accum.
    """
    if not isinstance(table, dict):
        raise ConfigError("config", "must be a table of RunConfig fields")
    values = dict(table)
    cfg = base or RunConfig()
    model = values.pop("model", None)
    if isinstance(model, dict):
        try:
            cfg = cfg.replace(model=ModelSpec(**model))
        except TypeError as e:
            raise ConfigError("model", f"[config.model]: {e}") from None
    elif model is not None:
        spec, source = resolve_model(model)
        cfg = cfg.replace(model=spec, model_source=source)
    assumptions = values.pop("assumptions", None)
    if isinstance(assumptions, dict):
        values.update(assumptions)
    global_batch = values.pop("global_batch", None)
    unknown = [k for k in values if k not in CHANGEABLE_FIELDS and k not in ("model_source",)]
    if unknown:
        raise ConfigError(unknown[0], f"unknown field; known: model, global_batch, {', '.join(CHANGEABLE_FIELDS)}")
    try:
        cfg = cfg.replace(**values)
    except TypeError as e:
        raise ConfigError("config", str(e)) from None
    if global_batch is not None:  # as --global-batch: the micro-batch is the table's, else 1
        cfg = cfg.with_global_batch(global_batch, micro_batch=values.get("micro_batch", 1))
    return cfg


def load_config_toml(path: str | Path, base: RunConfig | None = None) -> RunConfig:
    """The ``[config]`` table of a TOML file (as ``batchlab fit`` writes it) as a RunConfig."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError("config", f"no such file: {p}") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError("config", f"cannot read {p} as TOML: {e}") from None
    if not isinstance(raw.get("config"), dict):
        raise ConfigError("config", f"{p} has no [config] table")
    return config_from_table(raw["config"], base)
