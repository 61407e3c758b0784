"""What the time model reads beside the datasheet: the achievable fraction of peak per device and precision,
grounded in published runs, the bus bandwidth a collective gets, and how much communication each engine hides
behind compute.  Pure data and small functions (no torch); formula/timing.py applies them.

The fraction is of *hardware* FLOPs (with recompute) over the dense peak, the quantity the time model divides
by, i.e. the HFU the published runs imply (docs/accuracy/published_mfu.md, benchmarks/published_runs.toml; the
median over the runs of each card class and precision that were not held out).
"""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.config import Backend, Precision, RunConfig
from batchlab.formula.sharding import collective_seconds, gathered_bytes_per_element, unit_elements


@dataclass(frozen=True)
class Sourced:
    value: float
    source: str


_A100 = ("A100 bf16 FSDP: torchtitan Llama 2 13B/70B on 64 GPUs and llm-foundry MPT-7b (median HFU 0.61 of 7 runs; "
         "torchtitan docs/performance.md @ 613bfd0c '13B | 2 | no | 2162 | 61.1%', llm-foundry benchmarking README "
         "@ 49521837 '7b | 2048 | 8 | a100_80gb | 64.23')")
_H100 = ("H100 bf16 FSDP: torchtitan Llama 3.1 8B and llm-foundry MPT 1b/7b (median HFU 0.42 of 5 runs; "
         "llama3_h100_202412_torchtitan.md '33% to 39% MFU', llm-foundry '7b | 2048 | 8 | h100_80gb | 46.44')")
_V100_FP32 = ("V100 fp32 HF Trainer BERT-large for sequence classification (HFU 0.57 and 0.47: transformers "
              "model_memory_anatomy.md 'Samples/second: 8.86', perf_train_gpu_one 'Samples/second: 5.99')")
_V100_FP16 = ("V100 fp16 AMP: median HFU 0.15 of HF Trainer BERT-large eager (0.15, 0.10) and nanoGPT compiled "
              "(0.38, nanoGPT#215 'mfu 15.34%' of 312 TF); eager code reaches a third of compiled")
_ADA = ("RTX 4090 bf16 nanoGPT compiled: 0.55 (nanoGPT#182 '29% MFU' of the A100's 312 TF; low confidence), "
        "used for the consumer / workstation Ampere and Ada cards")
_EST = "not found published: estimate = {} value"

# (arch, 16-bit?) -> achievable fraction of the dense peak
FRACTIONS: dict[tuple[str, bool], Sourced] = {
    ("ampere", True): Sourced(0.61, _A100),
    ("hopper", True): Sourced(0.42, _H100),
    ("blackwell", True): Sourced(0.42, _EST.format("Hopper's") + " (the one B200 run found is MoE: 14%)"),
    ("cdna2", True): Sourced(0.42, _EST.format("Hopper's")),
    ("cdna3", True): Sourced(0.42, _EST.format("Hopper's")),
    ("volta", True): Sourced(0.15, _V100_FP16),
    ("ada", True): Sourced(0.55, _ADA),
    ("volta", False): Sourced(0.52, _V100_FP32),
}
# consumer / workstation Ampere cards behave like Ada ones in the evidence we have
_CONSUMER = ("a10g", "l4", "rtx-3090", "rtx-4090", "rtx-a6000", "l40s")
DEFAULT = Sourced(0.4, "assumption: no published figure for this device and precision (batchlab's old default)")


def achievable_fraction(cfg: RunConfig) -> Sourced:
    """The user's --achievable-fraction if given, else the published default for the device and precision."""
    if cfg.assumptions.achievable_fraction is not None:
        return Sourced(cfg.assumptions.achievable_fraction, "assumption (--achievable-fraction)")
    dev = cfg.device_spec
    if dev.backend is not Backend.CUDA:
        return DEFAULT
    sixteen = cfg.precision is not Precision.FP32
    arch = "ada" if dev.name in _CONSUMER else dev.arch
    if not sixteen:  # fp32 without TF32: the one published class is Volta's, near peak on any card
        return FRACTIONS[("volta", False)]
    return FRACTIONS.get((arch, True), DEFAULT)


def bus_bandwidth(cfg: RunConfig) -> Sourced:
    """Bus bandwidth of a ring collective over cfg.dp ranks.  Within a node: the GPU's link.  Across nodes NCCL
    runs one ring per NIC (rail), so a node moves gpus_per_node NICs' worth: gpus_per_node x the per-GPU
    network bandwidth, capped by the link inside the node."""
    dev = cfg.device_spec
    if cfg.dp <= dev.gpus_per_node:
        return Sourced(dev.intra_node_bytes_per_s, "link inside the node")
    bw = min(dev.intra_node_bytes_per_s, dev.gpus_per_node * dev.inter_node_bytes_per_s)
    return Sourced(bw, f"{dev.gpus_per_node} NICs per node (one ring per rail), capped by the node's link")


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
        return Sourced(comm * (1 - cfg.assumptions.comm_overlap), "assumption (--comm-overlap)")
    if comm <= 0:
        return Sourced(0.0, "no communication")
    bw = bus_bandwidth(cfg).value
    if cfg.zero >= 2:
        units = unit_elements(cfg)
        first = units[0] + (units[-1] if cfg.zero >= 3 and len(units) > 1 else 0)
        exposed = cfg.accum * collective_seconds("all_gather", first * gathered_bytes_per_element(cfg), cfg.dp, bw)
        return Sourced(min(comm, max(0.0, comm - compute) + exposed),
                       "FSDP2 prefetch: hidden behind forward and backward, the first unit's all-gather of each "
                       "forward (ZeRO-3: and of each backward) exposed")
    during = comm - after_step
    last_bucket = min(during, 2 * 25 * 2**20 / bw)
    step = "; ZeroRedundancyOptimizer's broadcasts after the step exposed" if after_step else ""
    return Sourced(max(0.0, during - 2 / 3 * micro) + last_bucket + after_step,
                   "DDP buckets: hidden behind backward (of the last micro-batch), the last bucket exposed" + step)
