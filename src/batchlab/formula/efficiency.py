"""What the time model reads beside the datasheet: the achievable fraction of peak per device and precision,
derived from published runs, the bus bandwidth a collective gets, and how much communication each engine hides
behind compute.  Pure data and small functions (no torch); formula/timing.py applies them.

The fraction is a quantity of the time model itself: the rate large matmuls reach, as a fraction of the dense
peak, in the per-op model that also prices element-wise work, copies, the loss and the optimizer by bytes at HBM
bandwidth.  ``benchmarks/published.py --derive`` solves, for each published run of benchmarks/published_runs.toml
that is *not* held out, for the f that makes the model's predicted update time equal the published one (the time
falls monotonically with f: bisection), and FRACTIONS holds the median per (arch, 16-bit) class (the page
docs/accuracy/published-fractions.md lists every run's f).  Runs marked ``holdout`` are never used; nor are
runs whose matmuls the command cannot express (Float8 modelled as bf16).  tests/formula/test_gpu_figures.py
re-derives the medians and checks them against FRACTIONS, so the two cannot drift apart.
"""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.config import Backend, Precision, RunConfig
from batchlab.formula.sharding import collective_seconds, gathered_bytes, unit_elements


@dataclass(frozen=True)
class Sourced:
    value: float
    source: str
    short: str = ""  # the source in a few words, for default output ("published A100 runs", "assumed")


_DERIVED = ("median of {n} non-held-out runs, derived by benchmarks/published.py --derive under the per-op model "
            "that prices element-wise work by bytes ({runs})")
_A100 = _DERIVED.format(n=7, runs="A100 bf16 FSDP: torchtitan Llama 2 13B/70B on 64 GPUs, torchtitan docs/performance.md "
                        "@ 613bfd0c '13B | 2 | no | 2162 | 61.1%'; llm-foundry MPT-7b, benchmarking README @ 49521837 "
                        "'7b | 2048 | 8 | a100_80gb | 64.23'")
_H100 = _DERIVED.format(n=5, runs="H100 bf16 FSDP: torchtitan Llama 3.1 8B, llama3_h100_202412_torchtitan.md '33% to "
                        "39% MFU'; llm-foundry MPT 1b/7b, '7b | 2048 | 8 | h100_80gb | 46.44'")
_V100_FP32 = _DERIVED.format(n=2, runs="V100 fp32 HF Trainer BERT-large for sequence classification: transformers "
                             "model_memory_anatomy.md 'Samples/second: 8.86', perf_train_gpu_one 'Samples/second: 5.99'")
_V100_FP16 = _DERIVED.format(n=3, runs="V100 fp16 AMP: HF Trainer BERT-large eager, perf_train_gpu_one 'Samples/second: "
                             "18.64' and '10.09'; nanoGPT compiled, nanoGPT#215 'mfu 15.34%'")
_ADA = ("A100's derived value: the one published run (RTX 4090 bf16 nanoGPT compiled, nanoGPT#182 '29% MFU', low "
        "confidence) is faster than the model at any fraction <= 1 (benchmarks/published.py --derive)")
_EST = "not found published: estimate = {} value"

# (arch, 16-bit?) -> achievable fraction of the dense peak on large matmuls
FRACTIONS: dict[tuple[str, bool], Sourced] = {
    ("ampere", True): Sourced(value=0.65, source=_A100, short="published A100 runs"),
    ("hopper", True): Sourced(value=0.52, source=_H100, short="published H100 runs"),
    ("blackwell", True): Sourced(value=0.52, source=_EST.format("Hopper's") + " (the one B200 run found is MoE: 14%)",
                                 short="estimate: Hopper's"),
    ("cdna2", True): Sourced(value=0.52, source=_EST.format("Hopper's"), short="estimate: Hopper's"),
    ("cdna3", True): Sourced(value=0.52, source=_EST.format("Hopper's"), short="estimate: Hopper's"),
    ("volta", True): Sourced(value=0.23, source=_V100_FP16, short="published V100 runs"),
    ("ada", True): Sourced(value=0.65, source=_ADA, short="A100's value"),
    ("volta", False): Sourced(value=0.65, source=_V100_FP32, short="V100 fp32 runs"),
}
# consumer / workstation Ampere cards behave like Ada ones in the evidence we have
_CONSUMER = ("a10g", "l4", "rtx-3090", "rtx-4090", "rtx-a6000", "l40s")
DEFAULT = Sourced(value=0.4,
                  source="assumption: no published figure for this device and precision (batchlab's old default)",
                  short="assumed")


def fraction_class(cfg: RunConfig) -> tuple[str, bool] | None:
    """The (arch, 16-bit?) key of FRACTIONS that cfg's device and precision read; None off CUDA.  fp32 without
    TF32 reads Volta's class on any card (the one published fp32 class; fp32 matmuls run near peak)."""
    dev = cfg.device_spec
    if dev.backend is not Backend.CUDA:
        return None
    if cfg.precision is Precision.FP32:
        return ("volta", False)
    return ("ada" if dev.name in _CONSUMER else dev.arch, True)


def achievable_fraction(cfg: RunConfig) -> Sourced:
    """The user's --achievable-fraction if given, else the derived default for the device and precision."""
    if cfg.assumptions.achievable_fraction is not None:
        return Sourced(value=cfg.assumptions.achievable_fraction, source="assumption (--achievable-fraction)",
                       short="--achievable-fraction")
    key = fraction_class(cfg)
    return DEFAULT if key is None else FRACTIONS.get(key, DEFAULT)


def bus_bandwidth(cfg: RunConfig) -> Sourced:
    """Bus bandwidth of a ring collective over cfg.dp ranks.  Within a node: the GPU's link.  Across nodes NCCL
    runs one ring per NIC (rail), so a node moves gpus_per_node NICs' worth: gpus_per_node x the per-GPU
    network bandwidth, capped by the link inside the node."""
    dev = cfg.device_spec
    if cfg.dp <= dev.gpus_per_node:
        return Sourced(value=dev.intra_node_bytes_per_s, source="link inside the node")
    bw = min(dev.intra_node_bytes_per_s, dev.gpus_per_node * dev.inter_node_bytes_per_s)
    return Sourced(value=bw, source=f"{dev.gpus_per_node} NICs per node (one ring per rail), capped by the node's link")


def exposed_comm_seconds(cfg: RunConfig, comm: float, compute: float, micro: float, after_step: float = 0.0
                         ) -> Sourced:
    """The part of ``comm`` (seconds per update, formula.sharding's bytes of the stage) not hidden behind
    compute, per engine.  ``after_step``: the part of ``comm`` issued after the optimizer step, which nothing
    hides (ZeroRedundancyOptimizer's parameter broadcasts, ZeRO-1).

    DDP (ZeRO-0/1) all-reduces gradient buckets during the backward of the last micro-batch (no_sync before
    it): hidden up to that backward (~2/3 of a micro-batch), the last bucket (25 MiB, DDP's bucket_cap_mb)
    always exposed.  FSDP2 (ZeRO-2/3) prefetches the next unit's all-gather while the current one computes
    and reduce-scatters each block while the previous one computes: hidden up to the whole compute, except
    what nothing runs beside, in every micro-batch: the root unit's all-gather (embeddings, head) at the start
    of forward and, ZeRO-3, the last block's again at the start of backward (formula.sharding's unit bytes)."""
    if cfg.assumptions.comm_overlap is not None:
        return Sourced(value=comm * (1 - cfg.assumptions.comm_overlap), source="assumption (--comm-overlap)")
    if comm <= 0:
        return Sourced(value=0.0, source="no communication")
    spec = cfg.parallel.engine_spec
    if spec.deepspeed and spec.stage in (1, 2):
        # zero_optimization.overlap_comm defaults to false below stage 3 (DeepSpeedZeroConfig): the gradient
        # reduction runs on the compute stream inside backward, and the weights' all-gather after the step
        return Sourced(value=comm, source="DeepSpeed ZeRO-1/2 at its default overlap_comm=false: the reduce inside "
                                          "backward and the all-gather after the step, nothing hidden")
    bw = bus_bandwidth(cfg).value
    if cfg.parallel.shards_gradients:
        units = unit_elements(cfg)
        first = units[:1] + (units[-1:] if cfg.parallel.reshards_after_forward and len(units) > 1 else ())
        exposed = cfg.accum * collective_seconds("all_gather", gathered_bytes(cfg, first), cfg.dp, bw)
        return Sourced(value=min(comm, max(0.0, comm - compute) + exposed),
                       source="FSDP2 prefetch: hidden behind forward and backward, the first unit's all-gather of "
                              "each forward (ZeRO-3: and of each backward) exposed")
    during = comm - after_step
    last_bucket = min(during, 2 * 25 * 2**20 / bw)
    step = "; ZeroRedundancyOptimizer's broadcasts after the step exposed" if after_step else ""
    return Sourced(value=max(0.0, during - 2 / 3 * micro) + last_bucket + after_step,
                   source="DDP buckets: hidden behind backward (of the last micro-batch), the last bucket exposed"
                          + step)
