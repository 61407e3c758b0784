"""One rank's view of a data-parallel run, traced in this one process on fake tensors.

PyTorch's "fake" process-group backend (``torch.testing._internal.distributed.fake_pg``, the one
torchtitan's memory estimator uses) gives a world of ``cfg.dp`` ranks whose collectives do nothing; with
fake tensors nothing is allocated either.  So the real engines run as rank 0 sees them:

- ZeRO-2/3: FSDP2 ``fully_shard`` exactly as the measurement builds it (distributed.engines): parameter,
  gradient and optimizer shards of 1/DP, units gathered and freed by FSDP2's own code;
- ZeRO-1: ZeroRedundancyOptimizer shards the optimizer state over the fake world;
- ZeRO-0/1: DDP itself cannot start on fake tensors (it reads parameter shapes across ranks), so its
  gradient buckets are stood in for by ``.grad`` kept between updates: with ``gradient_as_bucket_view``
  the gradients are the buckets, the same bytes.
What a fake world cannot show: the collectives' time, and anything that depends on values from peers.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from batchlab.config import RunConfig

NOTE_DDP = ("traced rank 0 of {dp} on a fake process group: DDP's gradient buckets stood in for by .grad kept "
            "between updates (gradient_as_bucket_view: the same bytes)")
NOTE_FSDP = "traced rank 0 of {dp} on a fake process group: FSDP2 shards, gathers and frees as on a real run"


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0):
    """A process group of ``world`` ranks in this process whose collectives do nothing (``rank``'s view)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; trace a DP config alone")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """DTensor caches each op's output sharding, device mesh included, by value: a mesh of the next fake world
    equals this one's, so a cached sharding would hand the next trace a mesh whose process groups are gone."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    for cached in (prop.propagate_op_sharding, prop._propagate_tensor_meta_cached):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ dispatch's own cache
    if native is not None:
        native()


def build(cfg: RunConfig, device: torch.device, trainer_cls) -> tuple[object, list[str]]:
    """Rank 0's trainer on the stage's engine (inside ``fake_world``) and the note saying what was traced."""
    from batchlab.distributed import engines

    spec = cfg.parallel.engine_spec
    if spec.fsdp:
        trainer, _ = engines.build(cfg, device, 0, cfg.dp, trainer_cls=trainer_cls)
        return trainer, [NOTE_FSDP.format(dp=cfg.dp)]
    torch.manual_seed(cfg.seed)
    from batchlab.models import build_workload

    opt = dict(optimizer=engines.zero_optimizer) if spec.shards_optimizer else {}
    trainer = trainer_cls(cfg, device, workload=build_workload(cfg), rank=0, world=cfg.dp, grads_to_none=False, **opt)
    return trainer, [NOTE_DDP.format(dp=cfg.dp)]


def register_storages(tracker, trainer) -> None:
    from batchlab.distributed import engines

    engines.register_storages(tracker, trainer, None)


def traced_ranks(cfg: RunConfig) -> list[int]:
    """The ranks a trace runs: the first rank (dp 0, tp 0) of each pipeline stage, ranks being row-major over
    (pp, dp, tp) (distributed/mesh.py).  The tensor- and data-parallel peers of a stage hold the same bytes
    (equal shards of the same layers)."""
    layout = cfg.parallel
    return [stage * layout.dp * layout.tp for stage in range(layout.pp)]


def build_layout(cfg: RunConfig, device: torch.device, rank: int, fake_cls) -> tuple[object, list[str]]:
    """Rank ``rank``'s trainer of a TP / PP layout, as the measurement builds it (inside ``fake_world``)."""
    from batchlab.distributed import layouts
    from batchlab.distributed.mesh import coordinates

    trainer, _ = layouts.build(cfg, device, rank, mixin=fake_cls)
    if cfg.parallel.pipelined:
        _static_shapes(trainer.schedule, trainer.stages)
    c = coordinates(cfg.parallel, rank)
    return trainer, [f"traced rank {rank} (pp {c['pp']}, dp {c['dp']}, tp {c['tp']}) of {cfg.parallel.world_size} "
                     f"on a fake process group: {layouts.describe(cfg)['engine']}, its own shard and stage"]


def stages_note(cfg: RunConfig, ranks: list[int], peaks: list[int], worst: int) -> str:
    from batchlab.util.units import fmt_bytes

    each = ", ".join(f"stage {i} (rank {r}) {fmt_bytes(p)}" for i, (r, p) in enumerate(zip(ranks, peaks)))
    return f"each pipeline stage traced: {each}; the figures shown are stage {worst}'s, the most loaded"


def _static_shapes(schedule, stages) -> None:
    """The schedule's first step lets the stages vote, by a value sent around the pipeline, whether their
    shapes are static; a fake world sends no values.  The stages are built with their input and output shapes
    (distributed/pipeline.py), so the vote's answer is known: static."""
    from torch.distributed.pipelining._utils import InferenceMode

    def vote(stages_, has_backward, p2p_done=False):
        for st in stages:
            st._inference_mode = InferenceMode.STATIC

    if hasattr(schedule, "_warmup_p2p"):  # the vote exists from torch 2.11; older schedules have none to skip
        schedule._warmup_p2p = vote


class _HeldSend:
    """A send's Work that keeps its tensor for as long as the Work lives, as a real backend's does (gloo's send work
    holds the tensor it sends, waited on or not, until the schedule drops the work); a fake process group's
    completes at once and holds nothing."""

    def __init__(self, work, tensor):
        self.work, self.tensor = work, tensor

    def wait(self, *args, **kwargs):
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


@contextlib.contextmanager
def held_sends():
    """Within: the pipeline schedules' sends hold their tensors as long as the schedule holds their works."""
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def batch_p2p(ops, desc=None):
        works = original(ops, desc)
        if len(works) != len(ops):  # coalesced (sends and receives mixed): one work for the batch
            sends = [o.tensor for o in ops if o.op is dist.isend]
            return [_HeldSend(w, sends) for w in works]
        return [_HeldSend(w, o.tensor) if o.op is dist.isend else w for w, o in zip(works, ops)]

    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = original


@contextlib.contextmanager
def untracked_shape_propagation():
    """Within: DTensor's sharding propagator infers an op's global output shape outside the trace's modes.
    It runs the op on global-shape fake tensors under the fake mode it finds active: in a real run that is a
    private mode no tracker sees, in a trace the trace's own, so the tracker would count a full-size (unsharded)
    output per op that exists nowhere (loss_parallel's log-softmax over the whole vocabulary, for one)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):
        with _disable_current_modes():  # no mode active: the propagator makes a private FakeTensorMode
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


@contextlib.contextmanager
def observed_resizes(tracker):
    """Within: FSDP2's storage resizes (``alloc_storage`` / ``free_storage``: gathering a block's parameters into
    storages it grows, freeing them by shrinking to 0) reach the tracker as they happen, storages made during the
    update included.  Registered storages are otherwise re-read only after an op, and the caching-allocator replay
    needs each free before the allocation that may reuse its block."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    originals = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def observed(resize):
        def wrapped(tensor):
            tracker.register_resizable([tensor], "parameters")  # a storage already registered is kept as it is
            resize(tensor)
            tracker.resync()
        return wrapped

    _fsdp_param.alloc_storage, _fsdp_param.free_storage = (observed(f) for f in originals)
    try:
        yield
    finally:
        _fsdp_param.alloc_storage, _fsdp_param.free_storage = originals
