"""How the world is split: the one parallel-layout value every reader asks (``RunConfig.parallel``).

    world size = dp x tp x pp        global batch = micro-batch x accum x dp   (tensor and pipeline ranks hold
                                                                            slices of one model replica)

Degrees: data parallel (``dp``, with its engine and ZeRO stage: config/engines.py), tensor parallel (``tp``,
Megatron's column / row split of attention and MLP, Shoeybi et al. 2019; with sequence parallelism the norms and
dropouts are split along the sequence too, Korthikanti et al. 2022), pipeline parallel (``pp`` stages of
consecutive layers, ``virtual`` chunks per rank under an interleaved schedule).  Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.config.engines import (ENGINES, SCHEDULES, TENSOR_PARALLEL, Engine, EngineSpec, PipelineSchedule,
                                     ScheduleSpec, TensorParallelSpec, TPOverlap)


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    engine: Engine = Engine.DDP
    tp: int = 1
    sequence_parallel: bool = False
    pp: int = 1
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    virtual: int = 1  # model chunks per pipeline rank (interleaved schedule)
    tp_overlap: TPOverlap = TPOverlap.NONE  # sequence-parallel collectives overlapped with their GEMMs

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def engine_spec(self) -> EngineSpec:
        return ENGINES[self.engine]

    @property
    def schedule_spec(self) -> ScheduleSpec:
        return SCHEDULES[self.schedule]

    @property
    def stage(self) -> int:
        """The ZeRO stage over the data-parallel ranks (0 with one rank: nothing to shard over)."""
        return self.engine_spec.stage if self.dp > 1 else 0

    # what every reader asks, named once: with one data-parallel rank nothing is sharded or reduced
    @property
    def shards_optimizer(self) -> bool:
        return self.dp > 1 and self.engine_spec.shards_optimizer

    @property
    def shards_gradients(self) -> bool:
        return self.dp > 1 and self.engine_spec.shards_gradients

    @property
    def shards_parameters(self) -> bool:
        return self.dp > 1 and self.engine_spec.shards_parameters

    @property
    def fsdp(self) -> bool:
        """FSDP2 runs the data dimension (per-block gather / reduce-scatter phases)."""
        return self.dp > 1 and self.engine_spec.fsdp

    @property
    def reshards_after_forward(self) -> bool:
        return self.dp > 1 and self.engine_spec.reshards_after_forward

    @property
    def tensor_parallel(self) -> bool:
        return self.tp > 1

    @property
    def tp_spec(self) -> TensorParallelSpec:
        """What a tensor-parallel rank sends per micro-batch (with or without sequence parallelism)."""
        return TENSOR_PARALLEL[self.sequence_parallel]

    @property
    def pipelined(self) -> bool:
        return self.pp > 1

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank."""
        return self.virtual if self.pipelined else 1

    def stage_layers(self, layers: int, stage: int) -> tuple[int, ...]:
        """The layers pipeline stage ``stage`` (0 first) holds: its ``virtual`` chunks of layers/(pp·virtual),
        chunk j of rank r being the (j·pp + r)-th slice (Narayanan et al. 2021, sec. 2.2)."""
        per = layers // (self.pp * self.chunks)
        return tuple(i for j in range(self.chunks) for i in range((j * self.pp + stage) * per,
                                                                  (j * self.pp + stage + 1) * per))

    def holds_embedding(self, stage: int) -> bool:
        return stage == 0

    def holds_head(self, stage: int) -> bool:
        """The last stage computes the final norm, the LM head and the loss."""
        return stage == self.pp - 1

    def in_flight(self, stage: int, micro_batches: int) -> float:
        """Micro-batches of activations stage ``stage`` holds at its high point (engines.ScheduleSpec.in_flight);
        1 without a pipeline."""
        if not self.pipelined:
            return 1.0
        return self.schedule_spec.in_flight(stage, self.pp, micro_batches, self.chunks)

    def bubble_fraction(self, micro_batches: int) -> float:
        return self.schedule_spec.bubble_fraction(self.pp, micro_batches, self.chunks)

    def text(self) -> str:
        """world = DP x TP x PP = ... ranks, with the engine, SP and schedule where they apply."""
        parts = [f"world = DP x TP x PP = {self.dp} x {self.tp} x {self.pp} = {self.world_size} ranks"]
        if self.dp > 1:
            parts.append(f"DP {self.engine.value}")
        if self.tp > 1:
            parts.append(("TP with sequence parallelism" if self.sequence_parallel else "TP")
                         + (", --tp-overlap async asked (its collectives overlapped with the GEMMs on CUDA devices; "
                            "elsewhere in the critical path)"
                            if self.tp_overlap is TPOverlap.ASYNC else ""))
        if self.pp > 1:
            parts.append(f"PP {self.schedule.value}" + (f", {self.virtual} chunks per rank" if self.virtual > 1 else ""))
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "schedule": self.schedule.value, "virtual": self.virtual,
                "sequence_parallel": self.sequence_parallel, "tp_overlap": self.tp_overlap.value,
                "world_size": self.world_size,
                "engine": self.engine.value, "zero": self.stage}


# a [config.parallel] table's names (Layout.to_dict, what --json and fit's config files write) -> RunConfig fields
_TABLE = {"dp": "dp", "tp": "tp", "pp": "pp", "schedule": "pp_schedule", "virtual": "pp_virtual",
          "sequence_parallel": "sequence_parallel", "tp_overlap": "tp_overlap", "engine": "sharding"}
_DERIVED = ("world_size", "zero")  # the degrees' product; the stage in effect (0 with one data-parallel rank)


def fields_from_table(table, flat: dict | None = None) -> dict:
    """RunConfig fields from a ``parallel`` table; its ``world_size`` (derived) must be the degrees' product, a
    degree the table leaves out taken from ``flat`` (the fields beside it)."""
    from batchlab.config.choices import ConfigError
    from batchlab.config.values import SIZE_MAX, whole_number

    if not isinstance(table, dict):
        raise ConfigError("parallel", "must be a table of dp, tp, pp, schedule, virtual, sequence_parallel, "
                                      "tp_overlap, engine")
    unknown = [k for k in table if k not in _TABLE and k not in _DERIVED]
    if unknown:
        raise ConfigError(f"parallel.{unknown[0]}", f"unknown; known: {', '.join([*_TABLE, *_DERIVED])}")
    out = {_TABLE[k]: v for k, v in table.items() if k in _TABLE}
    if "zero" in table:  # derived (the stage in effect), read back as written: still a stage 0-3
        whole_number("parallel.zero", table["zero"], allow_zero=True, maximum=3)
    if "world_size" in table:
        degrees = {**(flat or {}), **out}
        for k in ("dp", "tp", "pp"):  # whole numbers before they are multiplied (a list times 10**7 is not)
            whole_number(k, degrees.get(k, 1), maximum=SIZE_MAX)
        product = degrees.get("dp", 1) * degrees.get("tp", 1) * degrees.get("pp", 1)
        if table["world_size"] != product:
            raise ConfigError("parallel.world_size", f"{table['world_size']} is not dp x tp x pp = {product}")
    return out


def check_degrees(cfg) -> dict:
    """The parallel degrees of a RunConfig checked against each other and its model (one ConfigError naming the
    field); returns the parsed values to set on it (the schedule, the engine, the stage it implies)."""
    from batchlab.config.choices import ConfigError, ModelSource
    from batchlab.config.engines import PYTORCH_ENGINE, engine
    from batchlab.config.values import SIZE_MAX, flag, whole_number

    for name in ("tp", "pp", "pp_virtual"):
        whole_number(name, getattr(cfg, name), maximum=SIZE_MAX)
    out: dict = {"pp_schedule": PipelineSchedule.parse("pp_schedule", cfg.pp_schedule),
                 "tp_overlap": TPOverlap.parse("tp_overlap", cfg.tp_overlap)}
    flag("sequence_parallel", cfg.sequence_parallel)
    if cfg.sharding is not None:
        chosen = engine(cfg.sharding)
        stage = ENGINES[chosen].stage
        if cfg.zero not in (0, stage):
            raise ConfigError("sharding", f"{chosen} is ZeRO-{stage}, but zero {cfg.zero} was given")
        # one spelling per config: PyTorch's engine for a stage is the stage itself
        out.update(zero=stage, sharding=None if PYTORCH_ENGINE[stage] is chosen else chosen)
    if cfg.sequence_parallel and cfg.tp == 1:
        raise ConfigError("sequence_parallel", "splits the sequence across tensor-parallel ranks: it needs --tp > 1")
    out["tp_overlap"].check(cfg.sequence_parallel)
    if cfg.pp == 1 and cfg.pp_virtual > 1:
        raise ConfigError("pp_virtual", "virtual stages are chunks of a pipeline: they need --pp > 1")
    if (cfg.tp > 1 or cfg.pp > 1) and cfg.model_kind is ModelSource.FACTORY:
        raise ConfigError("tp" if cfg.tp > 1 else "pp", "a factory's model has no layer structure batchlab can split: "
                                                        "tensor and pipeline parallelism take a preset or hf: model")
    m = cfg.model
    for name, value in (("heads", m.heads), ("kv_heads", m.kv_heads), ("ffn", m.ffn)):
        if value % cfg.tp:
            raise ConfigError("tp", f"{cfg.tp} does not divide the model's {name} ({value}): each tensor-parallel "
                                    "rank takes an equal share")
    if m.layers % (cfg.pp * cfg.pp_virtual):
        raise ConfigError("pp", f"{m.layers} layers do not split into pp x pp_virtual = {cfg.pp} x {cfg.pp_virtual} "
                                "equal stages")
    if cfg.pp > 1:
        SCHEDULES[out["pp_schedule"]].check(cfg.pp, cfg.accum, cfg.pp_virtual)
    return out
