"""DTensor's host cost per op, measured on this machine.

Under a tensor-parallel plan every op on a sharded parameter or activation goes through DTensor's own dispatch
(sharding propagation, unwrapping to the local shard, wrapping the output, the plan's redistributions), host work
a plain op does not pay and that TP does not divide: a 1-rank plan runs far slower than the plain model at sizes
where ops are dispatch-bound (docs/accuracy/parallel-time-parts.md).  So the first time measure or compare meets a
tensor-parallel config, the calibration's dispatch-bound GPT (``dispatch.DISPATCH_GPT``) runs plain and with its
blocks under the TP plan on a 1-rank mesh (no message is sent) in alternated updates for ~1.5 s; each phase's
extra time over the DTensor ops it dispatched is cached with the CPU's calibration
(``Calibration.dtensor_seconds``) and ``formula.dtensor`` prices the rank's DTensor ops with it; so is the host work
each DTensor collective adds, measured between two forked ranks (``dtensor_collective.py``, key "collective"), and
for an FSDP2 config FSDP2's host work per collective (``fsdp_host.py``, keys "fsdp-hooks" and "fsdp-tp-hooks").
"""
from __future__ import annotations

import contextlib

from batchlab.calibrate import dtensor_collective, fsdp_host
from batchlab.calibrate.dispatch import DISPATCH_GPT, DispatchSampler, per_kind
from batchlab.calibrate.oneoff import at_threads, thread_clock
from batchlab.cache.calibrations import default_threads, load_cached, save
from batchlab.config import RunConfig
from batchlab.formula.plausible import dtensor_problems

SECONDS = 1.5  # alternated updates of the plain and the sharded GPT, hundreds each at dispatch-bound sizes
KINDS = ("forward", "backward", "plain")


def is_dtensor_op(args, kwargs) -> bool:
    """Whether an aten call has a DTensor among its arguments (a list of them included): DTensor dispatches it."""
    from torch.distributed.tensor import DTensor

    for a in list(args) + list((kwargs or {}).values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, DTensor):
                return True
    return False


@contextlib.contextmanager
def one_rank_mesh():
    """A 1-rank CPU device mesh on a gloo group of this process alone (none may be initialised already)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from batchlab.trace.sharded import _forget_meshes as forget_meshes

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
        forget_meshes()  # DTensor's sharding cache would hand a later mesh of the same shape this one's group


def sharded_trainer(cfg: RunConfig, mesh):
    """A harness trainer of ``cfg`` (the built-in GPT) whose blocks are under the tensor-parallel plan on ``mesh``."""
    import torch

    from batchlab.distributed import tensor_parallel as tp
    from batchlab.measure.harness import Trainer
    from batchlab.models import build_workload

    class Sharded(Trainer):
        def clip_gradients(self, max_norm: float):  # the layouts' own: on the local shards (distributed/layouts.py)
            return tp.clip_grad_norm(self.raw_model.parameters(), max_norm)

    torch.manual_seed(cfg.seed)
    wl = build_workload(cfg)
    for block in wl.model.blocks:
        tp.shard_block(block, cfg.model, mesh, False)
    return Sharded(cfg, torch.device("cpu"), workload=wl)


def dtensor_calls(trainer) -> dict[str, float]:
    """{dispatch kind: DTensor ops of one update of ``trainer``}, counted by a dispatch mode (which sees each
    DTensor op once, before DTensor runs it on the local shard)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from batchlab.config.phase import Phase
    from batchlab.formula.opcost import DISPATCH_KIND

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kind, self.calls = "plain", dict.fromkeys(KINDS, 0.0)

        def start(self) -> None:
            pass

        def mark(self, phase: str) -> None:
            self.kind = DISPATCH_KIND.get(Phase(phase), "plain") if phase != "end" else "plain"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if is_dtensor_op(args, kwargs):
                self.calls[self.kind] += 1
            return func(*args, **(kwargs or {}))

    counting = Counting()
    with counting:
        trainer.update(listener=counting)
    return counting.calls


def measure(seconds: float = SECONDS) -> dict[str, float]:
    """{dispatch kind: seconds each DTensor op adds on this CPU}: the dispatch GPT plain and under the TP plan on a
    1-rank mesh, their fp32 updates alternated at the current intra-op threads; per kind, the sharded update's
    time less the plain one's over its DTensor ops."""
    import torch

    from batchlab.measure.harness import Trainer
    from batchlab.trace.ops import record_update

    with thread_clock(), one_rank_mesh() as mesh:
        plain = Trainer(DISPATCH_GPT, torch.device("cpu"))
        sharded = sharded_trainer(DISPATCH_GPT, mesh)
        for tr in (plain, sharded):
            tr.update()
        calls = {"plain": per_kind(record_update(plain)), "sharded": per_kind(record_update(sharded))}
        extra_calls = dtensor_calls(sharded)
        sampler = DispatchSampler({"fp32": (plain, calls["plain"]), "sharded": (sharded, calls["sharded"])},
                                  lambda: None)
        sampler.run(seconds, at_least=20)
    per_op = sampler.seconds()
    out = {}
    for kind in KINDS:
        if extra_calls.get(kind):
            spent = per_op["sharded"][kind] * calls["sharded"][kind] - per_op["fp32"][kind] * calls["plain"][kind]
            out[kind] = spent / extra_calls[kind]  # not clamped: a reading at or below 0 is refused by ensure
    return out


PER_OP, COLLECTIVE, FSDP = ("forward", "backward", "plain"), ("collective",), ("fsdp-hooks", "fsdp-tp-hooks")


def needed(cfgs: tuple[RunConfig, ...]) -> set[str]:
    """The figures ``cfgs`` are priced with on a CPU: DTensor's per op and per collective under tensor parallelism,
    FSDP2's host work per collective (and its optimizer's DTensor ops) under FSDP2."""
    out: set[str] = set()
    for c in cfgs:
        if c.device == "cpu" and c.parallel.tp > 1:
            out.update(PER_OP + COLLECTIVE)
        if c.device == "cpu" and c.parallel.fsdp:
            out.update(PER_OP + FSDP)
    return out


UNTIMED = "dtensor/"  # this module's keys in ``Calibration.untimed``


def ensure(cfgs: tuple[RunConfig, ...], threads: int | None = None) -> str | None:
    """Where ``cfgs`` run tensor parallelism or FSDP2 on this CPU and its calibration (at ``threads``) lacks a
    figure they are priced with (``needed``): measure the missing ones and cache them with it.  Returns the line to
    show the user (None: nothing to say)."""
    want = needed(cfgs)
    if not want:
        return None
    cal = load_cached("cpu", default_threads() if threads is None else threads)
    # a figure whose timing failed here is not timed again until the next calibration (``Calibration.untimed``)
    if cal is None or not (missing := want - set(cal.dtensor_seconds) - {k[len(UNTIMED):] for k in cal.untimed}):
        return None
    figures, failed = dict(cal.dtensor_seconds), ""
    try:
        with at_threads(cal.threads):
            steps = ((set(PER_OP), measure), ({"collective"}, lambda: {"collective": dtensor_collective.measure()}),
                     (set(FSDP), fsdp_host.measure))
            for keys, timed in steps:  # each kept once plausible: a later step's failure loses none before it
                if not missing & keys:
                    continue
                figures.update(timed())
                if not figures or (bad := dtensor_problems(figures)):  # a stall or a broken run: estimates follow it
                    failed = (f"measured implausible ({bad[0] if figures else 'no DTensor op was dispatched'}), "
                              "not cached")
                    figures = {k: v for k, v in figures.items() if k not in keys or k in cal.dtensor_seconds}
                    break
    except (RuntimeError, ValueError, TypeError) as e:  # a process group of the caller's own, a torch without DTensor
        failed = f"not measured ({e})"
    timed = {k: v for k, v in figures.items() if k in missing}
    cal.dtensor_seconds = figures
    if failed or missing - set(timed):  # an FSDP2 run that counted no collective gives no figure either
        failed = failed or "not measured (the timed run gave no figure)"
        cal.untimed.update({UNTIMED + k: failed for k in missing - set(timed)})
    if timed or failed:
        save(cal)
    said = ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in timed.items())
    if failed:
        left = ", ".join(sorted(missing - set(timed)))
        return (f"time model: DTensor's host cost ({left}) {failed}; a nominal figure prices it until the next "
                "`batchlab calibrate`"
                + (f" (measured and cached: {said})" if said else ""))
    return f"time model: measured DTensor's host cost per op once ({said}) and cached it with the calibration"
