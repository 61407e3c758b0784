"""The run configuration: RunConfig (frozen, validated) with its activation-checkpointing policy and the
calculator's assumptions.  Declarations and validation only; parsing user text lives in load.py.

Pure Python: importing this module never imports torch.  Sizes are bytes, times seconds.
"""
from __future__ import annotations

import dataclasses
import enum
import re
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

from batchlab.config import layerplan
from batchlab.config.assumptions import Assumptions
from batchlab.config.acpolicies import ACMode, ACPolicySpec, Applied, no_recompute, whole_block
from batchlab.config.choices import (AttentionImpl, CompileMode, ConfigError, Counted, DataKind, Implementation,
                                     ModelSource, Precision)
from batchlab.config.optimizers import OptimizerKind
from batchlab.config.devices import DeviceSpec, device
from batchlab.config.fp8 import FP8Recipe, check as fp8_check
from batchlab.config.memtech import check as memtech_check
from batchlab.config.engines import PYTORCH_ENGINE, Engine, PipelineSchedule, TPOverlap
from batchlab.config.deepspeed import DeepSpeedSettings
from batchlab.config.losspolicy import LossPolicy
from batchlab.config.parallel import Layout, check_degrees
from batchlab.config.model import ModelSpec, default_ffn, preset
from batchlab.config.values import SEED_MAX, SIZE_MAX, parse_bytes, whole_number


@dataclass(frozen=True)
class ACPolicy:
    """Activation checkpointing: recompute inside one step to save memory.

    Not the training checkpoint (the file saved to disk for recovery).  Spellings: one per-layer policy of the
    catalogue (config/acpolicies.py: none, full, selective, ...) for every layer, ``every:K`` (full on every K-th
    layer, counting from the first; torchtitan's "selective layer", also ``selective-layer:K``) or ``plan:...``
    (a catalogue policy per layer: config/layerplan.py)."""

    mode: ACMode = ACMode.NONE
    every: int = 1
    layers: tuple[ACMode, ...] = ()  # a plan's policy of each layer (mode PLAN only)
    budget: float | None = None  # budget:F: torch.compile's activation_memory_budget (mode BUDGET only)

    def __post_init__(self):
        object.__setattr__(self, "mode", ACMode.parse("ac", self.mode))
        object.__setattr__(self, "layers", tuple(
            p if isinstance(p, ACMode) and p in layerplan.LAYER_POLICIES else layerplan.layer_policy(p, "plan")
            for p in self.layers))
        if (self.mode is ACMode.PLAN) != bool(self.layers):
            raise ConfigError("ac", "a plan needs its layers' policies (plan:POLICY*N,... or plan:FILE), and only "
                                    "a plan takes them")
        if self.every < 1:
            raise ConfigError("ac", f"every:K needs K >= 1, got {self.every}")
        if self.mode is not ACMode.EVERY and self.every != 1:
            raise ConfigError("ac", "K is only meaningful for every:K")
        if (self.mode is ACMode.BUDGET) != (self.budget is not None):
            raise ConfigError("ac", "budget needs a fraction (budget:F, e.g. budget:0.5), and only budget takes one")
        if self.budget is not None and not (isinstance(self.budget, (int, float)) and 0 <= self.budget <= 1):
            raise ConfigError("ac", f"budget:F needs 0 <= F <= 1 (0: recompute from the inputs), got {self.budget!r}")

    @classmethod
    def parse(cls, value: Any) -> "ACPolicy":
        if isinstance(value, ACPolicy):
            return value
        text = str(value).strip().lower()
        text = layerplan.ALIASES.get(text, text)
        if text.startswith("plan:"):
            return cls(ACMode.PLAN, layers=layerplan.parse(text[len("plan:"):], str(value)))
        m = re.fullmatch(r"(?:every|selective-layer):(\d+)", text)
        if m:
            return cls(ACMode.EVERY, int(m.group(1)))
        if text == "every":
            raise ConfigError("ac", "every needs a K: every:K, e.g. every:2")
        if text.startswith("budget:"):
            fraction = re.fullmatch(r"budget:(\d+(?:\.\d*)?|\.\d+)", text)
            return cls(ACMode.BUDGET, budget=float(fraction.group(1)) if fraction else text[len("budget:"):])
        try:
            mode = ACMode(text)
        except ValueError:
            mode = None
        if mode is None or mode is ACMode.PLAN:
            names = ", ".join(m.value for m in layerplan.LAYER_POLICIES if m is not ACMode.NONE)
            raise ConfigError("ac", f"{value!r} is not one of: none, every:K, {names}, plan:POLICY*N,..., "
                                    "plan:FILE or budget:F")
        return cls(mode)

    def __str__(self) -> str:
        if self.mode in (ACMode.PLAN, ACMode.BUDGET):
            return f"plan:{layerplan.compact(self.layers)}" if self.layers else f"budget:{self.budget:g}"
        return f"every:{self.every}" if self.mode is ACMode.EVERY else self.mode.value

    @classmethod
    def of_layers(cls, modes) -> "ACPolicy":
        """A per-layer plan: one policy per layer, first layer first."""
        return cls(ACMode.PLAN, layers=tuple(modes))

    @classmethod
    def every_kth(cls, k: int) -> "ACPolicy":
        """every:K: the whole block recomputed on layers 0, K, 2K, ..."""
        return cls(ACMode.EVERY, k)

    @property
    def recomputes(self) -> bool:  # some layer is checkpointed (budget:F's recompute is the partitioner's own)
        return self.mode not in (ACMode.NONE, ACMode.BUDGET)

    @property
    def every_k(self) -> int | None:  # K of every:K, else None
        return self.every if self.mode is ACMode.EVERY else None

    @property
    def single(self) -> "ACPolicySpec | None":  # the entry every layer runs when spelt as one (not every:K, a plan)
        return None if self.mode in (ACMode.EVERY, ACMode.PLAN) else self.layer_modes(1)[0].spec

    def simplified(self) -> "ACPolicy":
        """A plan giving every layer one policy, as that policy (other stacks' settings can express it)."""
        if self.mode is ACMode.PLAN and len(set(self.layers)) == 1:
            return ACPolicy(self.layers[0])
        return self

    def layer_modes(self, n_layers: int) -> tuple[ACMode, ...]:
        """Each layer's policy: NONE, FULL or a selective mode (the one place this is decided)."""
        if self.mode is ACMode.PLAN:
            return self.layers
        if self.mode is ACMode.EVERY:
            full, none = whole_block(), no_recompute()
            return tuple(full if i % self.every == 0 else none for i in range(n_layers))
        return (no_recompute() if self.mode is ACMode.BUDGET else self.mode,) * n_layers  # budget:F wraps none

    def wrapped_layers(self, n_layers: int) -> tuple[int, ...]:
        """Indices of the layers whose whole block is recomputed in backward."""
        return tuple(i for i, m in enumerate(self.layer_modes(n_layers)) if m.spec.applied is Applied.WHOLE_BLOCK)

    def selective_layers(self, n_layers: int) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.layer_modes(n_layers)) if m.spec.selective)

    def selective_kinds(self, n_layers: int) -> dict[ACMode, int]:
        """{selective mode: layers under it}, in the order the layers first use them."""
        return dict(Counter(m for m in self.layer_modes(n_layers) if m.spec.selective))


# Fields users may name in --change / --vary / replace(); model fields route into ModelSpec.
MODEL_FIELDS = tuple(f.name for f in fields(ModelSpec) if f.name not in ("name", "profile", "family"))


@dataclass(frozen=True)
class RunConfig:
    """Everything that decides a training step's memory and time.  Frozen and validated.

    ``global_batch`` (sequences per optimizer update) = micro_batch x accum x dp, derived, never stored.
    """

    model: ModelSpec = field(default_factory=lambda: preset("tiny"))  # the architecture (preset(...) builds one)
    # which code trains it: "builtin", "hf:<gpt2|path/config.json>", or "package.module:factory"
    model_source: str = "builtin"
    seq: int = 128  # tokens per sequence
    micro_batch: int = 8  # sequences in one forward/backward on one rank
    accum: int = 1  # micro-batches whose gradients are summed before one optimizer step
    dp: int = 1  # data-parallel ranks (world size)
    precision: Precision = Precision.FP32  # fp32, bf16-mixed, fp16-mixed, bf16 or bf16-fsdp
    optimizer: OptimizerKind = OptimizerKind.ADAMW  # an entry of config/optimizers.py
    ac: ACPolicy = field(default_factory=ACPolicy)  # activation checkpointing (a string such as "full" is parsed)
    loss: LossPolicy = field(default_factory=LossPolicy)  # the loss path (a string such as "chunked:8" is parsed)
    zero: int = 0  # ZeRO stage over the dp ranks (1: optimizer, 2: +grads, 3: +params; FSDP ~ 3)
    # the data-parallel engine (config/engines.py); None: PyTorch's for the stage (ddp, zero1, fsdp-grad-op, fsdp)
    sharding: Engine | None = None
    tp: int = 1  # tensor-parallel degree (Megatron's column / row split of attention and MLP)
    sequence_parallel: bool = False  # with tp: norms and dropouts split along the sequence (Korthikanti 2022)
    tp_overlap: TPOverlap = TPOverlap.NONE  # with sp: collectives overlapped with their GEMMs (AsyncTP, userbuffers)
    pp: int = 1  # pipeline-parallel stages
    pp_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B  # gpipe, 1f1b or interleaved-1f1b
    pp_virtual: int = 1  # model chunks per pipeline rank (interleaved-1f1b)
    device: str = "cpu"  # a catalogue card (h100-sxm, ...), local, cpu or custom:mem=...,tflops=...
    memory_budget: int | None = None  # bytes; replaces the device's memory (CPU: a tracked-bytes budget)
    data: DataKind = DataKind.FIXED  # fixed (full-length sequences) or padded (padding is not useful work)
    seed: int = 0  # the seed of the measured runs' weights and data
    compile: CompileMode = CompileMode.NONE  # torch.compile: none, the whole model, or each block (after AC)
    fp8: FP8Recipe = FP8Recipe.NONE  # the blocks' linear layers as FP8 GEMMs (config/fp8.py; formula only)
    optimizer_in_backward: bool = False  # each parameter steps in its post-accumulate-grad hook (config/memtech.py)
    offload_activations: bool = False  # saved activations to host memory in forward, back in backward (GPU only)
    # a DeepSpeed engine's zero_optimization sizes (config/deepspeed.py; a string such as "hf-auto" is parsed)
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)
    assumptions: Assumptions = field(default_factory=Assumptions)  # the time model's and allocator's assumptions

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "precision", Precision.parse("precision", self.precision))
        set_(self, "optimizer", OptimizerKind.parse("optimizer", self.optimizer))
        set_(self, "ac", ACPolicy.parse(self.ac))
        set_(self, "loss", LossPolicy.parse(self.loss))
        set_(self, "deepspeed", DeepSpeedSettings.parse(self.deepspeed))
        set_(self, "data", DataKind.parse("data", self.data))
        set_(self, "compile", CompileMode.parse("compile", self.compile))
        set_(self, "fp8", FP8Recipe.parse("fp8", self.fp8))
        for name in ("seq", "micro_batch", "accum", "dp"):
            whole_number(name, getattr(self, name), maximum=SIZE_MAX)
        if not isinstance(self.model_source, str) or not self.model_source:
            raise ConfigError("model_source", "must be builtin, hf:NAME_OR_CONFIG or package.module:factory")
        whole_number("zero", self.zero, allow_zero=True)
        whole_number("seed", self.seed, allow_zero=True, maximum=SEED_MAX)
        self._check_layout()
        if not isinstance(self.device, str):
            raise ConfigError("device", f"must be a device name, got {self.device!r}")
        if self.zero > 3:
            raise ConfigError("zero", f"must be 0, 1, 2 or 3, got {self.zero}")
        if self.seq > self.model.max_positions and self.model_kind is not ModelSource.FACTORY:
            # a factory's model shape is a stand-in (models/factory.py): its sequence limits are the model's own
            raise ConfigError("seq", f"{self.seq} is beyond the model's max_positions ({self.model.max_positions})")
        if self.model_kind is ModelSource.HF and self.model.impl is not Implementation.HF:
            if self.model.impl is not Implementation.BATCHLAB:  # the default of a ModelSpec written by hand
                raise ConfigError("impl", f"{self.model_source} runs transformers' code: --impl hf (a preset "
                                          f"without hf: takes --impl {self.model.impl})")
            set_(self, "model", dataclasses.replace(self.model, impl=Implementation.HF))
        if (self.ac.mode is ACMode.PLAN and len(self.ac.layers) != self.model.layers
                and self.model_kind is not ModelSource.FACTORY):  # a factory's blocks: models/ac.py checks
            raise ConfigError("ac", f"the plan names {len(self.ac.layers)} layers; the model has {self.model.layers}")
        sdpa_only = sorted({m.value for m in self.ac.layer_modes(self.model.layers) if m.spec.needs_sdpa})
        # Megatron's layer wraps its unfused attention core in one module too (CoreAttention): it recomputes that
        if sdpa_only and self.model.attention is not AttentionImpl.SDPA and self.model.impl is not Implementation.MEGATRON:
            raise ConfigError("ac", f"{sdpa_only[0]} recomputes the fused attention call: it needs "
                                    "--attention sdpa (eager attention has no single attention-core call)")
        if self.ac.mode is ACMode.BUDGET and self.compile is CompileMode.NONE:
            raise ConfigError("ac", f"ac={self.ac} needs --compile model|blocks: the knob is read by torch.compile's "
                                    "partitioner")
        if self.ac.mode is ACMode.EVERY and self.ac.every > self.model.layers:
            raise ConfigError("ac", f"every:{self.ac.every} asks for K > layers ({self.model.layers})")
        spec = device(self.device)  # raises on an unknown device
        set_(self, "device", spec.name)
        fp8_check(self)
        memtech_check(self)
        if self.deepspeed != DeepSpeedSettings() and not self.parallel.engine_spec.deepspeed:
            raise ConfigError("deepspeed", "sets DeepSpeed's zero_optimization sizes: it needs --sharding "
                                           "deepspeed-zero1|deepspeed-zero2|deepspeed-zero3")
        if self.memory_budget is not None:
            set_(self, "memory_budget", parse_bytes("memory_budget", self.memory_budget))
            whole_number("memory_budget", self.memory_budget)

    def _check_layout(self) -> None:
        for name, value in check_degrees(self).items():  # the parsed values (enums, the engine)
            object.__setattr__(self, name, value)

    # -- derived
    @property
    def parallel(self) -> Layout:
        """The parallel layout: degrees, engine, schedule and the facts every reader asks (config/parallel.py)."""
        return Layout(dp=self.dp, engine=self.sharding or PYTORCH_ENGINE[self.zero], tp=self.tp,
                      sequence_parallel=self.sequence_parallel, tp_overlap=self.tp_overlap, pp=self.pp,
                      schedule=self.pp_schedule, virtual=self.pp_virtual)

    @property
    def vocab_parallel(self) -> bool:
        """Tensor parallelism splits the token embedding, the LM head and the loss over the vocabulary (Megatron's
        VocabParallelEmbedding and vocab-parallel cross entropy; torchtitan's loss_parallel): where tp divides
        the vocabulary, or always with Megatron's layer, which pads the vocabulary to a multiple of 128·t
        (megatron/training/tokenizer/tokenizer.py, ``_vocab_size_with_padding``).  Else they stay whole on every
        tensor-parallel rank, the logits and the loss too."""
        return self.tp > 1 and (self.model.vocab % self.tp == 0 or self.model.impl is Implementation.MEGATRON)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accum * self.dp

    @property
    def tokens_per_update(self) -> int:
        return self.global_batch * self.seq

    @property
    def kv_cache(self) -> bool:
        """Whether the training forward builds transformers' KV cache: the model config's use_cache, off when a layer
        is recomputed, as transformers turns it off (with a warning) under gradient checkpointing: a cache written
        in the recompute would be written twice."""
        return self.model.kv_cache and not self.ac.simplified().recomputes

    @property
    def model_kind(self) -> ModelSource:
        return ModelSource.of(self.model_source)

    @property
    def device_spec(self) -> DeviceSpec:
        return device(self.device)

    @property
    def memory_capacity(self) -> int:
        """Bytes available to one rank: the budget if given, else the device's memory."""
        return self.memory_budget if self.memory_budget is not None else self.device_spec.memory_bytes

    def global_batch_text(self, counted: Counted = Counted.TOKENS) -> str:
        """The global-batch line; with tensor or pipeline ranks, the layout too (they do not multiply it)."""
        layout = self.parallel
        return (f"global batch = micro-batch x accum x DP = {self.micro_batch} x {self.accum} x {self.dp} "
                f"= {counted.update_text(self.global_batch, self.tokens_per_update)}"
                + (f"; {layout.text()}" if layout.tp > 1 or layout.pp > 1 else ""))

    # -- changing
    def replace(self, **changes: Any) -> "RunConfig":
        """A validated new config; model field names (layers, hidden, ...) route into the model spec."""
        model_changes = {k: changes.pop(k) for k in list(changes) if k in MODEL_FIELDS}
        unknown = [k for k in changes if k not in RUN_FIELDS and k not in ASSUMPTION_FIELDS]
        if unknown:
            raise ConfigError(unknown[0], f"unknown field; known: {', '.join(CHANGEABLE_FIELDS)}")
        assumption_changes = {k: changes.pop(k) for k in list(changes) if k in ASSUMPTION_FIELDS}
        if model_changes:
            changes["model"] = dataclasses.replace(self.model, **_derived_follow(self.model, model_changes))
        if assumption_changes:
            changes["assumptions"] = dataclasses.replace(self.assumptions, **assumption_changes)
        return dataclasses.replace(self, **changes)

    def with_global_batch(self, global_batch: int, micro_batch: int | None = None) -> "RunConfig":
        """Re-derive accum so that micro x accum x dp == global_batch (the micro-batch kept unless given)."""
        mb = self.micro_batch if micro_batch is None else micro_batch
        return self.replace(micro_batch=mb, accum=derive_accum(global_batch, mb, self.dp))

    def diff(self, other: "RunConfig") -> dict[str, tuple[Any, Any]]:
        """Changed user-facing fields, model fields by their own names: {field: (self's, other's)}."""
        own = tuple(n for n in RUN_FIELDS if n not in ("model", "assumptions"))
        out: dict[str, tuple[Any, Any]] = {}
        for x, y, names in ((self.model, other.model, MODEL_FIELDS),
                            (self.assumptions, other.assumptions, ASSUMPTION_FIELDS), (self, other, own)):
            out.update({n: (getattr(x, n), getattr(y, n)) for n in names if getattr(x, n) != getattr(y, n)})
        return out

    def to_dict(self) -> dict[str, Any]:
        return to_jsonable(self)


RUN_FIELDS = tuple(f.name for f in fields(RunConfig))
ASSUMPTION_FIELDS = tuple(f.name for f in fields(Assumptions))
def _derived_follow(m: ModelSpec, changes: dict[str, Any]) -> dict[str, Any]:
    """``changes`` plus the fields ModelSpec derives from them where ``m`` kept the derived default: kv_heads
    follows heads in a multi-head model, ffn follows hidden (and the MLP kind) where it was the default width;
    a value set apart from the default, or given alongside, stays."""
    out = dict(changes)
    if "heads" in out and "kv_heads" not in out and m.kv_heads == m.heads:
        out["kv_heads"] = None
    if ("hidden" in out or "mlp" in out) and "ffn" not in out and m.ffn == default_ffn(m.hidden, m.mlp):
        out["ffn"] = None
    return out


CHANGEABLE_FIELDS = (tuple(n for n in RUN_FIELDS if n not in ("model", "assumptions")) + MODEL_FIELDS
                     + ASSUMPTION_FIELDS)


def derive_accum(global_batch: int, micro_batch: int, dp: int) -> int:
    whole_number("global_batch", global_batch)
    whole_number("micro_batch", micro_batch)
    whole_number("dp", dp)
    per_step = micro_batch * dp
    if global_batch % per_step:
        raise ConfigError("global_batch", f"{global_batch} is not divisible by micro-batch x DP = "
                                          f"{micro_batch} x {dp} = {per_step}")
    return global_batch // per_step


def to_jsonable(obj: Any) -> Any:
    """Dataclasses/enums/policies to plain JSON values (the one serialiser for --json and the notebook)."""
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Layout):
        return obj.to_dict()
    if isinstance(obj, (ACPolicy, LossPolicy, DeepSpeedSettings)):
        return str(obj)
    if isinstance(obj, RunConfig):  # its fields, and the layout they make (derived: config_from_dict drops it)
        return {**{f.name: to_jsonable(getattr(obj, f.name)) for f in fields(obj)}, "parallel": obj.parallel.to_dict()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:  # NaN is not JSON
        return None
    return obj
