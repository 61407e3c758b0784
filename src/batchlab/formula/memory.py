"""Per-rank memory of one optimizer update: model states, activations, and the peak with its phase."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from batchlab.config import LossMode, Precision, RunConfig
from batchlab.formula import (activations as act, compiled, deepspeed, fp8, fsdp_interleaved, fsdp_pipeline,
                              inbackward, interleaved, offload, stage_steps)
from batchlab.formula.allocator import device_memory, gradient_shards_live
from batchlab.formula.stage_steps import with_pipeline
from batchlab.formula.fsdp import (fsdp_gradient_shard_bytes, fsdp_phases, fsdp_resident, fsdp_shard_bytes,
                                   sharded_master, with_pipeline_no_sync)
from batchlab.formula.activation_plan import ActivationPlan, activation_plan, rank_loss_path
from batchlab.formula.kvcache import held_in_forward_bytes
from batchlab.formula.params import count, norm_params
from batchlab.formula.profile import layer_policies, terms as profile_terms
from batchlab.formula.ranks import RankMemory, RankShare, largest_param, share, shares
from batchlab.formula.states import ModelStates, fsdp_mixed_states, model_states

F32 = 4
__all__ = ["ModelStates", "model_states", "fsdp_mixed_states", "memory",
           "MemoryEstimate", "RankMemory"]


@dataclass(frozen=True)
class MemoryEstimate:
    parameters_bytes: int
    master_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int  # kept for backward at the end of one micro-batch's forward
    activations_per_layer_bytes: tuple[int, ...]
    recompute_working_bytes: int  # one layer's activations rebuilt during its backward (0 without recompute)
    logits_bytes: int  # what the loss keeps for backward (part of activations): the fp32 log-softmax, if any
    temporaries_bytes: int  # transient at the peak beyond the above (gradients of activations, buffers)
    data_bytes: int
    peak_tensor_bytes: int  # sum of tensor bytes live at the peak
    margin_bytes: int  # reserved - allocated: the caching allocator's slack (formula/allocator.py)
    peak_bytes: int  # = reserved_bytes: what the OOM verdict compares with the card's reported capacity
    allocated_bytes: int  # tensor bytes at the peak (max_memory_allocated; on CPU the live-tensor tracker's)
    reserved_bytes: int  # + cached, empty segments (max_memory_reserved)
    device_bytes: int  # + CUDA context and NCCL buffers (nvidia-smi)
    reserved_parts: dict[str, int]  # what reserved adds to allocated, by mechanism
    device_parts: dict[str, int]  # what the device view adds to reserved
    peak_phase: str
    phase_peaks: dict[str, int] = field(default_factory=dict)  # tensor bytes at each phase's high point
    # what is live at the peak, by part (parameters, master, gradients, optimizer, activations, recompute,
    # temporaries, data): sums to peak_tensor_bytes
    at_peak: dict[str, int] = field(default_factory=dict)
    capacity_bytes: int = 0
    provenance: str = "formula"
    # tensor bytes as backward starts, then at each layer's backward, last layer first (DDP's from the built-in
    # terms, empty from a profile; FSDP's always)
    backward_walk: tuple[int, ...] = ()
    layer_copy_bytes: int = 0  # autocast's 16-bit weight copies one layer's matmuls keep until its backward
    # one entry per pipeline stage (its tensor- and data-parallel ranks hold alike); every figure above is the
    # most loaded stage's, named by ``most_loaded``
    ranks: tuple[RankMemory, ...] = ()
    most_loaded: str = ""

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.peak_bytes


_WALKED = ("parameters", "gradients", "activations", "recompute", "temporaries")  # what changes layer by layer


def _backward_peak(cfg: RunConfig, plan: ActivationPlan, states: ModelStates, resident: dict[str, int],
                   grads_before: int, loss_grads: int, layer_copy: int, walk: list[int] | None = None,
                   rank: RankShare | None = None, stepping: int = 0, on_device: int | None = None,
                   fresh: bool | None = None) -> dict[str, int]:
    """Walk backward layer by layer (last first): kept activations shrink while parameter gradients grow.
    ``resident``: weights, optimizer state and data (present throughout); under autocast its ``parameters``
    are the 16-bit weight copies the matmuls saved, ``layer_copy`` of them per layer: each layer's are freed
    by its backward (a recomputed layer casts its own again while it runs).  Returns the parts at the peak;
    ``walk`` (if given) receives the tensor bytes as backward starts, then at each layer's, last layer first.
    ``fresh``: this backward makes ``rank``'s gradients (default: where none exist before it)."""
    rank = rank or share(cfg, 0)
    n = max(rank.params, 1)
    layer_grad = rank.per_layer * states.gradients // n
    # with accumulation (or DDP's gradient buckets) the .grad tensors exist already (in grads_before)
    new_grads = grads_before == 0 if fresh is None else fresh
    transient, head_grad, below_layers = _backward_terms(cfg, states.gradients, rank)
    transient += stepping  # a step fused into backward: its gradient and temporaries, once layers run
    working, below_layers = plan.per_layer_working, below_layers + plan.others  # others: in-flight micro-batches
    kept_below = sum(plan.per_layer_kept)
    # offloaded activations (formula/offload.py): at most ``on_device`` of the layers' kept bytes are back
    cap = (lambda kept: kept) if on_device is None else (lambda kept: min(kept, on_device))  # noqa: E731
    best = dict(resident, gradients=grads_before, activations=plan.total - kept_below + cap(kept_below), recompute=0,
                temporaries=loss_grads)
    if walk is not None:
        walk.append(sum(best.values()))
    # the head's gradient is a fresh tensor where .grad exists only while a tied embedding's part is to come (autograd
    # adds the two in its input buffer); an untied head's, as a pipeline's last stage's copy, goes into .grad at once;
    # a whole-model graph makes it at its end, holding its inputs till then (formula/compiled.py)
    tied_here = cfg.model.tied_embeddings and rank.first and rank.last
    held = compiled.held_to_the_end(cfg) if rank.whole else 0
    grads_done = head_grad if (new_grads or tied_here) and not compiled.defers_head_gradient(cfg) else 0
    modes = cfg.ac.layer_modes(cfg.model.layers)
    recomputed = {j for j, i in enumerate(rank.layers) if modes[i].spec.recomputes}
    copies_below = layer_copy * (len(rank.layers) - len(recomputed))  # the LM head's copy is freed by now
    fixed = sum(v for k, v in resident.items() if k not in _WALKED)  # the same at every layer
    best_total = sum(best.values())
    for i in reversed(range(len(rank.layers))):
        kept_i = plan.per_layer_kept[i]
        parts = dict(parameters=resident["parameters"] if not layer_copy else copies_below
                     + (layer_copy if i in recomputed else 0),
                     gradients=grads_before + grads_done, activations=below_layers + cap(kept_below),
                     recompute=plan.per_layer_full - kept_i if working is None else 0,  # restores the rest
                     temporaries=held + (transient if working is None else working[i] - kept_i + stepping))
        total = fixed + sum(parts.values())  # summed without the resident parts: deep models walk many layers
        if walk is not None:
            walk.append(total)
        if total > best_total:
            best, best_total = dict(resident, **parts), total
        kept_below -= kept_i
        copies_below -= 0 if i in recomputed else layer_copy
        grads_done += layer_grad if new_grads else 0
    return best


def _profiled_backward(cfg: RunConfig, plan: ActivationPlan, states: ModelStates, resident: dict[str, int],
                       grads_before: int, measured: int, layer_copy: int) -> dict[str, int]:
    """Backward's high point from a profile: ``measured`` (its knots) is the excess above backward's start on
    2P layers, the events of the top 2P layers (the loss's gradient, each layer's working set, the weight
    gradients).  Each layer further down repeats the same event, shifted by what the layers above it did:
    created their weight gradients, freed their kept activations and saved weight copies.  A deeper model
    therefore peaks lower down only when that shift is positive (weight-heavy: short sequences); a model
    shallower than 2P lacks that many layers' positive shift."""
    m, traced = cfg.model, 2 * cfg.model.matching_profile.period
    layer_grad = count(m).per_layer * states.gradients // max(count(m).total, 1) if grads_before == 0 else 0
    policies = layer_policies(cfg)
    copy = lambda i: layer_copy if policies[i] == "full" else 0  # noqa: E731 — a recomputed layer's are transient
    if m.layers < traced:
        shift = sum(layer_grad - plan.per_layer_kept[i] - copy(i) for i in range(m.layers)) / m.layers
        return dict(resident, gradients=grads_before, activations=plan.total, recompute=0,
                    temporaries=max(0, measured - round((traced - m.layers) * max(shift, 0))))
    made = freed = copies_freed = 0
    best = (0, 0, 0, 0)  # (shift, gradients made, activations freed, copies freed)
    for i in reversed(range(1, m.layers - traced + 1)):  # layer i done: the event moves to layer i - 1
        made += layer_grad
        freed += plan.per_layer_kept[i]
        copies_freed += copy(i)
        if made - freed - copies_freed > best[0]:
            best = (made - freed - copies_freed, made, freed, copies_freed)
    _, made, freed, copies_freed = best
    return dict(resident, parameters=resident["parameters"] - copies_freed, gradients=grads_before + made,
                activations=plan.total - freed, recompute=0, temporaries=measured)


def _backward_terms(cfg: RunConfig, gradient_bytes: int, rank: RankShare | None = None) -> tuple[int, int, int]:
    """(in-layer transient, the LM head's weight gradient, activations kept below the layers) in backward;
    ``gradient_bytes``: all of the model's gradients as one rank would hold them unsharded."""
    m, s, b = cfg.model, cfg.seq, cfg.micro_batch
    rank = rank or share(cfg, 0)
    t = rank.tp  # a tensor-parallel rank's MLP and heads are 1/t of the layer's; the residual stream 1/t with SP
    w = act.Widths.of(deepspeed.activation_precision(cfg), cfg.device_spec.backend)
    n = max(rank.params, 1)
    sbh = s * b * m.hidden
    # Inside a layer's backward each node frees what it saved as it creates its input's gradient, so the
    # net transient is about one gradient of the widest intermediate (MLP inner, or the s x s scores),
    # plus the incoming and outgoing residual gradients and the first weight gradient (the MLP's output
    # projection, h x f).
    scores = m.heads * s * s * b * w.softmax if act.materialises_scores(m, cfg.device_spec.backend) else 0
    transient = (max(s * b * m.ffn * w.e // t, scores // t) + 2 * sbh * w.res // rank.in_sp
                 + m.hidden * m.ffn // t * gradient_bytes // n)
    # the LM head's weight gradient exists from the start of the layers' backward (tied: in autograd's
    # input buffer until the embedding's backward adds its part)
    head = cfg.loss.mode is not LossMode.CLASSIFIER and rank.last
    head_grad = m.vocab * m.hidden // rank.vocab_split * gradient_bytes // n if head else 0
    mask = act.embedding_mask_bytes(m, s, b, cfg.precision, cfg.device_spec.backend) if rank.first else 0
    below_layers = mask  # the rest is freed; the mask is made before a sequence-parallel split (whole)
    return transient, head_grad, below_layers


def autocast_cast_params(m, rank: RankShare | None = None) -> tuple[int, int]:
    """(whole model, one layer): the parameters autocast copies to 16 bits, the matmuls' weights and biases.
    Lookup tables (an untied token embedding, learned positions) and norm weights are not cast (embedding and
    the norms are not on autocast's lower-precision op list); a tied embedding is cast, as the LM head's weight.
    Checked against the live storages of a real bf16-mixed step (tests/trace/test_trace.py).  ``rank``: those of
    one pipeline stage's tensor-parallel slice (a pipeline's first stage only looks its table up)."""
    c = count(m)
    norms = 2 * norm_params(m)
    if rank is None:
        lookups = c.embedding - (m.vocab * m.hidden if m.tied_embeddings else 0)
        return c.total - lookups - norms * m.layers - c.final_norm, c.per_layer - norms
    layer = rank.per_layer - norms
    tied_table = m.vocab * m.hidden // rank.vocab_split if m.tied_embeddings and rank.stages == 1 else 0
    return layer * len(rank.layers) + rank.head + tied_table, layer


def _fsdp(cfg: RunConfig, states: ModelStates, plan: ActivationPlan, weights: dict[str, int], logits_fwd: int,
          loss_grads: int, opt_tmp: int, walk: list[int], rank: RankShare) -> dict[str, dict[str, int]]:
    assert plan.per_layer_full is not None, "formula.profile.needed() asks for the full layer's terms under FSDP"
    transient, head_grad, below = _backward_terms(cfg, states.gradients * cfg.dp, rank)
    resident = fsdp_resident(cfg, weights, fsdp_shard_bytes(cfg, rank))
    return fsdp_phases(cfg, resident, plan.per_layer_full, plan.per_layer_kept, below + plan.others, plan.total,
                       logits_fwd, loss_grads, head_grad, transient, opt_tmp // cfg.dp,
                       fsdp_gradient_shard_bytes(cfg, rank), walk, rank)


def _dresser(cfg: RunConfig, rank: RankShare):
    """``dress(held, phase, parts, done)``: the pipeline's own tensors for ``held`` micro-batches in flight after
    ``done`` forwards (interleaved: ``dress(step, phase, parts)``, formula/interleaved.py)."""
    if interleaved.ordered(cfg):
        return interleaved.dresser(cfg, rank)
    return lambda held, ph, parts, done: with_pipeline(cfg, dataclasses.replace(rank, in_flight=held),
                                                        deepspeed.dressed(cfg, rank, {ph: parts}), done)[ph]


def _fsdp_pipelined(cfg: RunConfig, states: ModelStates, plan: ActivationPlan, weights: dict[str, int],
                    logits_fwd: int, loss_grads: int, opt_tmp: int, walk: list[int], rank: RankShare
                    ) -> dict[str, dict[str, int]]:
    """FSDP2 inside a pipeline stage (formula/fsdp_pipeline.py), each point with the pipeline's own tensors."""
    transient, head_grad, below = _backward_terms(cfg, states.gradients * cfg.dp, rank)
    return fsdp_pipeline.phases(
        cfg, rank, fsdp_resident(cfg, weights, fsdp_shard_bytes(cfg, rank)), plan.per_layer_kept,
        plan.per_layer_full, plan.total - plan.others, below, logits_fwd, loss_grads, head_grad, transient,
        opt_tmp // cfg.dp, fsdp_gradient_shard_bytes(cfg, rank),
        _dresser(cfg, rank), walk)


def memory(cfg: RunConfig) -> MemoryEstimate:
    """Per rank: every figure is the most loaded pipeline stage's (the only one without a pipeline); ``ranks``
    has each stage's peak and parts."""
    stages = shares(cfg)
    per = [_stage_memory(cfg, r) for r in stages]
    worst = max(range(len(per)), key=lambda i: (per[i].peak_bytes, -i))
    entries = tuple(RankMemory(stage=r.stage, layers=len(r.layers), in_flight=r.in_flight, peak_bytes=e.peak_bytes,
                               activations_bytes=e.activations_bytes, parameters=r.params,
                               parts=dict(e.at_peak, allocator=e.margin_bytes), role=r.describe())
                    for r, e in zip(stages, per))
    return dataclasses.replace(per[worst], ranks=entries, most_loaded=stages[worst].describe())


def _stage_memory(cfg: RunConfig, rank: RankShare) -> MemoryEstimate:
    m, s, b = cfg.model, cfg.seq, cfg.micro_batch
    states = model_states(cfg, rank)
    plan = activation_plan(cfg, rank)
    modes = cfg.ac.layer_modes(m.layers)
    n_recomputed = sum(1 for i in rank.layers if modes[i].spec.recomputes)
    # autocast's 16-bit weight copies: all of them sit in its cast cache until the forward leaves autocast;
    # in backward only those the matmuls saved remain (recomputed layers cast again, transiently)
    copies_fwd = copies = layer_copy = 0
    # under ZeRO the 16-bit weights are resident instead
    # (Megatron's engines train the 16-bit weights themselves: no autocast either)
    spec = cfg.parallel.engine_spec
    autocast = cfg.precision.mixed and not spec.shards_optimizer and not spec.megatron
    # a layout's ranks are priced from the built-in terms (a profile only splits its layers' totals)
    fitted = profile_terms(cfg) if rank.whole else None
    if autocast and fitted is not None:  # as the model's code keeps them (embeddings and norms are not cast)
        copies_fwd = fitted.copies_layer * m.layers + fitted.copies_outside
        copies = copies_fwd - fitted.copies_layer * n_recomputed
        layer_copy = fitted.copies_layer
    elif autocast and rank.whole and compiled.applies(cfg):  # a compiled block's casts are its graph's own tensors:
        n, per_layer = autocast_cast_params(m, rank)  # those it saves are in its kept terms, the rest die in it
        copies_fwd = copies = 2 * (n - per_layer * m.layers)
        if plan.per_layer_working is not None:  # the LM head's copy: freed by its backward, before the layers'
            plan = dataclasses.replace(plan, per_layer_working=tuple(w - copies for w in plan.per_layer_working))
    elif autocast:
        n, per_layer = autocast_cast_params(m, rank)
        if fp8.active(cfg):  # a Float8Linear / TE module casts its own weight: no F.linear for autocast to cache
            n, per_layer = n - per_layer * len(rank.layers), 0
        copies_fwd = 2 * n
        copies = 2 * (n - per_layer * n_recomputed)
        layer_copy = 2 * per_layer
    data = cfg.accum * 2 * s * b * 8  # int64 inputs and targets, all micro-batches made up front
    prof = m.matching_profile  # the model's buffers, resident all along (the tracker counts them as parameters)
    buffers = prof.buffers_per_layer * m.layers + prof.buffers_outside if prof is not None and fitted is not None else 0
    weights = dict(parameters=(copies if autocast else states.parameters) + buffers, master=states.master,
                   optimizer=states.optimizer, data=data)
    fsdp = cfg.parallel.shards_gradients  # FSDP2 (formula.fsdp; DeepSpeed's stage 2 and 3 priced alike); else DDP
    # DDP (gradient_as_bucket_view) keeps its gradient buckets between updates, as accumulation keeps .grad,
    # and so does zero_grad(set_to_none=False) (torch.nn.Module.zero_grad: "set to zero" instead of None)
    kept = cfg.accum > 1 or (cfg.dp > 1 and not fsdp) or not cfg.assumptions.zero_grad_set_to_none
    if rank.stages > 1:  # a pipeline stage (no DDP buckets): .grad exists at its high point only where a backward
        # of this update ran before it -- not where that high point is the update's first backward (all in flight);
        # GPipe and 1F1B price each step apart below (formula/stage_steps.py), the interleaved runtime this one
        kept = rank.in_flight < cfg.accum or not cfg.assumptions.zero_grad_set_to_none
    # Megatron-Core's DDP allocates its contiguous gradient buffer once and zeroes it each update: always resident
    kept = kept or cfg.parallel.engine_spec.megatron
    grads_before = states.gradients if kept and not cfg.optimizer_in_backward else 0
    walked = inbackward.walk_states(cfg, states)  # the fused step frees each gradient as it is made
    largest = largest_param(cfg, rank)
    in_flight = inbackward.in_flight_gradient(states, rank.params, largest)
    lp = rank_loss_path(cfg, rank)  # logits, their fp32 copy, log-softmax and its gradients, per loss path
    logits_fwd, loss_grads = lp.forward_transient, lp.backward_transient
    logits_fwd += held_in_forward_bytes(cfg)  # the KV cache lives until the loss is computed
    # AdamW (foreach=False) works one parameter at a time: a couple of temporaries of the largest tensor
    opt_tmp = 2 * largest * (2 if cfg.precision is Precision.BF16 else F32)
    walk: list[int] = []
    dress = _dresser(cfg, rank)
    if fitted is not None:  # measured on the model's own code (formula/profile.py)
        policies = layer_policies(cfg)
        # the forward's high point: the loss, or a recomputed block's working set (a mix: its largest); the
        # profile measured it above what is live as backward starts, so on 2P layers it includes the cast
        # cache's copies of the layers that keep none for backward (they grow with depth: counted apart).  A
        # recomputed block's working set comes while the layers above it have kept nothing yet: in a mix, its
        # policy's high point is read at its topmost block, less what the layers above that one keep
        traced = 2 * m.matching_profile.period
        top = {p: max(i for i, q in enumerate(policies) if q == p) for p in set(policies)}
        logits_fwd = max(fitted.forward(p)(b, s) - (traced * fitted.copies_layer if p != "full" and autocast else 0)
                         - (sum(plan.per_layer_kept[i + 1:]) if p != "full" else 0) for p, i in top.items())
        # the last layer's policy decides what backward's first steps recompute
        loss_grads = fitted.backward(policies[-1])(b, s)
        opt_tmp = fitted.optimizer_temporaries
    if fsdp_pipeline.walked(cfg):  # the pipeline's own tensors priced per step: not added again below
        phases = _fsdp_pipelined(cfg, states, plan, weights, logits_fwd, loss_grads, opt_tmp, walk, rank)
    elif fsdp_interleaved.walked(cfg):  # and per chunk and step (formula/fsdp_interleaved.py)
        phases = fsdp_interleaved.phases(cfg, rank, fsdp_resident(cfg, weights, fsdp_shard_bytes(cfg, rank)),
                                         opt_tmp // cfg.dp, fsdp_gradient_shard_bytes(cfg, rank), dress, lambda c: (
                                             *_backward_terms(cfg, c.states.gradients * cfg.dp, c.share),
                                             fsdp_gradient_shard_bytes(interleaved.flat(cfg), c.share)))
    elif fsdp:  # FSDP2's phases and its backward walk (formula/fsdp.py); DDP's below are not worked out
        phases = with_pipeline_no_sync(cfg, rank, _fsdp(cfg, states, plan, weights, logits_fwd, loss_grads, opt_tmp,
                                                        walk, rank),
                                       0 if sharded_master(cfg) else fsdp_shard_bytes(cfg, rank))
    else:
        def ddp(others: int, grads: int, walk_: list[int] | None, only=("forward", "backward", "optimizer"), ch=None):
            r_, pl, wk, fwd, bwd = (rank, plan, walked, logits_fwd, loss_grads) if ch is None else ch.terms(cfg)
            plan_ = dataclasses.replace(pl, others=others)
            make = {  # the parts live at each phase's high point
                "forward": lambda: dict(weights, parameters=(copies_fwd if autocast else states.parameters) + buffers,
                                        gradients=grads, activations=plan_.total, recompute=0, temporaries=fwd),
                "backward": lambda: (
                    _profiled_backward(cfg, plan_, walked, weights, grads, loss_grads, layer_copy) if fitted is not None
                    else _backward_peak(cfg, plan_, wk, weights, grads, bwd, 0 if ch else layer_copy, walk_, r_,
                                        inbackward.stepping_bytes(cfg, in_flight, opt_tmp),
                                        offload.backward_on_device(cfg, plan_), ch and ch.fresh)),
                # autocast's working copies are gone by the optimizer step
                "optimizer": lambda: dict(weights, parameters=(0 if autocast else states.parameters) + buffers,
                                          gradients=states.gradients, activations=0, recompute=0, temporaries=opt_tmp),
            }
            return {ph: make[ph]() for ph in only}
        if stage_steps.ordered(cfg):  # each distinct step of the stage's schedule (formula/stage_steps.py)
            one, always = plan.total - plan.others, not cfg.assumptions.zero_grad_set_to_none or spec.megatron
            at = lambda st: ((st.held - 1) * one, states.gradients if st.after_backward or always else 0)  # noqa: E731
            phases, top = stage_steps.highest(cfg, rank, lambda st, ph: ddp(*at(st), None, (ph,))[ph], dress)
            ddp(*at(top), walk, ("backward",))
        elif interleaved.ordered(cfg):  # each step of the interleaved schedule, its chunk (ch) priced as a stage
            phases, top = interleaved.highest(cfg, rank, lambda ch, o, g, ph: ddp(o, g, None, (ph,), ch)[ph], dress)
            ddp(top[1], top[2], walk, ("backward",), top[0])
        else:
            phases = ddp(plan.others, grads_before, walk)
    if not ((stage_steps.ordered(cfg) or interleaved.ordered(cfg)) and (cfg.parallel.fsdp or not fsdp)):  # per step
        phases = with_pipeline(cfg, rank, deepspeed.dressed(cfg, rank, phases))
    phases = offload.phases(cfg, inbackward.phases(cfg, phases), plan, walked=fitted is None)
    if cache8 := fp8.weight_cache_bytes(cfg, rank.layer_matrices, len(rank.layers)):  # TE's, held all update
        phases = {ph: dict(parts, **{"fp8 weights": cache8}) for ph, parts in phases.items()}
    totals = {k: sum(v.values()) for k, v in phases.items()}
    peak_phase = max(totals, key=totals.get)
    at_peak = phases[peak_phase]
    peak_tensor = totals[peak_phase]
    dm = device_memory(cfg, peak_tensor, peak_phase, plan.total, gradient_shards_live(cfg, rank, at_peak), rank)
    return MemoryEstimate(
        parameters_bytes=(0 if sharded_master(cfg) else fsdp_shard_bytes(cfg, rank)) if fsdp else states.parameters,
        master_bytes=(fsdp_shard_bytes(cfg, rank) if sharded_master(cfg) else 0) if fsdp else states.master,
        gradients_bytes=(fsdp_gradient_shard_bytes(cfg, rank) if fsdp else
                         in_flight if cfg.optimizer_in_backward else states.gradients),
        optimizer_bytes=states.optimizer, activations_bytes=plan.total,
        activations_per_layer_bytes=plan.per_layer_kept, recompute_working_bytes=at_peak["recompute"],
        logits_bytes=lp.kept, temporaries_bytes=at_peak["temporaries"], data_bytes=data,
        peak_tensor_bytes=peak_tensor, margin_bytes=dm.reserved_bytes - peak_tensor, peak_bytes=dm.reserved_bytes,
        allocated_bytes=dm.allocated_bytes, reserved_bytes=dm.reserved_bytes, device_bytes=dm.device_bytes,
        reserved_parts=dm.reserved_parts, device_parts=dm.device_parts, peak_phase=peak_phase,
        phase_peaks=totals, at_peak=at_peak, capacity_bytes=cfg.memory_capacity,
        backward_walk=tuple(walk), layer_copy_bytes=layer_copy)
