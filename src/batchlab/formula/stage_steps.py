"""The order a pipeline stage runs its forwards and backwards in, and what each meets (no torch).

A stage's high point is not always its first backward, which holds every warm-up micro-batch's activations: the
gradients exist only from the end of that backward on (``zero_grad(set_to_none=True)`` leaves none between
updates), so a later backward that holds one micro-batch fewer but every gradient can be higher where the stage's
weights outweigh a micro-batch's activations (few layers per stage, short sequences).  Each distinct step is
priced; the highest of each phase is the stage's.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

from batchlab.config import RunConfig
from batchlab.config.engines import PipelineSchedule
from batchlab.formula.pipeline import gradient_send_bytes, megatron_runtime, receive_buffer_bytes, stage_output_bytes
from batchlab.formula.ranks import RankShare

Parts = dict[str, int]


@dataclass(frozen=True)
class Step:
    """One forward or backward of a stage's schedule and the state it meets."""

    backward: bool
    held: int  # micro-batches whose activations the stage holds during it (this one included)
    after_backward: bool  # a backward of this update ran before it: the gradients exist
    after_forward: bool  # the step before it was a forward
    done: int  # forwards run so far in this update (this one included)


def stage_steps(schedule: PipelineSchedule, stage: int, p: int, m: int) -> tuple[Step, ...]:
    """A stage's forwards and backwards in the order torch.distributed.pipelining runs them: GPipe all m forwards,
    then all m backwards; 1F1B (``Schedule1F1B._step_microbatches``) min(p - stage, m) warm-up forwards, then
    a backward and a forward in turn while forwards remain, then the remaining backwards."""
    if schedule is PipelineSchedule.GPIPE:
        order = "F" * m + "B" * m
    else:
        warmup = min(p - stage, m)
        order = "F" * warmup + "BF" * (m - warmup) + "B" * warmup
    steps, forwards, backwards, previous = [], 0, 0, ""
    for kind in order:
        forwards += kind == "F"
        steps.append(Step(kind == "B", forwards - backwards, backwards > 0, previous == "F", forwards))
        backwards += kind == "B"
        previous = kind
    return tuple(steps)


@functools.lru_cache(maxsize=256)
def distinct(schedule: PipelineSchedule, stage: int, p: int, m: int, by_forward: bool = False) -> tuple[Step, ...]:
    """Of the stage's steps alike but for their held micro-batches (and, ``by_forward``, for whether a forward came
    just before), the one holding the most, the latest of those (the most forwards done: outputs a stage may keep,
    formula/pipeline.py ``outputs_held``): every part a step's point adds grows with them.  A handful, however
    many micro-batches."""
    top: dict = {}
    for step in stage_steps(schedule, stage, p, m):
        key = (step.backward, step.after_backward, by_forward and step.backward and step.after_forward)
        if key not in top or (step.held, step.done) > (top[key].held, top[key].done):
            top[key] = step
    return tuple(top.values())


def ordered(cfg: RunConfig) -> bool:
    """A pipeline whose stage order ``stage_steps`` gives (one chunk per rank; several: formula/interleaved.py)."""
    return cfg.parallel.pipelined and cfg.parallel.chunks == 1


def highest(cfg: RunConfig, rank, price: Callable[[Step, str], Parts],
            dress: Callable[[int, str, Parts, int], Parts]) -> tuple[dict[str, Parts], Step]:
    """Each phase's highest point over the stage's distinct steps: ``price(step, phase)`` gives the parts of that
    phase as the step meets it (a forward step's forward, a backward step's backward); ``dress(held, phase,
    parts, done)`` adds the pipeline's own tensors for ``held`` micro-batches in flight after ``done`` forwards.
    Returns them and the step of the highest backward."""
    out: dict[str, Parts] = {}
    top: Step | None = None
    for step in distinct(cfg.parallel.schedule, rank.stage, rank.stages, cfg.accum):
        ph = "backward" if step.backward else "forward"
        parts = dress(step.held, ph, price(step, ph), step.done)
        if ph not in out or sum(parts.values()) > sum(out[ph].values()):
            out[ph], top = parts, (step if step.backward else top)
        if "optimizer" not in out:
            out["optimizer"] = dress(0, "optimizer", price(step, "optimizer"), cfg.accum)
    assert top is not None, "every schedule has a backward"
    return out, top


def with_pipeline(cfg: RunConfig, rank: RankShare, phases: dict[str, dict[str, int]], done: int | None = None
                  ) -> dict[str, dict[str, int]]:
    """A pipeline stage's own tensors (formula/pipeline.py), each a part of its own: its receive buffers (every
    phase: allocated once), the in-flight micro-batches' stage outputs its PipelineStage keeps for their backward
    (forward and backward; where it keeps them all, those of the ``done`` forwards, through the optimizer step
    too: ``output_chunks`` is cleared when the next step starts), the input gradients still in their send
    (backward).  The received activations in use are the buffers: out of the activations' part."""
    if rank.stages == 1:
        return phases
    outputs, sends = stage_output_bytes(cfg, rank, done), gradient_send_bytes(cfg, rank)
    stepping = (stage_output_bytes(cfg, dataclasses.replace(rank, in_flight=0), done)  # none in flight: kept ones
                if "optimizer" in phases else 0)
    buffers, received = receive_buffer_bytes(cfg, rank)
    if megatron_runtime(cfg):  # the chunk's fresh input is kept by its first layer: counted in the activations
        outputs, stepping, buffers, received = 0, 0, 0, 0
    live = {"forward": (outputs, 0), "backward": (outputs, sends), "optimizer": (stepping, 0)}
    out = {}
    for ph, parts in phases.items():
        moved = received if ph in ("forward", "backward") and parts["activations"] else 0  # micro-batch phases
        out[ph] = dict(parts, activations=parts["activations"] - moved, **{"receive buffers": buffers},
                       **dict(zip(("stage outputs", "gradient sends"), live.get(ph, (0, 0)))))
    return out
