"""The interleaved 1F1B schedule step by step: the order a rank runs its chunks' forwards and backwards in, and what
each meets (no torch).

torch.distributed.pipelining's ``ScheduleInterleaved1F1B`` gives rank r of p the pipeline stages r, r + p, ...
(v chunks, each its own ``PipelineStage`` and, under FSDP2, its own fully_shard units) and runs them as
``_get_1f1b_rank_ops`` orders them (Narayanan et al. 2021, sec. 2.2, depth first): (v - 1) x m/rounds + 2(p - 1 - r)
warm-up forwards, chunk after chunk in groups of m/rounds micro-batches, then a forward and a backward in turn, the
backwards taking the chunks from the last down.  Its runtime (``_PipelineScheduleRuntime._step_microbatches``) waits
for its sends only when the step ends: every output a chunk sent on and every input gradient it sent back stays
alive to the end of the update, beside the activations of the micro-batches each chunk holds and the gradients of
the chunks that ran a backward already.  Each step is priced as its own chunk's forward or backward over that state.
Under autocast the step runs inside one autocast region: every chunk's 16-bit weight copies stay in its cast cache to
the step's end, none freed by a layer's backward.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

from batchlab.config import RunConfig
from batchlab.config.engines import PipelineSchedule
from batchlab.formula import deepspeed
from batchlab.formula.activation_plan import ActivationPlan, activation_plan, rank_loss_path
from batchlab.formula.inbackward import walk_states
from batchlab.formula.kvcache import held_in_forward_bytes
from batchlab.formula.pipeline import logits_bytes, megatron_runtime, outputs_held, receive_buffer_bytes
from batchlab.formula.ranks import RankShare, residual_bytes, share
from batchlab.formula.states import ModelStates, model_states

Parts = dict[str, int]


def ordered(cfg: RunConfig) -> bool:
    """A pipeline of more than one chunk per rank run by torch.distributed.pipelining (Megatron's own runtime frees
    each output once sent and keeps no send: priced at its in-flight count, formula/activation_plan.py)."""
    return cfg.parallel.pipelined and cfg.parallel.chunks > 1 and not megatron_runtime(cfg)


@functools.lru_cache(maxsize=256)
def rank_actions(p: int, v: int, m: int, rank: int) -> tuple[tuple[int, bool], ...]:
    """(local chunk, backward?) in the order ``ScheduleInterleaved1F1B`` runs them on ``rank`` of ``p``, v chunks,
    m micro-batches (``_calculate_single_rank_operations`` without its idle slots)."""
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)  # _get_warmup_ops
    forward = lambda op: (op // per_round) % v  # noqa: E731
    backward = lambda op: v - 1 - ((op - warmup) // per_round) % v  # noqa: E731
    out: list[tuple[int, bool]] = [(forward(op), False) for op in range(warmup)]
    for op in range(warmup, m * v):
        out += [(forward(op), False), (backward(op), True)]
    out += [(backward(op), True) for op in range(m * v, m * v + warmup)]
    return tuple(out)


@dataclass(frozen=True)
class ChunkStep:
    """One forward or backward of a chunk (``chunk`` None: the step's end, every action done) and what it meets."""

    chunk: int | None
    backward: bool
    held: tuple[int, ...]  # per chunk, micro-batches whose activations it holds (this one included)
    made: tuple[bool, ...]  # per chunk, a backward of this update ran on it before: its gradients exist
    sent: int  # outputs sent on (each kept by its send to the step's end), this one's included
    sends: int  # input gradients sent back before this step (kept by their sends)
    done: tuple[int, ...]  # per chunk, forwards run so far in this update (this one included)


def steps(p: int, v: int, m: int, rank: int) -> tuple[ChunkStep, ...]:
    """Every step of ``rank``'s update, and its end."""
    last = p * v - 1
    held, made, done = [0] * v, [False] * v, [0] * v
    sent = sends = 0
    out = []
    for c, backward in rank_actions(p, v, m, rank):
        stage = c * p + rank
        if not backward:
            held[c] += 1
            done[c] += 1
            sent += stage < last
        out.append(ChunkStep(c, backward, tuple(held), tuple(made), sent, sends, tuple(done)))
        if backward:
            held[c] -= 1
            made[c] = True
            sends += stage > 0
    out.append(ChunkStep(None, True, tuple(held), tuple(made), sent, sends, tuple(done)))
    return tuple(out)


@dataclass(frozen=True)
class Chunk:
    """Chunk c of a rank priced as a pipeline stage of its own (stage c·p + r of p·v), with ``fresh``: its
    gradients are made in this step (its first backward of the update)."""

    share: RankShare
    plan: ActivationPlan  # one micro-batch's (``others`` 0)
    states: ModelStates  # its parameters' states (its gradients' bytes)
    forward_transient: int
    backward_transient: int
    fresh: bool = False

    def terms(self, cfg: RunConfig) -> tuple:
        """(share, plan, the states its backward grows gradients from, forward and backward transients)."""
        return self.share, self.plan, walk_states(cfg, self.states), self.forward_transient, self.backward_transient


def flat(cfg: RunConfig) -> RunConfig:
    """The layout with each chunk a stage of its own: pp·v stages of one chunk."""
    return dataclasses.replace(cfg, pp=cfg.pp * cfg.parallel.chunks, pp_virtual=1, pp_schedule=PipelineSchedule.GPIPE)


def chunks(cfg: RunConfig, rank: RankShare) -> tuple[Chunk, ...]:
    flat_, p = flat(cfg), cfg.parallel.pp
    out = []
    for c in range(cfg.parallel.chunks):
        s = dataclasses.replace(share(flat_, c * p + rank.stage), in_flight=1.0)
        lp = rank_loss_path(flat_, s)
        out.append(Chunk(s, activation_plan(flat_, s), model_states(flat_, s),
                         lp.forward_transient + held_in_forward_bytes(cfg), lp.backward_transient))
    return tuple(out)


def dresser(cfg: RunConfig, rank: RankShare) -> Callable[[ChunkStep, str, Parts], Parts]:
    """``dress(step, phase, parts)``: DeepSpeed's buffers (formula/deepspeed.py) and the pipeline's own tensors at
    ``step`` (formula/pipeline.py's, counted step by step): the receive buffers (resident), the outputs sent on and
    the input gradients sent back (kept by their sends), the last stage's logits of its in-flight micro-batches
    (kept in ``fwd_cache`` to their backward; of every forward run so far where ``output_chunks`` keeps them,
    formula/pipeline.py ``outputs_held``); the received activations in use are buffers, out of the activations'
    part.  At the optimizer ``step`` is the update's end (``steps``' last): the buffers and the outputs
    ``output_chunks`` keeps (cleared when the next step starts), the sends done."""
    hidden, p = residual_bytes(cfg, rank), cfg.parallel.pp
    buffers = receive_buffer_bytes(cfg, rank)[0]
    receiving = [c * p + rank.stage > 0 for c in range(cfg.parallel.chunks)]
    logits = logits_bytes(cfg, rank) if rank.last else 0
    engine = deepspeed.priced(cfg)

    def dress(step: ChunkStep, ph: str, parts: Parts) -> Parts:
        parts = deepspeed.dressed(cfg, rank, {ph: parts})[ph] if engine else parts
        if ph == "optimizer":
            return dict(parts, **{"receive buffers": buffers, "gradient sends": 0, "stage outputs": outputs_held(
                cfg, False, 0, step.sent) * hidden + outputs_held(cfg, True, 0, step.done[-1]) * logits})
        received = sum(h for h, r in zip(step.held, receiving) if r) * hidden
        return dict(parts, activations=max(0, parts["activations"] - received), **{
            "receive buffers": buffers,
            "stage outputs": step.sent * hidden + outputs_held(cfg, True, step.held[-1], step.done[-1]) * logits,
            "gradient sends": step.sends * hidden})

    return dress


def highest(cfg: RunConfig, rank: RankShare, price: Callable[[Chunk | None, int, int, str], Parts],
            dress: Callable[[ChunkStep, str, Parts], Parts]) -> tuple[dict[str, Parts], tuple[Chunk, int, int]]:
    """Each phase's highest point over the rank's steps: ``price(chunk, others, gradients, phase)`` gives the
    parts of ``chunk``'s forward or backward with ``others`` bytes of activations held besides its micro-batch
    and ``gradients`` bytes of gradients before it (``chunk`` None: the optimizer's, or the step's end);
    ``dress(step, phase, parts)`` adds the pipeline's own tensors.  Returns them and the (chunk, others,
    gradients) of the highest chunk backward."""
    parts_of = chunks(cfg, rank)
    one = [c.plan.total for c in parts_of]
    grads = [c.states.gradients for c in parts_of]
    always = not cfg.assumptions.zero_grad_set_to_none
    out: dict[str, Parts] = {}
    top, top_bytes = None, -1
    # what the other chunks hold adds alike to every point of a step: each chunk's forward and backward (making its
    # gradients or not) is priced once, alone
    priced: dict[tuple, Parts] = {}
    order = steps(cfg.parallel.pp, cfg.parallel.chunks, cfg.accum, rank.stage)
    for st in order:
        if st.chunk is None:  # every backward done: the sends still held, no activation left
            parts = dress(st, "backward", dict(price(None, 0, sum(grads), "optimizer"), temporaries=0))
            ph = "backward"
        else:
            held = sum(h * o for h, o in zip(st.held, one))
            before = sum(g for g, made in zip(grads, st.made) if made or always)
            fresh = not (st.made[st.chunk] or always)
            ph = "backward" if st.backward else "forward"
            key = (st.chunk, ph, fresh)
            if key not in priced:
                priced[key] = price(dataclasses.replace(parts_of[st.chunk], fresh=fresh), 0, 0, ph)
            alone, others = priced[key], held - one[st.chunk]
            parts = dress(st, ph, dict(alone, activations=alone["activations"] + others,
                                       gradients=alone["gradients"] + before))
            if st.backward and sum(parts.values()) > top_bytes:
                top, top_bytes = (st.chunk, fresh, others, before), sum(parts.values())
        if ph not in out or sum(parts.values()) > sum(out[ph].values()):
            out[ph] = parts
    out["optimizer"] = dress(order[-1], "optimizer", price(None, 0, sum(grads), "optimizer"))
    assert top is not None, "every schedule has a backward"
    c, fresh, others, before = top
    return out, (dataclasses.replace(parts_of[c], fresh=fresh), others, before)
