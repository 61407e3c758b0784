"""The engine catalogue: one entry per data-parallel engine and per pipeline schedule, owning what it shards,
keeps and sends -- the pattern of devices.py.  The formula, the measured run, the trace, the scripts ``fit`` prints
and the settings it writes read an entry; adding an engine is adding an entry (and its tests).

Torch-free.  The parallel layout that picks entries is ``config.parallel.Layout``.
"""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.config.choices import Choice, ConfigError


class Engine(Choice):
    """What runs the data-parallel dimension (``--sharding``); the ZeRO stage follows from it."""

    DDP = "ddp"
    ZERO1 = "zero1"  # DDP + torch.distributed.optim.ZeroRedundancyOptimizer
    FSDP_GRAD_OP = "fsdp-grad-op"  # FSDP2 fully_shard(reshard_after_forward=False): ZeRO-2
    FSDP = "fsdp"  # FSDP2 fully_shard(reshard_after_forward=True): ZeRO-3
    DEEPSPEED_ZERO1 = "deepspeed-zero1"
    DEEPSPEED_ZERO2 = "deepspeed-zero2"
    DEEPSPEED_ZERO3 = "deepspeed-zero3"
    MEGATRON = "megatron"  # Megatron-Core DistributedDataParallel + its mixed-precision optimizer
    MEGATRON_DISTOPT = "megatron-distopt"  # + --use-distributed-optimizer (ZeRO-1)


@dataclass(frozen=True)
class EngineSpec:
    """One engine's facts (Rajbhandari et al. 2019, ZeRO, sec. 5: stage k shards optimizer state, + gradients,
    + parameters over the data-parallel ranks)."""

    engine: Engine
    stage: int  # ZeRO stage it implements
    api: str  # what runs it, as a user writes it
    per_micro_batch: str  # what it sends per micro-batch
    per_update: str  # what it sends per optimizer update
    measured: bool = True  # batchlab runs it (forked gloo ranks or torchrun); False: formula only
    reshards_after_forward: bool = False  # parameters gathered again in backward (ZeRO-3)
    deepspeed: bool = False  # DeepSpeed's own buffers (formula/deepspeed.py) are priced
    # Megatron-Core: 16-bit model weights (no autocast), a persistent fp32 main-gradient buffer, fp32 main params
    # and Adam state in the optimizer (formula/states.py megatron_states)
    megatron: bool = False

    @property
    def shards_optimizer(self) -> bool:
        return self.stage >= 1

    @property
    def shards_gradients(self) -> bool:
        return self.stage >= 2

    @property
    def shards_parameters(self) -> bool:
        return self.stage >= 3

    @property
    def fsdp(self) -> bool:
        """FSDP2's per-block gather and reduce-scatter (formula/fsdp.py walks its phases)."""
        return self.engine in (Engine.FSDP_GRAD_OP, Engine.FSDP)


_DDP_UPDATE = "one gradient all-reduce (no_sync() on all but the last micro-batch), bucketed, overlapped with backward"
ENGINES: dict[Engine, EngineSpec] = {s.engine: s for s in (
    EngineSpec(Engine.DDP, 0, "DistributedDataParallel(gradient_as_bucket_view=True)", "nothing", _DDP_UPDATE),
    EngineSpec(Engine.ZERO1, 1, "DDP(gradient_as_bucket_view=True) + ZeroRedundancyOptimizer", "nothing",
               _DDP_UPDATE + "; the shard owners broadcast the updated parameters after the step"),
    EngineSpec(Engine.FSDP_GRAD_OP, 2, "FSDP2 fully_shard per block + root, reshard_after_forward=False",
               "all-gather of each block's parameters in forward, reduce-scatter of its gradients in backward",
               "nothing beyond the micro-batches'"),
    EngineSpec(Engine.FSDP, 3, "FSDP2 fully_shard per block + root, reshard_after_forward=True",
               "all-gather of each block's parameters in forward and again in backward, reduce-scatter of its "
               "gradients", "nothing beyond the micro-batches'", reshards_after_forward=True),
    # DeepSpeed ZeRO (deepspeed.ai/docs/config-json, "ZeRO optimizations"): its own buffers priced, not run here
    EngineSpec(Engine.DEEPSPEED_ZERO1, 1, "deepspeed.initialize, zero_optimization.stage=1", "nothing",
               "gradient all-reduce in reduce_bucket_size buckets; parameter all-gather in allgather_bucket_size",
               measured=False, deepspeed=True),
    EngineSpec(Engine.DEEPSPEED_ZERO2, 2, "deepspeed.initialize, zero_optimization.stage=2",
               "gradient reduce-scatter in reduce_bucket_size buckets (contiguous_gradients)",
               "parameter all-gather in allgather_bucket_size after the step", measured=False, deepspeed=True),
    EngineSpec(Engine.DEEPSPEED_ZERO3, 3, "deepspeed.initialize, zero_optimization.stage=3",
               "parameter all-gather per module (prefetch bucket, live-parameter limit), forward and backward; "
               "gradient reduce-scatter in reduce_bucket_size buckets", "nothing beyond the micro-batches'",
               measured=False, reshards_after_forward=True, deepspeed=True),
    # Megatron-LM (README, "Distributed Optimizer"; megatron/core/distributed, megatron/core/optimizer)
    EngineSpec(Engine.MEGATRON, 0, "Megatron-Core DistributedDataParallel + Float16OptimizerWithFloat16Params",
               "nothing", "gradient all-reduce from the contiguous fp32 gradient buffer, bucketed, overlapped with "
               "backward (--overlap-grad-reduce)", measured=False, megatron=True),
    EngineSpec(Engine.MEGATRON_DISTOPT, 1, "Megatron-Core DistributedDataParallel + DistributedOptimizer "
               "(--use-distributed-optimizer)", "nothing", "gradient reduce-scatter into the fp32 gradient buffer, "
               "then an all-gather of the updated 16-bit parameters", measured=False, megatron=True),
)}
PYTORCH_ENGINE = {0: Engine.DDP, 1: Engine.ZERO1, 2: Engine.FSDP_GRAD_OP, 3: Engine.FSDP}  # --zero N alone


def engine(value) -> Engine:
    """``--sharding`` spelling to its Engine; one ConfigError naming the allowed spellings otherwise."""
    return Engine.parse("sharding", str(value).strip().lower().replace("_", "-"))


class PipelineSchedule(Choice):
    """How a pipeline runs its micro-batches (torch.distributed.pipelining's schedules)."""

    GPIPE = "gpipe"  # all forwards, then all backwards (Huang et al. 2019)
    ONE_F_ONE_B = "1f1b"  # one forward, one backward once the pipeline is full (Narayanan et al. 2021, PipeDream-flush)
    INTERLEAVED = "interleaved-1f1b"  # v model chunks per rank (Narayanan et al. 2021, sec. 2.2)


@dataclass(frozen=True)
class ScheduleSpec:
    schedule: PipelineSchedule
    api: str  # torch.distributed.pipelining class
    virtual: bool  # takes more than one stage per rank
    # its runtime posts sends asynchronously and computes beside them (formula/overlap.py): torch's GPipe and
    # interleaved runtime, Megatron's interleaved schedule (overlap_p2p_comm); torch's 1F1B waits before computing
    overlaps_sends: bool = False

    def in_flight(self, stage: int, p: int, m: int, v: int = 1) -> float:
        """Micro-batches whose activations stage ``stage`` (0 first) of ``p`` holds at its high point, in units of
        one micro-batch through the rank's whole share of layers.  GPipe: all m (every forward runs before the
        first backward).  1F1B: p - stage, at most m (the warm-up forwards before the first backward).  Interleaved
        with v chunks per rank: Narayanan et al. 2021 sec. 2.2 / Megatron's schedule, (p - stage - 1) * 2 + (v - 1) * p
        + 1 warm-up chunk-forwards, each 1/v of the rank's layers, at most m * v chunks."""
        if self.schedule is PipelineSchedule.GPIPE:
            return float(m)
        if self.schedule is PipelineSchedule.ONE_F_ONE_B:
            return float(min(p - stage, m))
        warmup = min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)
        return warmup / v

    def gradient_sends_held(self, stage: int, m: int) -> int:
        """Input gradients a stage (0 first: it has none) still holds in their send while its high-point backward
        runs.  1F1B waits for the previous micro-batch's backward sends only after the next backward
        (``Schedule1F1B._step_microbatches``: "Clear previous chunk's backward sends" after ``backward_one_chunk``);
        GPipe waits for them all at the end, but its high point is its first backward, with none sent yet.  The
        interleaved runtime (``_PipelineScheduleRuntime``) waits for every send only when the step ends: counted
        step by step (formula/interleaved.py), not here."""
        if stage == 0 or m < 2 or self.schedule is PipelineSchedule.GPIPE:
            return 0
        return 1

    def bubble_fraction(self, p: int, m: int, v: int = 1) -> float:
        """Idle share of a pipeline's update: (p-1)/(m+p-1) for GPipe and 1F1B; with v chunks per rank the bubble
        shrinks v-fold, (p-1)/(v·m+p-1) (Narayanan et al. 2021, sec. 2.2: bubble time / ideal = (p-1)/(v·m))."""
        if p <= 1:
            return 0.0
        chunks = v if self.virtual else 1
        return (p - 1) / (chunks * m + p - 1)

    def check(self, p: int, m: int, v: int) -> None:
        """The micro-batches and chunks a schedule needs (torch.distributed.pipelining raises on fewer)."""
        if v > 1 and not self.virtual:
            raise ConfigError("pp_virtual", f"{self.schedule} runs one stage per rank: --pp-virtual 1, or "
                                            "--pp-schedule interleaved-1f1b")
        if p > 1 and self.schedule is not PipelineSchedule.GPIPE and m < p:
            raise ConfigError("accum", f"{self.schedule} over {p} stages needs at least {p} micro-batches per update "
                                       f"(accum), got {m}")
        if p > 1 and self.virtual and m % p:
            raise ConfigError("accum", f"interleaved-1f1b needs micro-batches per update (accum) divisible by "
                                       f"--pp {p}, got {m}")


SCHEDULES: dict[PipelineSchedule, ScheduleSpec] = {s.schedule: s for s in (
    ScheduleSpec(PipelineSchedule.GPIPE, "ScheduleGPipe", virtual=False, overlaps_sends=True),
    ScheduleSpec(PipelineSchedule.ONE_F_ONE_B, "Schedule1F1B", virtual=False),
    ScheduleSpec(PipelineSchedule.INTERLEAVED, "ScheduleInterleaved1F1B", virtual=True, overlaps_sends=True),
)}


class TPOverlap(Choice):
    """Whether a sequence-parallel layer's collectives are decomposed and overlapped with the GEMMs they feed or
    follow (``--tp-overlap``): the all-gather of a column-parallel GEMM's input and the reduce-scatter of a
    row-parallel GEMM's output, chunk by chunk (Wang et al. 2023, "Overlap communication with dependent computation
    via decomposition"): torchtitan's AsyncTP (torch's symmetric-memory fused all-gather / reduce-scatter matmuls),
    Megatron-Core / Transformer Engine's userbuffers (NeMo's ``tp_comm_overlap=True``).  Formula only."""

    NONE = "none"  # every collective in the critical path (Megatron's f and g, DTensor's redistributions)
    ASYNC = "async"  # decomposed and overlapped with its paired GEMM

    def check(self, sequence_parallel: bool) -> None:
        """AsyncTP and userbuffers decompose the sequence-parallel all-gathers and reduce-scatters (Megatron asserts
        it): overlap without sequence parallelism is a user error."""
        if self is not TPOverlap.NONE and not sequence_parallel:
            raise ConfigError("tp_overlap", f"{self} overlaps the sequence-parallel all-gathers and reduce-scatters: "
                                            "it needs --tp > 1 --sequence-parallel, or --tp-overlap none")


class Sent(Choice):
    """What one message of a tensor-parallel layout carries."""

    ACTIVATION = "activation"  # b·s·h elements of the activations' dtype: the whole (gathered) sequence
    NORM = "norm"  # one norm parameter tensor's gradient (h elements)
    TOKENS = "tokens"  # one fp32 figure per token (b·s elements): the vocabulary-parallel loss's reductions


@dataclass(frozen=True)
class Collective:
    """``count`` collectives of ``kind`` (formula.sharding's ring kinds) in ``phase``, each over ``sent``'s
    elements counted as nccl-tests sizes them: the whole buffer (all-reduce), the gathered output (all-gather),
    the unreduced input (reduce-scatter)."""

    kind: str
    phase: str  # forward | backward
    count: int
    sent: Sent = Sent.ACTIVATION
    # the GEMMs of each block (attention, MLP) it feeds or follows, "column" | "row" ("": none): per block, one of a
    # layer's ``count`` (``per_column``: one per column linear of the block)
    paired: str = ""


@dataclass(frozen=True)
class TensorParallelSpec:
    """What a tensor-parallel rank sends per micro-batch, as DTensor's ``parallelize_module`` plan runs it
    (distributed/tensor_parallel.py; torchtitan's plan).  ``per_layer``: one transformer layer; ``recompute``: a fully
    recomputed layer's forward again; ``per_column``: per column-parallel linear of a layer (each ``ColwiseParallel``
    takes its input through its own ``from_local(Replicate)``, whose backward all-reduces that input's partial
    gradient); ``per_norm``: per norm parameter tensor (sequence parallelism runs the norms on
    DTensors whose replicated weights' gradients come back partial); the model's ends, on the stage holding each:
    ``embedding`` / ``head`` always, ``embedding_vocab`` / ``head_vocab`` where tp splits the vocabulary."""

    sequence_parallel: bool
    api: str
    per_layer: tuple[Collective, ...]
    recompute: tuple[Collective, ...]
    per_column: tuple[Collective, ...] = ()
    embedding: tuple[Collective, ...] = ()
    embedding_vocab: tuple[Collective, ...] = ()
    head: tuple[Collective, ...] = ()
    head_vocab: tuple[Collective, ...] = ()
    per_norm: tuple[Collective, ...] = ()
    differs: str = ""  # where the engine sends more than the paper's count

    def ends(self, first: bool, last: bool, vocab_parallel: bool) -> tuple[Collective, ...]:
        """The collectives of the model's ends that a stage holding the embedding (``first``) and / or the head
        (``last``) runs per micro-batch."""
        out: tuple[Collective, ...] = ()
        if first:
            out += self.embedding + (self.embedding_vocab if vocab_parallel else ())
        if last:
            out += self.head + (self.head_vocab if vocab_parallel else ())
        return out


def _c(kind: str, phase: str, count: int, sent: Sent = Sent.ACTIVATION, paired: str = "") -> Collective:
    return Collective(kind, phase, count, sent, paired)


# Shoeybi et al. 2019 sec. 3 (Megatron's f and g): per layer 2 all-reduces of b·s·h in forward, 2 in backward.
# Korthikanti et al. 2022 sec. 4.2.2: with sequence parallelism each becomes an all-gather + reduce-scatter pair of
# the same volume: forward 2 all-gathers + 2 reduce-scatters.  DTensor's backward differs: each column-parallel
# linear's input gradient comes back partial through its own ``from_local(Replicate)`` and is all-reduced whole
# (then sliced with sequence parallelism), one per such linear (separate q/k/v and a gated MLP: 5 a layer) where
# Megatron's f reduces once per block (2); the norms' replicated weights are all-reduced every micro-batch, where
# Megatron all-reduces them once per update; ``loss_parallel`` all-reduces each token's max, sum of exponentials
# and target logit.  Counted on real runs (tests/formula/test_parallel_time.py).
LOSS_PARALLEL = (Collective("all_reduce", "forward", 3, Sent.TOKENS),)
TENSOR_PARALLEL: dict[bool, TensorParallelSpec] = {s.sequence_parallel: s for s in (
    TensorParallelSpec(False, "parallelize_module: ColwiseParallel / RowwiseParallel",
                       per_layer=(_c("all_reduce", "forward", 2, paired="row"),),
                       recompute=(_c("all_reduce", "forward", 2, paired="row"),),
                       per_column=(_c("all_reduce", "backward", 1, paired="column"),),
                       # the row-parallel embedding's output; the column-parallel head's input gradient, the loss
                       embedding_vocab=(_c("all_reduce", "forward", 1),),
                       head_vocab=(_c("all_reduce", "backward", 1),) + LOSS_PARALLEL,
                       differs="backward all-reduces each column-parallel linear's input gradient"),
    TensorParallelSpec(True, "parallelize_module: + SequenceParallel norms, Shard(1) between blocks",
                       # the input gathered for the column GEMMs, the row GEMM's output reduce-scattered; backward
                       # the output gradient gathered for the row GEMM's, the column inputs' gradients reduced
                       per_layer=(_c("all_gather", "forward", 2, paired="column"),
                                  _c("reduce_scatter", "forward", 2, paired="row"),
                                  _c("all_gather", "backward", 2, paired="row")),
                       recompute=(_c("all_gather", "forward", 2, paired="column"),
                                  _c("reduce_scatter", "forward", 2, paired="row")),
                       per_column=(_c("all_reduce", "backward", 1, paired="column"),),
                       # the first block's sequence slice taken locally, its gradient gathered back; the head's
                       # input gathered (reduce-scattered back where the head is column-parallel), the loss
                       embedding=(_c("all_gather", "backward", 1),),
                       embedding_vocab=(_c("all_reduce", "forward", 1),),
                       head=(_c("all_gather", "forward", 1),),
                       head_vocab=(_c("reduce_scatter", "backward", 1),) + LOSS_PARALLEL,
                       per_norm=(_c("all_reduce", "backward", 1, Sent.NORM),),
                       differs="backward all-reduces each column-parallel linear's input gradient whole (Megatron: "
                               "one reduce-scatter per block) and the norms' weight gradients every micro-batch"),
)}
