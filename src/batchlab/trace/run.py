"""One steady-state training update of the model's own code on fake tensors (nothing is allocated).

The harness's Trainer runs unchanged under ``FakeTensorMode``: the same model source, the same activation
checkpointing wrapping, the same accumulation loop and optimizer.  A first update creates AdamW's state
(AdamW makes it lazily); the second is tracked with the same StorageTracker the CPU measurement uses, so a
trace and a real run of the same config count the same storages, and its recorded ops give the FLOPs.
"""
from __future__ import annotations

import contextlib
import time
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensorMode, UnsupportedOperatorException)

from batchlab.config.fp8 import FP8Recipe
from batchlab.config import Backend, ConfigError, ModelSource, Precision, RunConfig
from batchlab.formula.allocator import cublas_workspace, device_memory
from batchlab.util.units import fmt_bytes
from batchlab.measure.clock import Listeners
from batchlab.measure.device import torch_device
from batchlab.measure.harness import Trainer
from batchlab.measure.memory import storage_bytes, tracker_for
from batchlab.measure.shards import local_shard, local_shards
from batchlab.formula import calibrated_costs
from batchlab.formula.opdescribe import describe
from batchlab.formula.timing import costs_for, machine_text, on_host
from batchlab.distributed.measurable import applies
from batchlab.trace import sharded
from batchlab.trace.cuda_policy import NOTE as CUDA_NOTE, cuda_kernels
from batchlab.trace.flops import flops_of
from batchlab.trace.ops import OpRecorder
from batchlab.trace.patches import caught_warnings, eager_branches, fake_deepcopy, library_logs
from batchlab.trace.replay import replay_note, replays, streams
from batchlab.trace.result import TraceEstimate, TraceFlops, TraceMemory
from batchlab.config.standin import runnable, stand_in_text
from batchlab.models.owners import OUTSIDE, ModuleStack
from batchlab.trace.tree import build_tree


class FakeTrainer(Trainer):
    """The harness Trainer with the two things fake tensors cannot give: values and a GradScaler."""

    def __init__(self, cfg: RunConfig, device: torch.device, **kwargs):
        super().__init__(cfg, device, **kwargs)
        # GradScaler reads found-inf flags with .item(); its state is two scalars, so leaving it out
        # changes the count by bytes, not by a share of the peak.
        self.scaler = torch.amp.GradScaler(device.type, enabled=False)

    def _number(self, t: torch.Tensor) -> float:
        # Only the loss printout, the grad-norm printout and the useful-token count that normalises the
        # loss read values; none of them changes a tensor's size.
        return 1.0

    def _global_useful(self, local: int) -> int:
        return local * self.world  # every rank of a fake world draws the same number of tokens


def fake_mode(real_inputs: bool = False) -> FakeTensorMode:
    """``real_inputs``: real tensors may enter ops (a device mesh's rank numbers, which DeviceMesh builds and
    combines itself when FSDP2 shards DTensor parameters over a 2-D mesh)."""
    mode = FakeTensorMode(allow_non_fake_inputs=real_inputs)
    # The converter memoises every fake output through a weak reference, and Module.to() refuses to swap
    # a parameter that has one ("Cannot swap t1 because it has weakref associated with it").  The memo
    # only serves real-to-fake conversions of the same tensor, which the trace does not do.
    mode.fake_tensor_converter.set_tensor_memo = lambda t, v: None
    return mode


def trace_device(cfg: RunConfig) -> tuple[torch.device, list[str]]:
    """Trace with the config's backend when this machine has it, else with CPU kernels (and say so)."""
    try:
        return torch_device(cfg), []
    except ConfigError:  # the config's backend is absent here
        return torch.device("cpu"), [
            f"traced with CPU kernels: {cfg.device} ({cfg.device_spec.backend.value}) is not available here; the "
            "attention kernel and autocast's op lists (so what is kept for backward) can differ on the real device"]


def emulates_cuda(cfg: RunConfig, device: torch.device) -> bool:
    """A CUDA config traced on this machine's CPU: the trace takes CUDA's kernel choices (trace/cuda_policy.py)."""
    return cfg.device_spec.backend is Backend.CUDA and device.type == "cpu"


def stand_in_notes(cfg: RunConfig) -> list[str]:
    """Where the config's implementation is not installed: what was traced instead, and how far the formula's
    terms of the two codes are apart (one layer, this config's shape)."""
    text = stand_in_text(cfg)
    if text is None:
        return []
    from batchlab.formula.activations import implementation, layer_activations

    ran = runnable(cfg)
    backend = cfg.device_spec.backend
    wanted, traced = (layer_activations(c.model, cfg.seq, cfg.micro_batch, cfg.precision, backend,
                                        implementation(c.model_kind, c.model)).total for c in (cfg, ran))
    return [f"{text}; per layer the formula counts {fmt_bytes(wanted)} for {cfg.model.impl.label}, "
            f"{fmt_bytes(traced)} for the traced code ({(traced - wanted) / wanted:+.1%}): the trace's activations "
            f"describe the traced code"]


def _check_supported(cfg: RunConfig) -> list[str]:
    notes = []
    if cfg.parallel.engine_spec.stage > 0 and cfg.dp == 1:
        notes.append(f"ZeRO-{cfg.parallel.engine_spec.stage} with DP = 1 shards nothing: traced as one unsharded rank")
    if cfg.precision is Precision.FP16_MIXED:
        notes.append("GradScaler left out (it reads values); its state is a few bytes")
    return notes


def _model_state_bytes(trainer: Trainer) -> tuple[int, int, int]:
    trained = {id(p): p for p in trainer.raw_model.parameters() if p.requires_grad}.values()
    params = local_shards(trainer.raw_model.parameters())  # this rank's shards
    optimizer = getattr(trainer.optimizer, "optim", trainer.optimizer)  # ZeroRedundancyOptimizer: its shard
    state = local_shards(v for s in optimizer.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
    # .grad has the parameter's (shard's) shape and dtype
    grads = sum(local_shard(p).numel() * p.element_size() for p in trained)
    return storage_bytes(params), grads, storage_bytes(state)


@contextlib.contextmanager
def _as_config_errors(cfg: RunConfig):
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException) as e:
        raise ConfigError("model", f"{cfg.model_source} cannot run on fake tensors: its code needs tensor "
                                   f"values or an op fake tensors lack ({e}); estimate without --trace "
                                   "or measure it") from None


def _first_update(trainer: Trainer, replay=None):
    """An update of one micro-batch before the tracked one: what it leaves (AdamW's state, .grad kept as DDP's
    buckets, lazily built engine state) is per parameter, not per micro-batch, and fake tensors cost per op,
    so the config's accum micro-batches would cost accum times as much for the same steady state.  With
    ``replay``, tracked for it alone: the segments the tracked update finds cached are this update's.  Returns
    that tracker (its finalizers report frees to the replay until ``release``), or None."""
    if replay is None:
        trainer.update(micro_batches=1)
        return None
    tracker = tracker_for(trainer, listener=replay)
    with contextlib.ExitStack() as resizes:
        register = _registrar(trainer, replay, resizes)
        if register is not None:
            register(tracker)
        with tracker:
            trainer.update(micro_batches=1, listener=tracker)
    return tracker


def _registrar(trainer: Trainer, replay, resizes: contextlib.ExitStack):
    """How a tracker of ``trainer``'s update learns the storages sharded or compiled engines hold outside ops
    (None where there are none): registered up front, and with ``replay`` each FSDP2 resize reported in its
    place among the allocations the replay orders (entered on ``resizes``)."""
    if not (trainer.world > 1 or applies(trainer.cfg)):
        return None

    def register(tracker):
        sharded.register_storages(tracker, trainer)
        if replay is not None:
            resizes.enter_context(sharded.observed_resizes(tracker))
    return register


def _tracked_update(trainer: Trainer, tree: bool, timeline: bool = False, replay=None):
    """One update tracked by the CPU measurement's StorageTracker; with ``tree``, storages labelled by module;
    with ``timeline``, also recorded op by op; with ``replay`` (trace/replay.py AllocatorReplay), its storage
    events replayed through the caching allocator; its ops recorded for the time model either way (by the
    tracker's own dispatch mode: ``observer``): (snapshot, TimelineRecorder or None, ops)."""
    owners = ModuleStack(trainer.raw_model) if tree or timeline else None
    resizes = contextlib.ExitStack()
    register = _registrar(trainer, replay, resizes)
    ops = OpRecorder(trainer.raw_model)
    try:
        if timeline:
            from batchlab.measure.timeline_tracker import recorded_update

            update = trainer.update  # the timeline's listener also marks the phases for the op recorder
            trainer.update = lambda listener=None: update(listener=Listeners(listener, ops) if listener is not None else ops)
            try:
                snap, rec = recorded_update(trainer, owners.current, OUTSIDE, owners.current if tree else None,
                                            register, observer=ops.record, also=replay)
            finally:
                del trainer.update
            return snap, rec, ops.result()
        tracker = tracker_for(trainer, owner=owners.current if owners else None, listener=replay, observer=ops.record)
        if register is not None:
            register(tracker)
            tracker.reset()
        with tracker:
            trainer.update(listener=Listeners(tracker, ops))
        return tracker.snapshot(), None, ops.result()
    finally:
        resizes.close()
        ops.close()
        if owners:
            owners.close()


def _memory(cfg: RunConfig, trainer: Trainer, snap, replayed=None) -> TraceMemory:
    """``replayed``: the update's ReplayResult (trace/replay.py), None where no replay ran."""
    params, grads, optimizer = _model_state_bytes(trainer)
    if replayed is not None:  # the traced storage events through the caching allocator's own rules
        reserved = replayed.peak_reserved_bytes + cublas_workspace(cfg.device_spec.arch)
        # a tracker peak above the replay's reserved is the tracker's own count (a fake collective's output)
        margin, source = max(reserved - snap.peak_bytes, 0), "replay"
    else:  # the traced tensor bytes through the formula's caching-allocator model (none on CPU)
        margin = device_memory(cfg, snap.peak_bytes, snap.peak_phase, snap.activations_bytes,
                               snap.breakdown.get("gradients", 0)).reserved_bytes - snap.peak_bytes
        source = ("none" if cfg.device_spec.backend is Backend.CPU
                  else "assumption" if cfg.assumptions.allocator_margin is not None else "formula")
    return TraceMemory(
        peak_bytes=snap.peak_bytes, peak_phase=snap.peak_phase, activations_bytes=snap.activations_bytes,
        parameters_bytes=params, gradients_bytes=grads, optimizer_bytes=optimizer, breakdown=snap.breakdown,
        phase_peaks=snap.phase_peaks, margin_bytes=margin, capacity_bytes=cfg.memory_capacity,
        fits=snap.peak_bytes + margin <= cfg.memory_capacity, margin_source=source)


class _Traced(NamedTuple):
    trainer: Trainer
    snap: object  # the tracker's snapshot
    recorder: object  # TimelineRecorder or None
    ops: object
    flops: TraceFlops
    memory: TraceMemory
    notes: list[str]
    warned: list[str]


def _trace(cfg: RunConfig, device: torch.device, rank: int, tree: bool, timeline: bool) -> _Traced:
    """Build rank ``rank``'s trainer on fake tensors (in a fake world of the layout's ranks) and trace its
    steady-state update."""
    notes: list[str] = []
    layered = applies(cfg)  # tensor or pipeline ranks: the layout's own trainer, as measured
    world = sharded.fake_world(cfg.parallel.world_size, rank) if cfg.parallel.world_size > 1 else contextlib.nullcontext()
    sends = sharded.held_sends() if cfg.parallel.pipelined else contextlib.nullcontext()
    shapes = sharded.untracked_shape_propagation() if cfg.parallel.world_size > 1 else contextlib.nullcontext()
    with _as_config_errors(cfg), world, sends, shapes, fake_mode(layered), fake_deepcopy(), caught_warnings() as warned:
        if layered:
            trainer, dp_notes = sharded.build_layout(cfg, device, rank, FakeTrainer)
            notes += dp_notes
        elif cfg.dp > 1:
            trainer, dp_notes = sharded.build(cfg, device, FakeTrainer)
            notes += dp_notes
        else:
            trainer = FakeTrainer(cfg, device)
        notes += stand_in_notes(cfg)
        # built: the model's imports are done
        replay = replays(cfg)
        with (eager_branches(runnable(cfg).model_kind is not ModelSource.BUILTIN) as assumed, library_logs(warned),
              streams(device.type) if replay is not None else contextlib.nullcontext()):
            first = _first_update(trainer, replay)
            snap, recorder, ops = _tracked_update(trainer, tree, timeline, replay)
            if first is not None:
                first.release()
        notes += assumed
        flops = flops_of(ops)
        if cfg.dp > 1 and not layered:  # every rank does rank 0's work on its own data
            flops = TraceFlops.of(flops.forward * cfg.dp, flops.backward * cfg.dp, flops.recompute * cfg.dp)
            notes.append(f"FLOPs: rank 0's, counted, x {cfg.dp} ranks")
        elif layered:
            notes.append(f"FLOPs and the per-op time: rank {rank}'s own (its shard and stage), not the world's")
        replayed = replay.result() if replay is not None else None  # its blocks sorted once
        memory = _memory(cfg, trainer, snap, replayed)
        if replayed is not None:
            notes.append(replay_note(replayed, cublas_workspace(cfg.device_spec.arch)))
    return _Traced(trainer, snap, recorder, ops, flops, memory, notes, warned)


def estimate(cfg: RunConfig, tree: bool = False, timeline: bool = False, calibrations=None) -> TraceEstimate:
    """Peak memory, activations, per-module tree, FLOPs and the per-op time model's update time (one rank, no
    communication) of one steady-state update (provenance trace); with ``timeline``, the update's memory
    timeline too (``.timeline``, batchlab.timeline.data.Timeline); ``calibrations`` as for formula.estimate.
    A pipeline: each stage's first rank traced, the most loaded one's figures returned."""
    if cfg.fp8 is not FP8Recipe.NONE:  # the traced code is the model's own 16-bit code: no Float8Linear / TE module in it
        raise ConfigError("fp8", f"{cfg.fp8} is priced by the formula only: drop --trace (or --fp8)")
    if cfg.offload_activations:  # fake tensors have no host copy to move: the stash and streams are the formula's
        raise ConfigError("offload_activations", "is priced by the formula only: drop --trace (or "
                                                 "--offload-activations)")
    start = time.perf_counter()
    ranks = sharded.traced_ranks(cfg)
    if len(ranks) > 1:
        traces = [rank_estimate(cfg, r, tree, timeline, calibrations) for r in ranks]
        worst = max(traces, key=lambda t: t.memory.peak_bytes)
        worst.notes.append(sharded.stages_note(cfg, ranks, [t.memory.peak_bytes for t in traces], traces.index(worst)))
        worst.trace_seconds = time.perf_counter() - start
        return worst
    return rank_estimate(cfg, ranks[0], tree, timeline, calibrations)


def rank_estimate(cfg: RunConfig, rank: int, tree: bool = False, timeline: bool = False,
                  calibrations=None) -> TraceEstimate:
    """The trace of one rank (rank 0 without tensor or pipeline parallelism)."""
    notes = _check_supported(cfg)
    device, device_notes = trace_device(cfg)
    start = time.perf_counter()
    traced_device = device.type
    t = None
    if emulates_cuda(cfg, device):
        try:
            with cuda_kernels():
                t = _trace(cfg, device, rank, tree, timeline)
            device_notes, traced_device = [CUDA_NOTE], "cpu (CUDA's kernel choices)"
        except (RuntimeError, NotImplementedError) as e:  # code CUDA's choices route to fails on CPU fake tensors
            device_notes = [device_notes[0] + f" (CUDA's kernel choices failed: {str(e).splitlines()[0]})"]
    t = t or _trace(cfg, device, rank, tree, timeline)
    trainer, snap, memory, flops, ops = t.trainer, t.snap, t.memory, t.flops, t.ops
    notes += t.notes
    costs = costs_for(cfg, calibrated_costs(cfg, calibrations), ops)
    time_ops = on_host(ops, cfg, costs, provenance="trace")
    return TraceEstimate(
        config=cfg.to_dict(), global_batch=cfg.global_batch, tokens_per_update=cfg.tokens_per_update,
        memory=memory, flops=flops, traced_device=traced_device, trace_seconds=time.perf_counter() - start,
        tree=build_tree(trainer.raw_model, snap.activations_by_owner) if tree else None,
        notes=notes + device_notes, timeline=_timeline(cfg, t.recorder, snap, notes) if t.recorder else None,
        time=time_ops, time_model=describe(costs, time_ops) + machine_text(cfg, costs), counted=trainer.workload.counted,
        traced=trainer.workload.description, warnings=t.warned, kv_cache=None if stand_in_text(cfg) else _kv_cache(trainer.raw_model))


def _kv_cache(model) -> bool | None:
    use_cache = getattr(getattr(model, "config", None), "use_cache", None)
    return use_cache if isinstance(use_cache, bool) else None


def _timeline(cfg: RunConfig, recorder, snap, notes: list[str]):
    from batchlab.measure.timeline_tracker import context

    ctx = context(cfg)
    return recorder.timeline(provenance="trace", method="live storage tracker on fake tensors (FakeTensorMode)",
                             peak_bytes=snap.peak_bytes, **dict(ctx, notes=ctx["notes"] + notes))
