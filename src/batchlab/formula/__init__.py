"""The calculator: memory, FLOPs and time of one optimizer update from the config (no torch).

``estimate(cfg, calibrations)`` is a pure function: the measured ceilings of ``batchlab calibrate`` come
in as an argument (``calibrate.load_all()``, read by the caller), never from disk here.  Every figure it
returns has provenance "formula".
"""
from __future__ import annotations

import functools

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchlab.config import Backend, ModelSource, RunConfig
from batchlab.formula.activations import describe_impl, implementation
from batchlab.formula.alternatives import Alternative, alternatives
from batchlab.formula.deepspeed import settings as deepspeed_settings
from batchlab.formula.flops import FlopsEstimate, flops, utilisation
from batchlab.formula.kvcache import KVCache, kv_cache
from batchlab.formula.memory import MemoryEstimate, memory, model_states
from batchlab.formula.params import ParamCount, count
from batchlab.formula.pipeline import keeps_outputs, megatron_runtime
from batchlab.formula.profile import layer_terms_source, terms as profile_terms
from batchlab.formula.timing import TimeEstimate, timing
from batchlab.util.units import fmt_bytes, fmt_count

if TYPE_CHECKING:
    from batchlab.formula.calibration import Calibration
    from batchlab.formula.opcost import OpCosts

Calibrations = Mapping[str, "Calibration"]  # measured ceilings by batchlab device name (calibrate.load_all())


@dataclass(frozen=True)
class Estimate:
    config: RunConfig
    params: ParamCount
    memory: MemoryEstimate
    flops: FlopsEstimate
    time: TimeEstimate
    training_checkpoint_bytes: int  # the file saved to disk for recovery (weights + optimizer state), all ranks
    assumptions: tuple[str, ...] = field(default_factory=tuple)
    provenance: str = "formula"
    layer_terms: str = ""  # where the per-layer terms came from: "builtin gpt2", "profile (trace of ...)"
    kv_cache: KVCache | None = None  # transformers' KV cache in the training forward; None: the code has none
    calibrated: bool = False  # the time model priced with this host's measured rates (no datasheet peak)

    @functools.cached_property
    def low_peak_time(self) -> TimeEstimate | None:
        """A card whose source gives its peak only as a range (DeviceSpec.peak_low; the catalogue's figures are the
        high end): the update's time at the low end, worked out when asked (estimate's output, --json), not in
        every estimate a search makes.  None for a known peak, and where measured rates priced the run."""
        low = self.config.device_spec.peak_low
        return None if self.calibrated or not low else timing(self.config.replace(device=low), self.flops,
                                                                self.memory, None)

    @functools.cached_property
    def alternatives(self) -> tuple[Alternative, ...]:
        """Where it does not fit: the preset's other implementations (--impl) under which it would.  Worked out
        when asked (estimate's output), not in every estimate a search or a sweep makes."""
        return alternatives(self.config, self.memory)

    @property
    def global_batch(self) -> int:
        return self.config.global_batch

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation, a fraction (the table shows it as a percentage)."""
        return utilisation(self.flops.model_flops_per_update, self.time.update_seconds, self.config)

    @property
    def hfu(self) -> float | None:
        """Hardware FLOPs utilisation (recompute counted), a fraction."""
        return utilisation(self.flops.hardware_flops_per_update, self.time.update_seconds, self.config)

    def to_dict(self) -> dict[str, Any]:
        from batchlab.config import to_jsonable

        mem = to_jsonable(self.memory)
        mem.update(fits=self.memory.fits, headroom_bytes=self.memory.headroom_bytes)
        return {"provenance": self.provenance, "config": self.config.to_dict(),
                "global_batch": self.global_batch, "tokens_per_update": self.config.tokens_per_update,
                "parameters": self.params.total, "memory": mem,
                "flops": {**to_jsonable(self.flops), "mfu": self.mfu, "hfu": self.hfu},
                "time": to_jsonable(self.time),
                "time_at_low_peak": None if self.low_peak_time is None else {
                    "device": self.config.device_spec.peak_low, **to_jsonable(self.low_peak_time)},
                "training_checkpoint_bytes": self.training_checkpoint_bytes,
                "layer_terms": self.layer_terms, "assumptions": list(self.assumptions),
                "kv_cache": None if self.kv_cache is None else {**to_jsonable(self.kv_cache), "text": self.kv_cache.text},
                "alternatives": [to_jsonable(a) for a in self.alternatives]}


def training_checkpoint_bytes(cfg: RunConfig) -> int:
    """Weights (fp32 master under mixed precision) + optimizer state, summed over ranks."""
    from batchlab.formula.states import optimizer_state_bytes

    n = count(cfg.model).total
    weights = 2 if cfg.precision.value == "bf16" else 4
    return n * weights + optimizer_state_bytes(cfg)


def assumptions_text(cfg: RunConfig, t: TimeEstimate) -> tuple[str, ...]:
    dev = cfg.device_spec
    return (
        f"device {dev.name}: {fmt_bytes(dev.memory_bytes)}, peak {fmt_count(dev.peak_flops(cfg.precision), 'FLOP/s')} "
        f"({cfg.precision}), source: {dev.source}"
        + (f"; memory budget {fmt_bytes(cfg.memory_budget)} replaces the device's" if cfg.memory_budget else ""),
        t.model,
        f"communication: {collectives_text(cfg)}, ring over {fmt_count(t.bandwidth_bytes_per_s, 'B/s')}; "
        f"{t.overlap_source}",
        allocator_text(cfg),
        f"layer terms: {layer_terms(cfg)}",
    ) + ((f"model {cfg.model_source} comes from a factory the calculator cannot see: these figures are for the "
          f"stand-in shape {cfg.model.name} ({cfg.model.layers} layers, hidden {cfg.model.hidden}); use --trace",)
         if cfg.model_kind is ModelSource.FACTORY else ()) + zero1_engine_note(cfg) + training_loop_notes(cfg) \
        + layout_notes(cfg)


def layout_notes(cfg: RunConfig) -> tuple[str, ...]:
    """How a tensor / pipeline layout and a DeepSpeed engine are priced (formula/ranks.py, formula/pipeline.py)."""
    lay, notes = cfg.parallel, []
    if lay.tp * lay.pp > 1:
        notes.append(f"{lay.text()}: memory per rank, one entry per pipeline stage (its TP and DP ranks hold alike); "
                     "the figures are the most loaded stage's. TP splits attention, MLP and, where t divides the "
                     "vocabulary, the embedding, head and loss 1/t (loss_parallel; else whole on every rank; norms, "
                     "position tables, row-parallel biases replicated); activations per Korthikanti et al. 2022 "
                     "Table 2 (norms and dropout masks split only with sequence parallelism, whose column-parallel "
                     "matmuls keep their all-gathered input whole as PyTorch's ColwiseParallel does; selective "
                     "policies split in the whole layer's proportion); a stage keeps its in-flight micro-batches' "
                     "activations (GPipe all m, 1F1B p - stage) and outputs, its receive buffers (one per micro-batch "
                     "each way) and, under 1F1B, an input gradient in its send; a tied embedding has a copy on the "
                     "first and the last stage")
        if profile_terms(cfg) is not None:
            notes.append("layout: the profile's per-layer totals split per rank in the built-in breakdown's "
                         "proportion at this shape; everything else from the built-in terms")
    if lay.engine_spec.deepspeed and lay.dp > 1:
        ds, stage = deepspeed_settings(cfg), lay.engine_spec.stage
        notes.append(f"{lay.engine.value}: model states, phases and collectives priced as PyTorch's "
                     f"ZeRO-{stage} engine, plus DeepSpeed's own buffers at "
                     + ("its config defaults" if not cfg.deepspeed.typed() else "the --deepspeed sizes")
                     + f" (formula/deepspeed.py: reduce bucket {ds.reduce_bucket_size:.3g} elements, fp32 gradient "
                     "partition at the step"
                     + (f"; stage 3's gathered parameters replayed over the module trace, prefetch "
                        f"{ds.stage3_prefetch_bucket_size:.3g}, persistence threshold "
                        f"{ds.stage3_param_persistence_threshold:.3g}, up to {ds.stage3_max_live_parameters:.3g} "
                        "live (formula/deepspeed_gather.py)" if stage == 3 else "")
                     + "); stage 1 and 2 keep the whole 16-bit weights, stage 3 16-bit weight and gradient "
                     f"partitions beside the fp32 master and the fp32 gradients of one {ds.sub_group_size:.3g}-element "
                     "sub-group at the step; DeepSpeed's engine itself is not measured here")
    if lay.engine_spec.megatron:
        notes.append(f"{lay.engine.value}: Megatron-Core's model states (Megatron-LM README: 16-bit weights, an fp32 "
                     "gradient buffer resident throughout, fp32 main params and optimizer state"
                     + (" sharded over DP" if lay.engine_spec.shards_optimizer else "")
                     + "); collectives priced as PyTorch's; Megatron's engine itself is not measured here")
    return tuple(notes)


def training_loop_notes(cfg: RunConfig) -> tuple[str, ...]:
    """What the run's PyTorch version and zero_grad call change in the count (formula only: measure uses its own)."""
    a, notes = cfg.assumptions, []
    if a.torch_before(1, 11):
        notes.append(f"PyTorch {a.torch_version}: softmax and log_softmax also keep their input for backward "
                     "(pytorch#64000, fixed in 1.11)")
    if not a.zero_grad_set_to_none:
        notes.append("zero_grad(set_to_none=False): gradients are zeroed in place and stay live through forward")
    lay = cfg.parallel
    if lay.pipelined and not megatron_runtime(cfg):
        if keeps_outputs(cfg, last=True):
            which = "every stage" if keeps_outputs(cfg, last=False) else "the last stage"
            notes.append(f"PyTorch {a.torch_version}: {which} of the pipeline keeps every micro-batch's output to the "
                         "step's end (output_chunks; only the last stage from 2.8, pytorch PR 153383; none with "
                         "step(return_outputs=False) from 2.10)")
        else:
            notes.append("pipeline: the last stage's outputs counted as step(..., return_outputs=False) leaves them "
                         "(torch >= 2.10); a plain step() keeps all of them to the step's end")
    return tuple(notes)


def collectives_text(cfg: RunConfig) -> str:
    """What the stage's engine sends (formula.sharding)."""
    lay = cfg.parallel
    if cfg.dp == 1:
        return "none at DP 1"
    if lay.engine_spec.deepspeed and lay.stage in (1, 2):
        return (f"DeepSpeed ZeRO-{lay.stage}: gradients reduce-scattered "
                f"{'in every micro-batch' if lay.stage == 2 else 'at the accumulation boundary'}, the updated "
                "16-bit weights all-gathered after the step")
    if lay.shards_gradients and lay.pipelined:  # torch.distributed.pipelining (formula.sharding.traffic)
        return (f"FSDP2 (ZeRO-{lay.stage}) all-gathers{' in every forward and the first backward' if lay.reshards_after_forward else ' once'}"
                ", one reduce-scatter per update after the last backward")
    if lay.shards_gradients:
        return (f"{'DeepSpeed' if lay.engine_spec.deepspeed else 'FSDP2'} (ZeRO-{lay.stage}) all-gathers"
                f"{' (forward and backward)' if lay.reshards_after_forward else ''} and reduce-scatters of every "
                "micro-batch")
    return "DDP's gradient all-reduce once per update" + (
        " + ZeroRedundancyOptimizer's parameter broadcasts after the step" if lay.stage == 1 else "")


def zero1_engine_note(cfg: RunConfig) -> tuple[str, ...]:
    """ZeRO-1 is counted as the ZeRO paper (DeepSpeed) does; PyTorch's engine for it differs under autocast."""
    spec = cfg.parallel.engine_spec
    if spec.stage != 1 or spec.deepspeed or not cfg.precision.mixed:  # DeepSpeed's ZeRO-1 is the count itself
        return ()
    return ("ZeRO-1 counted as ZeRO's paper and DeepSpeed do (16-bit weights and gradients, fp32 master and "
            "optimizer state sharded); PyTorch's DDP + ZeroRedundancyOptimizer under autocast (what batchlab "
            "measures) instead keeps fp32 weights and gradients on every rank and shards only the optimizer "
            "state, and the communication figures are that engine's (fp32 all-reduce and broadcasts)",)


def allocator_text(cfg: RunConfig) -> str:
    if cfg.device_spec.backend is Backend.CPU:
        return "no caching allocator on CPU: allocated = reserved = tensor bytes (as the live-tensor tracker counts)"
    if cfg.assumptions.allocator_margin is not None:
        return f"reserved = allocated + a fixed {cfg.assumptions.allocator_margin:.0%} margin (assumption)"
    return ("reserved = allocated + CUDACachingAllocator segment rounding, freed-buffer fragmentation, stream "
            "pools and cuBLAS workspace (formula/allocator.py); device view = reserved + CUDA context + NCCL")


def unseen_model(cfg: RunConfig) -> str | None:
    """Why the formula cannot describe cfg's model (a user factory it cannot see into), else None."""
    if cfg.model_kind is not ModelSource.FACTORY:
        return None
    return f"the calculator cannot see inside the factory model {cfg.model_source}"


def compiled_note(cfg: RunConfig) -> str | None:
    """Why the formula's figures are not a compiled run's (its layer terms are eager PyTorch's), else None."""
    from batchlab.formula import compiled

    return compiled.missing_note(cfg)


def estimate(cfg: RunConfig, calibrations: Calibrations | None = None) -> Estimate:
    """The formula's figures for ``cfg``: a pure function of its arguments.  ``calibrations``: measured
    ceilings by batchlab device name (``calibrate.load_all()``, read by the caller); the time model uses
    the entry for ``cfg.device`` where there is one, else the device's datasheet figures."""
    mem = memory(cfg)
    fl = flops(cfg)
    costs = calibrated_costs(cfg, calibrations)
    t = timing(cfg, fl, mem, costs)
    return Estimate(config=cfg, params=count(cfg.model), memory=mem, flops=fl, time=t,
                    training_checkpoint_bytes=training_checkpoint_bytes(cfg), assumptions=assumptions_text(cfg, t),
                    layer_terms=layer_terms(cfg), kv_cache=kv_cache(cfg, memory, mem),
                    calibrated=costs is not None)


def layer_terms(cfg: RunConfig) -> str:
    """Where the activation terms come from: the model's own code (a cached profile) or a built-in count of
    the implementation ``--impl`` names (formula/activations.py)."""
    from batchlab.formula import compiled

    if compiled.applies(cfg):
        return compiled.source(cfg)
    impl = implementation(cfg.model_kind, cfg.model)
    return layer_terms_source(cfg, f"count of {describe_impl(impl)}")


def implementation_line(cfg: RunConfig) -> str:
    """estimate's one line on whose code its layer terms describe."""
    impl = implementation(cfg.model_kind, cfg.model)
    if cfg.model_kind is ModelSource.FACTORY:
        return f"Layer terms: {describe_impl(impl)}, a stand-in for the factory's model (use --trace)"
    terms = layer_terms(cfg)
    how = ("the saved-tensor list of its compiled block's partition (formula terms for compiled code)"
           if terms.startswith("formula terms for compiled") else
           "a trace of its code" if terms.startswith("profile") else "a count of the tensors it keeps")
    flag = f" (--impl {cfg.model.impl})" if cfg.model_kind is ModelSource.BUILTIN else ""
    return f"Layer terms: {describe_impl(impl)}{flag}, from {how}"


def calibrated_costs(cfg: RunConfig, calibrations: Calibrations | None) -> "OpCosts | None":
    """The per-op costs measured for cfg's device (``batchlab calibrate``), or None (also where the calibration
    lacks a part cfg's ops are priced with: formula/calibration.py ``needs``)."""
    cal = calibrations.get(cfg.device) if calibrations is not None else None
    return cal.op_costs() if cal is not None and cal.covers(cfg) else None


__all__ = ["Estimate", "estimate", "memory", "flops", "timing", "count", "model_states", "MemoryEstimate",
           "FlopsEstimate", "TimeEstimate", "Calibrations"]
