"""Per-op dispatch: the time a dispatch-bound update spends per op, by who dispatches it (forward, backward,
plain ops; under autocast; under selective checkpointing's dispatch mode).  Torch is imported inside the
functions."""
from __future__ import annotations

import time

from batchlab.calibrate.kernels import CLOCK, steady
from batchlab.formula.opcost import DISPATCH_KIND, SAC_KIND
from batchlab.config.phase import Phase


SAC = "selective"  # the dispatch trainers' entry run under selective activation checkpointing (fp32)


def dispatch_trainers(device, precisions: tuple[str, ...] = ("fp32", "bf16-mixed", SAC)) -> dict[str, tuple]:
    """Per precision, (trainer, {dispatch kind: ops per update}) of a GPT so small that every op is
    dispatch-bound, its ops counted once (trace/ops.py) for every round that times it.  "bf16-mixed" runs under
    autocast, whose dispatch key every forward op passes through (forward dearer than fp32's per op, backward
    too, the optimizer's plain ops alike); ``SAC``, fp32 under selective activation checkpointing, whose
    dispatch mode sees each op of a block in forward and in recompute (opcost.SAC_KIND); a precision the device
    cannot run is left out."""
    out = {}
    for precision in precisions:
        setting = dict(ac="selective") if precision == SAC else dict(precision=precision)
        try:
            trainer, ops = counted(DISPATCH_GPT.replace(**setting), device)
        except (RuntimeError, TypeError):  # autocast in this dtype unsupported on the device
            continue
        out[precision] = (trainer, per_kind(ops))
    return out


def _dispatch_gpt():
    from batchlab.config import RunConfig, preset

    return RunConfig(model=preset("tiny", layers=2, hidden=16, heads=2, vocab=32, max_positions=8), seq=8,
                     micro_batch=1)


DISPATCH_GPT = _dispatch_gpt()  # the GPT the calibration times per-op dispatch on (every op dispatch-bound)


def counted(cfg, device) -> tuple:
    """(a trainer of ``cfg`` after one update, the ops of one update as the trace records them)."""
    from batchlab.measure.harness import Trainer
    from batchlab.trace.ops import record_update

    trainer = Trainer(cfg, device)
    trainer.update()
    return trainer, record_update(trainer)


def kind_of(op) -> str:
    return SAC_KIND[op.phase] if op.sac_dispatched else DISPATCH_KIND[op.phase]


def per_kind(ops, value=lambda op: 1.0) -> dict[str, float]:
    """Per dispatch kind, the sum of ``value(op)`` x its count over ``ops`` (default: how many ops)."""
    out: dict[str, float] = {}
    for op in ops:
        out[kind_of(op)] = out.get(kind_of(op), 0.0) + value(op) * op.count
    return out


class DispatchSampler:
    """Seconds per op by who dispatches it, from updates of ``dispatch_trainers``: each phase's time over its
    op count.  The precisions' updates alternate, so the host's speed switches fall on both alike.  ``run``
    times updates for a while and may be called in several slices (a calibration spreads them through each
    round: a shared host's Python-bound work can move 2x per op between one-second windows (docs/cpu.md), so
    three ~1 s windows priced a dispatch-bound step by whichever state they met; ``seconds()`` is the steady figure of
    all the slices' samples).  Under selective checkpointing (``SAC``) a phase mixes plain ops and ops
    dispatched through its mode (``OpCount.sac_dispatched``): the plain ones are priced at fp32's figures of the
    same slice, the rest of the phase's time is the others' (fp32's figures gain "forward-sac" and "recompute-sac")."""

    def __init__(self, trainers: dict[str, tuple], sync):
        from batchlab.measure.clock import PhaseClock

        self.trainers, self.clock = trainers, PhaseClock(sync, clock=CLOCK.get())
        self.per_op: dict[str, dict[str, list[float]]] = {p: {k: [] for k in calls}
                                                          for p, (_, calls) in trainers.items() if p != SAC}
        self.sac: dict[str, list[float]] = {k: [] for k in SAC_KIND.values()}

    def run(self, seconds: float, at_least: int = 1) -> None:
        """Alternated updates for ``seconds`` (wall clock), at least ``at_least`` of each precision."""
        first = {p: len(v["forward"]) for p, v in self.per_op.items()}
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or min(len(v["forward"]) - first[p]
                                               for p, v in self.per_op.items()) < at_least:
            for precision, (trainer, calls) in self.trainers.items():
                self._update(precision, trainer, calls)

    def _update(self, precision: str, trainer, calls: dict[str, int]) -> None:
        clock = self.clock
        clock.start()
        trainer.update(listener=clock)
        clock.mark("end")
        spent: dict[str, float] = {}
        for phase, secs in clock.seconds.items():
            kind = DISPATCH_KIND[Phase(phase)]
            spent[kind] = spent.get(kind, 0.0) + secs
        if precision == SAC:  # after fp32 (dict order): its figures of this slice price the plain ops
            if self.per_op.get("fp32", {}).get("forward"):
                _sac_op_seconds(self.sac, calls, spent, {k: v[-1] for k, v in self.per_op["fp32"].items()})
            return
        for kind, n in calls.items():
            self.per_op[precision][kind].append(spent.get(kind, 0.0) / n)

    def seconds(self) -> dict[str, dict[str, float]]:
        out = {p: _steady_per_op(kinds) for p, kinds in self.per_op.items()}
        if "fp32" in out:
            out["fp32"].update(_steady_per_op({k: v for k, v in self.sac.items() if v}))
        return out


def _steady_per_op(kinds: dict[str, list[float]]) -> dict[str, float]:
    # the steady rate (ops per second) turned back into seconds per op
    return {k: 1.0 / steady([1.0 / x for x in v if x > 0] or [float("inf")]) for k, v in kinds.items()}


def _sac_op_seconds(out: dict[str, list[float]], calls: dict[str, int], spent: dict[str, float],
                 fp32: dict[str, float]) -> None:
    """Seconds per op dispatched through the SAC mode in one SAC update: its forward (backward) phase less its plain forward
    (backward) ops at ``fp32``'s cost per op, over those ops; appended to ``out``."""
    for kind, phase in (("forward-sac", "forward"), ("recompute-sac", "backward")):
        if calls.get(kind):
            out[kind].append((spent.get(phase, 0.0) - calls.get(phase, 0) * fp32.get(phase, 0.0)) / calls[kind])
