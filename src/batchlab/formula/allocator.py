"""From tensor bytes to what the device shows: allocated, reserved (PyTorch's CUDACachingAllocator) and the
device view (nvidia-smi), each part named with its mechanism (no torch).

Rules (pytorch c10/cuda/CUDACachingAllocator.cpp @ 001074d2): sizes round up to 512 B ("kMinBlockSize");
requests <= 1 MiB come from 2 MiB segments, 1-10 MiB from 20 MiB segments, larger ones get a segment of their
own rounded up to 2 MiB ("kRoundLarge"); a cached large block is split only if more than 1 MiB would remain;
a block freed on one stream is reused only on that stream.  What follows from them at the peak:

- segment rounding: every live tensor over 10 MiB wastes on average half a 2 MiB round-up;
- the freed 16-bit logits: the full loss path frees them once their fp32 copy exists (torchtitan
  ``del pred``), and the fp32 gradients the loss's backward allocates next are twice their size, so their
  segment stays reserved but empty at the loss-backward peak;
- stream pools: FSDP's all-gather and reduce-scatter run on their own streams, whose cached blocks (one
  block's gathered parameters, one block's gradients in the reduce dtype) the compute stream cannot reuse; FSDP2
  gathers into one flat buffer allocated on its copy-in stream (torch/distributed/_composable/fsdp/
  _fsdp_collectives.py foreach_all_gather: ``with ...stream(all_gather_copy_in_stream): all_gather_output =
  torch.empty(...)``) and copies it out into the block's own parameters (foreach_all_gather_copy_out), so with or
  without resharding after forward (ZeRO-3 or ZeRO-2) that pool caches one block in the gathered dtype (1 byte
  under fp8 all-gather) beside the reduce-scatter's;
  FSDP2 allocates the reduce-scatter *output*, of which every gradient shard is a view, on that stream too
  (torch/distributed/_composable/fsdp/_fsdp_collectives.py foreach_reduce: ``with
  device_handle.stream(reduce_scatter_stream): reduce_output = reduce_scatter_input.new_empty(...)``), so once
  zero_grad frees the shards their blocks stay in the reduce-scatter pool through the next forward: at a peak
  where this update's shards are not yet all live, the rest of that pool is reserved and empty;
- full-sequence blocks under tensor parallelism (DTensor's plan: distributed/tensor_parallel.py, torchtitan's
  parallelize_llama): with sequence parallelism a TP rank holds 1/t of the sequence between blocks, but inside a
  block it makes tensors of the whole sequence (s x b x h in the compute dtype) on the compute stream and frees them
  there: the all-gathered inputs of attention and of the MLP (PrepareModuleInput Shard(1) -> Replicate: funcol
  all_gather_into_tensor gathers on dim 0, then torch._utils._maybe_view_chunk_cat copies its chunks to dim 1, a
  view only at micro-batch 1), a row-parallel GEMM's partial output and its chunk-cat copy for the dim-1
  reduce-scatter (_functional_collectives.reduce_scatter_single, _chunk_or_narrow_cat), a column-parallel GEMM's
  partial input gradient and its all-reduced copy (ColwiseParallel's ``from_local(Replicate)`` backward; funcol
  all_reduce is out of place).  A fully recomputed block's backward holds four at once: the recomputed forward saved
  both gathered inputs (the column GEMMs' weight gradients read them), beside the row-parallel output gradient's
  all-gather output and its dim-1 copy, or a column GEMM's partial input gradient and its all-reduced copy.  Without
  sequence parallelism (ColwiseParallel's input and RowwiseParallel's output Replicate) the same four are whole-
  sequence already: the recomputed norms' outputs the column GEMMs saved, and a column GEMM's partial input gradient
  and its all-reduced copy (the row-parallel output's all-reduce, partial and copy, in the recomputed forward).
  Segments are never returned during training, so the compute pool keeps four such blocks from one update to the
  next; at the loss's backward the loss's fp32 tensors (s x b x V/t x 4 B) are larger than each and only the LM
  head's input (saved for its weight gradient) is live in one of them: three are reserved and empty (not at
  micro-batch 1 with sequence parallelism, where the chunk-cat copies are views: ``tensor_parallel_blocks``).  Without
  sequence parallelism the forward's kept block inputs are whole-sequence too and may take some of them first (best
  fit of an exact size): the replay keeps one to three empty there, the formula counts three.  Checked against the
  allocator replay of a trace, tests/trace/test_sequence_parallel_blocks.py;
- cuBLAS workspaces (PyTorch #120925: 32 MiB on Hopper and later, 4 MiB on Ampere with >= 24 GB, else 1 MiB),
  one per stream that runs matmuls; allocated through the caching allocator, so inside reserved.

Not modelled: ``record_stream`` on collectives issued with async_op=True (ProcessGroupNCCL unless
TORCH_NCCL_AVOID_RECORD_STREAMS=1, the default only in later torch: torchtitan PR 1088) keeps a freed block
until the NCCL stream passes it, which "couples the caching allocator's memory reuse with GPU kernel timing"
(torchtitan docs/composability.md); no config field fixes how far the CPU runs ahead.  torchtitan sets the variable
(init_distributed), and then the work's stash is cleared at ``wait()`` (WorkNCCL::synchronizeStream), so its runs
are not affected.  Expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) only lower reserved below
this model: a free tail of a stream's segment grows in place.

The device view adds what lives outside the allocator: the CUDA context and kernels (config/devices.py) and
NCCL's buffers (not found published: estimate 0.5 GiB per process with DP > 1; measure with gpu_check.sh).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from batchlab.config import Backend, Implementation, LossMode, Precision, RunConfig
from batchlab.config.acpolicies import ACMode
from batchlab.formula import fp8
from batchlab.formula.params import count
from batchlab.formula.sharding import reduced_bytes_per_element, unit_elements

MiB, GiB = 2**20, 2**30
LARGE = 10 * MiB  # kMinLargeAlloc: above it a tensor gets its own segment, rounded to 2 MiB
NCCL_ESTIMATE = GiB // 2


@dataclass(frozen=True)
class DeviceMemory:
    allocated_bytes: int  # tensor bytes at the peak (max_memory_allocated)
    reserved_bytes: int  # allocated + cached segments not holding live tensors at the peak (max_memory_reserved)
    device_bytes: int  # reserved + CUDA context + NCCL buffers (nvidia-smi "used")
    reserved_parts: dict[str, int] = field(default_factory=dict)  # what reserved adds to allocated, by mechanism
    device_parts: dict[str, int] = field(default_factory=dict)  # what the device view adds to reserved
    provenance: str = "formula (allocator model)"


def cublas_workspace(arch: str) -> int:
    # PyTorch #120925: "the recommended workspace size for Hopper is 32 MiB and for the rest architectures 4 MiB"
    # (4 MiB only for sm80+ with >= 24 GB; 1 MiB below)
    return 32 * MiB if arch in ("hopper", "blackwell") else 4 * MiB if arch in ("ampere", "ada") else MiB


def _round_up_waste(size: int) -> int:
    """Bytes a segment of its own wastes on a tensor of ``size`` (> 10 MiB: rounded up to 2 MiB)."""
    return -size % (2 * MiB) if size > LARGE else 0


def segment_rounding(cfg: RunConfig, activation_bytes: int, rank=None) -> int:
    """Round-up waste of the large live tensors at the peak: the state tensors of each large weight (weights or
    master, gradients, Adam m and v), and the activations taken as s x b x h slices (the typical saved tensor)."""
    m = cfg.model
    t, layers = (rank.tp, len(rank.layers)) if rank is not None else (1, m.layers)  # a pipeline stage's TP slice
    weights = [m.hidden * m.hidden // t] * 2 + [m.hidden * m.ffn // t] * (3 if m.mlp.value == "swiglu" else 2)
    shard = cfg.dp if cfg.parallel.engine_spec.shards_optimizer else 1
    states = sum(_round_up_waste(4 * w // shard) for w in weights) * 4 * layers
    slice_ = cfg.seq * cfg.micro_batch * m.hidden * cfg.precision.compute_bytes
    return states + activation_bytes // slice_ * _round_up_waste(slice_)


def pooled_shard_bytes(cfg: RunConfig, rank=None) -> int:
    """One update's gradient shards on a rank (reduce-scatter outputs, in the reduce dtype): what the reduce-scatter
    stream's pool holds once they are made."""
    return sum(unit_elements(cfg, rank)) * reduced_bytes_per_element(cfg) // cfg.dp


def gradient_shards_live(cfg: RunConfig, rank, parts: dict[str, int]) -> int:
    """Of a point's live tensors (``parts``), the gradient bytes that are reduce-scatter outputs.  Under a pipeline
    every backward runs with ``set_requires_gradient_sync(False)`` and FSDP2 reduce-scatters once, after the update's
    last backward (torch/distributed/pipelining/stage.py, ``backward_maybe_with_nosync`` then ``perform_reduce_grad``):
    at a point still holding activations (a micro-batch's forward or backward) the gradients are unsharded
    accumulations on the compute stream and no shard of this update exists yet; only last update's shards, zeroed
    in place by ``zero_grad(set_to_none=False)``, may still fill the pool's blocks.

    Limit: a torch before pytorch PR 165106 ('[PP] move FSDP reduce scatters to end of step', opened after torch
    2.9's branch cut; older stages call ``set_requires_gradient_sync(last_backward)``) reduce-scatters inside the
    last micro-batch's backward (an interleaved chunk's: its own last), block by block, refilling the pool as
    it goes; this rule keeps the pool empty there too, whatever ``torch_version`` says: a high point inside that
    backward past its first block's reduction is counted too high by up to one update's shards (at its start, the
    loss's gradient, none exists yet either way)."""
    if rank is not None and rank.stages > 1 and parts.get("activations", 0) > 0:
        if cfg.assumptions.zero_grad_set_to_none:
            return 0
        return min(parts.get("gradients", 0), pooled_shard_bytes(cfg, rank))
    return parts.get("gradients", 0)


def vocab_shard(cfg: RunConfig, rank=None) -> int:
    """The logits' width on ``rank``: the vocabulary, 1/t of it under loss parallelism (whole replica: all of it)."""
    return cfg.model.vocab // (rank.vocab_split if rank is not None else 1)


def tensor_parallel_blocks(cfg: RunConfig, rank=None) -> int:
    """Bytes of the full-sequence blocks a DTensor TP rank, with or without sequence parallelism, holds empty at the
    loss's backward (module docstring): four s x b x h blocks left in the pool by a fully recomputed block's
    backward, less the LM head's input live in one.  0 where the loss's fp32 rows (V/t x 4 B) are no wider than a
    block's (h x e): the loss's tensors would fit in them.  Also 0 where the replay does not show the four:

    - no layer of the rank fully recomputed (the replay keeps about one s x b x h block there, not counted);
    - sequence parallelism at micro-batch 1, where the chunk-cat copies are views of the collectives' outputs (the
      replay keeps at most one block, not counted).

    Checked on eager 16-bit traces only: Float8's gathers (fp8 bytes) and inductor's own buffer planning under
    ``--compile`` are not, and the term is kept for them as the same tensors are made there."""
    p = cfg.parallel
    # Megatron-Core gathers into its global memory buffer, allocated once (megatron/core/tensor_parallel/layers.py
    # get_global_memory_buffer().get_tensor): no funcol outputs freed into the pool
    if p.tp < 2 or p.engine_spec.megatron or cfg.model.impl is Implementation.MEGATRON:
        return 0
    m, e = cfg.model, cfg.precision.compute_bytes
    layers = rank.layers if rank is not None else range(m.layers)
    modes = cfg.ac.layer_modes(m.layers)
    if not any(modes[i] is ACMode.FULL for i in layers) or (p.sequence_parallel and cfg.micro_batch == 1):
        return 0
    if vocab_shard(cfg, rank) * 4 <= m.hidden * e:
        return 0
    return (4 - 1) * cfg.seq * cfg.micro_batch * m.hidden * e  # four in the pool, the head's input live


def device_memory(cfg: RunConfig, peak_tensor: int, peak_phase: str, activation_bytes: int,
                  live_gradients: int = 0, rank=None) -> DeviceMemory:
    """``live_gradients``: gradient shard bytes live at the peak (``gradient_shards_live``; 0 when unknown); ``rank``:
    the pipeline stage's share (formula/ranks.py), whole replica when None."""
    holds_loss = rank is None or rank.last
    dev = cfg.device_spec
    if dev.backend is Backend.CPU:  # no caching allocator: the live-tensor tracker's bytes are the figure
        return DeviceMemory(allocated_bytes=peak_tensor, reserved_bytes=peak_tensor, device_bytes=peak_tensor,
                            provenance="formula (tensor bytes; CPU)")
    if cfg.assumptions.allocator_margin is not None:  # the user's fixed margin replaces the model
        margin = int(peak_tensor * cfg.assumptions.allocator_margin)
        parts = {f"fixed margin {cfg.assumptions.allocator_margin:.0%} (assumption)": margin}
    else:
        parts = {"2 MiB segment rounding of tensors > 10 MiB": segment_rounding(cfg, activation_bytes, rank)}
        e = cfg.precision.compute_bytes
        at_loss = cfg.loss.mode is LossMode.FULL and peak_phase == "backward" and holds_loss
        if at_loss and e < 4:
            parts["freed 16-bit logits (too small for the fp32 loss gradients)"] = (
                cfg.seq * cfg.micro_batch * vocab_shard(cfg, rank) * e)
        if at_loss and (blocks := tensor_parallel_blocks(cfg, rank)):
            parts["tensor-parallel full-sequence blocks (a recomputed block's column-parallel inputs and "
                  "input gradients), too small for the loss's"] = blocks
        if cfg.parallel.shards_parameters or cfg.parallel.fsdp:
            reduce_bytes = 4 if cfg.precision is Precision.BF16_FSDP else e
            per_layer = rank.per_layer if rank is not None else count(cfg.model).per_layer
            # the flat all-gather output lives on the copy-in stream at either stage: the gathered blocks that stay
            # live under reshard_after_forward=False are its copies (_fsdp_collectives.py foreach_all_gather_copy_out)
            parts["FSDP all-gather / reduce-scatter stream pools"] = per_layer * (
                fp8.block_gather_bytes(cfg, e) + reduce_bytes)
        spec = cfg.parallel.engine_spec
        # FSDP2 at either stage reduce-scatters through foreach_reduce on its own stream; DeepSpeed ZeRO-2 at its
        # default overlap_comm=false reduces on the compute stream (stage_1_and_2.py average_tensor), and ZeRO-3
        # reduces into a gradient partition allocated once at init (stage3.py grad_partitions_flat_buffer): no
        # pool of shards of its own
        if cfg.parallel.shards_gradients and not spec.deepspeed:
            shards = pooled_shard_bytes(cfg, rank)
            if shards > live_gradients:
                parts["last update's gradient shards, cached in the reduce-scatter stream's pool"] = (
                    shards - live_gradients)
        parts["cuBLAS workspace"] = cublas_workspace(dev.arch)
    reserved = peak_tensor + sum(parts.values())
    extra = {f"CUDA context and kernels ({dev.context_source})": dev.context_bytes}
    if cfg.parallel.world_size > 1:
        extra["NCCL buffers (estimate: not found published)"] = NCCL_ESTIMATE
    return DeviceMemory(allocated_bytes=peak_tensor, reserved_bytes=reserved,
                        device_bytes=reserved + sum(extra.values()), reserved_parts=parts, device_parts=extra)
