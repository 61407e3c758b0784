"""What one rank keeps for backward per micro-batch, layer by layer, and what its pipeline stage's other in-flight
micro-batches add (no torch): the built-in terms (formula/activations.py, formula/checkpointing.py) or a cached
profile's, split per tensor-parallel rank as formula/ranks.py says."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from batchlab.config import ACMode, Applied, Implementation, LossMode, RunConfig
from batchlab.formula import activations as act
from batchlab.formula import checkpointing
from batchlab.formula import compiled, fp8
from batchlab.formula.deepspeed import activation_precision
from batchlab.formula.loss import LossPath, loss_path, megatron_loss_path, vocab_parallel_path
from batchlab.formula.profile import layer_policies, terms as profile_terms
from batchlab.formula.ranks import RankShare, share, sp_gathered_inputs, tp_kept_bytes


@dataclass(frozen=True)
class ActivationPlan:
    per_layer_full: int | None  # a layer with nothing recomputed (None: a profile that needs it only under FSDP)
    per_layer_kept: tuple[int, ...]  # what each layer keeps under the policy
    outside_layers: int  # embedding dropout mask, final norm, log-softmax output
    others: int = 0  # the other in-flight micro-batches' activations a pipeline stage holds (0 without one)
    # each layer's compiled backward at its high point, its kept bytes included (formula/compiled.py); None: the
    # eager working set (the rest of the layer restored, and the in-layer gradients)
    per_layer_working: tuple[int, ...] | None = None

    @property
    def total(self) -> int:
        return sum(self.per_layer_kept) + self.outside_layers + self.others


def activation_plan(cfg: RunConfig, rank: RankShare | None = None) -> ActivationPlan:
    """What one micro-batch keeps on ``rank`` (formula/ranks.py; default: the first stage), plus the other
    micro-batches a pipeline stage holds at its high point."""
    rank = rank or share(cfg, 0)
    m, s, b, p = cfg.model, cfg.seq, cfg.micro_batch, activation_precision(cfg)
    fitted = profile_terms(cfg)
    if fitted is not None and rank.whole:  # the model's own code, traced and fitted (formula/profile.py)
        return _profiled_plan(cfg, fitted)
    backend = cfg.device_spec.backend
    if rank.whole and compiled.applies(cfg):  # what the compiled blocks' partition saves (formula/compiled.py)
        kept, full = compiled.kept_per_layer(cfg)
        outside = act.outside_layers_bytes(m, s, b, p, backend) + rank_loss_path(cfg, rank).kept
        return ActivationPlan(full, kept, outside, per_layer_working=compiled.working_per_layer(cfg))
    impl = act.implementation(cfg.model_kind, m)
    parts = act.layer_activations(m, s, b, p, backend, impl, cfg.kv_cache)
    if cfg.assumptions.torch_before(1, 11):
        parts = dataclasses.replace(parts, scores=parts.scores + act.legacy_softmax_input_bytes(m, s, b, p, backend))
    full = parts.total
    norm_output = s * b * m.hidden * act.Widths.of(p, backend).e  # a norm's output: the next matmul's input
    # Megatron's column-parallel linears save the sequence shard and gather it again in backward
    regathers = impl is act.Impl.MEGATRON
    gathered = 0 if regathers else sp_gathered_inputs(rank, norm_output, 2)  # a layer's two norms
    modes = cfg.ac.layer_modes(m.layers)
    one_rank, per_mode = {}, {}  # alike layers under one policy keep alike bytes: once per policy, not per layer
    for mode in {modes[i] for i in rank.layers}:
        # what the catalogue entry's term keeps on one rank (config/acpolicies.py), or the whole layer
        one_rank[mode] = checkpointing.kept_bytes(mode, m, s, b, p, backend, impl) if mode.spec.recomputes else full
        per_mode[mode] = tp_kept_bytes(mode, parts, one_rank[mode], rank, gathered)
    kept = [per_mode[modes[i]] for i in rank.layers]
    full_rank = tp_kept_bytes(ACMode.NONE, parts, full, rank, gathered)
    cut = fp8.saved_input_cut(cfg, act.Widths.of(p, backend).e, rank.in_sp, rank.tp, gathered > 0)
    if cut:  # TE keeps its linear layers' inputs in fp8, in every layer that keeps them (formula/fp8.py)
        keeps = (Applied.NOTHING, Applied.ATTENTION_CORE)
        kept = [k - cut if modes[i].spec.applied in keeps else k for i, k in zip(rank.layers, kept)]
        full_rank -= cut
    if fitted is not None:  # a profile's per-layer totals, split as the built-in breakdown splits at this shape
        names = layer_policies(cfg)
        kept = [round(fitted.layer(names[i])(b, s) * k / max(one_rank[modes[i]], 1))
                for i, k in zip(rank.layers, kept)]
        if fitted.layer_full is not None:
            full_rank = round(fitted.layer_full(b, s) * full_rank / max(full, 1))
    # the embedding's dropout runs before the sequence is split (its mask whole); under SP the final norm's output
    # is gathered whole for the LM head as a layer's norms' are for their matmuls
    mask = act.embedding_mask_bytes(m, s, b, p, backend)
    head_input = 0 if regathers else sp_gathered_inputs(rank, norm_output, 1)
    final = act.outside_layers_bytes(m, s, b, p, backend) - mask
    head = (((final - head_input) // rank.in_sp + head_input) if rank.last else 0) + rank_loss_path(cfg, rank).kept
    # every stage of the rank computes its own rotary tables for each micro-batch it runs (distributed/hf_stage.py)
    tables = act.rope_table_bytes(m, s, p, backend, impl) * cfg.parallel.chunks
    outside = (mask if rank.first else 0) + head + tables
    one_micro_batch = sum(kept) + outside
    others = (rank.in_flight - 1) * (one_micro_batch - head) + (head_in_flight(cfg, rank) - 1) * head
    return ActivationPlan(per_layer_full=full_rank, per_layer_kept=tuple(kept), outside_layers=outside,
                          others=round(others))


def head_in_flight(cfg: RunConfig, rank: RankShare) -> float:
    """Micro-batches past the final norm and the loss at the last rank's high point.  With v > 1 chunks per rank
    Megatron's interleaved warm-up runs chunk after chunk over groups of min(m, p) micro-batches (Narayanan et al.
    2021, sec. 2.2; megatron/core/pipeline_parallel/schedules.py), so of its in-flight chunk-forwards the first
    (v - 1) groups never reach the last chunk, which holds the loss: max(1, chunks in flight - (v - 1) min(m, p)).
    torch.distributed.pipelining's runtime is measured to hold about that much more on its last rank (sends it waits
    for only when the step ends: docs/accuracy/parallel.md): there every in-flight micro-batch counts one."""
    v = cfg.parallel.chunks
    if not rank.last or v == 1 or cfg.model.impl is not Implementation.MEGATRON:
        return rank.in_flight
    group = min(cfg.accum, cfg.parallel.pp)
    return float(max(1, round(rank.in_flight * v) - (v - 1) * group))


def rank_loss_path(cfg: RunConfig, rank: RankShare) -> LossPath:
    """The loss's tensors on ``rank``: on the last stage only; vocabulary-parallel where tensor parallelism
    splits the vocabulary (``RunConfig.vocab_parallel``: loss_parallel's tensors, 1/t of the logits per rank),
    else the whole logits' loss on every tensor-parallel rank.  Megatron's layer computes its own, fused or not."""
    if rank.last and cfg.model.impl is Implementation.MEGATRON and cfg.loss.mode in (LossMode.FULL, LossMode.FUSED):
        return megatron_loss_path(cfg, rank.vocab_split)
    if rank.whole:
        return loss_path(cfg)
    if not rank.last:
        return LossPath(kept=0, forward_transient=0, backward_transient=0)
    if cfg.vocab_parallel and cfg.loss.mode is LossMode.FULL:
        return vocab_parallel_path(cfg, rank.tp)
    return loss_path(cfg, rank.vocab_split)  # only its vocabulary-sized tensors split


def _profiled_plan(cfg: RunConfig, t) -> ActivationPlan:
    """The plan from a layer profile's fitted terms (``config.profile.Terms``) at cfg's (b, s).  What the layers
    do not explain is per policy (a checkpointed block keeps its inputs: a mask made once per forward); a mix
    (every:K) keeps the union, bounded here by the largest."""
    b, s = cfg.micro_batch, cfg.seq
    policies = layer_policies(cfg)
    kept = tuple(t.layer(p)(b, s) for p in policies)
    full = t.layer_full(b, s) if t.layer_full is not None else None
    return ActivationPlan(per_layer_full=full, per_layer_kept=kept,
                          outside_layers=max(t.outside(p)(b, s) for p in set(policies)))
