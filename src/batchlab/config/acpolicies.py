"""The activation-checkpointing policy catalogue: one entry per per-layer policy, owning every fact batchlab knows
about it -- what a layer keeps under it (the formula term it names), what it recomputes (the time model), how
models/ac.py applies it, how the printed script and each framework's settings spell it, and its label in the
planner.  ``ACPolicy`` (config/run.py: none / full / every:K / plan) is what users write; each layer's policy is
an entry here.  Adding a policy is adding an entry (and its tests) -- the pattern of devices.py and engines.py.

Torch-free: the ops a policy saves are aten op names, resolved by models/ac.py; a formula term is named by the
function of formula/checkpointing.py that counts it.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from batchlab.config.choices import Choice


class ACMode(Choice):
    NONE = "none"
    FULL = "full"
    EVERY = "every"  # ACPolicy's every:K (full on layers 0, K, 2K, ...), no entry of its own
    SELECTIVE = "selective"  # every block keeps every matmul output, recomputes the element-wise ops
    # torchtitan's selective op AC (torchtitan/distributed/activation_checkpoint.py @ b5bcd76c: "Save all
    # compute/comm ops, except every second mm/linear"): odd-numbered matmuls and SDPA outputs kept
    SELECTIVE_OP = "selective-op"
    # Megatron-LM recompute_granularity=selective, recompute_modules=[core_attn]: only the attention core
    # (QK^T, softmax, dropout, AV) is recomputed (Korthikanti et al. 2022, sec. 5; 34sbh per layer)
    MEGATRON = "megatron-selective"
    # keep attention outputs: the fused attention kernel's outputs (eager attention: the softmax output) are
    # kept, every matmul and element-wise op is recomputed
    SELECTIVE_ATTN = "selective-attn"
    # keep every attention-side tensor, recompute the MLP: each block's mlp submodule under checkpoint
    SELECTIVE_MLP = "selective-mlp"
    PLAN = "plan"  # ACPolicy's per-layer plan (config/layerplan.py), no entry of its own
    # ACPolicy's budget:F: torch.compile's partitioner chooses the recompute (no checkpoint region, no entry)
    BUDGET = "budget"

    @property
    def spec(self) -> "ACPolicySpec":
        """This per-layer policy's catalogue entry (EVERY and PLAN are ACPolicy's compositions of entries)."""
        try:
            return self.__dict__["_spec"]  # set once below: asked per layer, per op list, per estimate
        except KeyError:
            raise KeyError(self) from None

    @property
    def dispatch_mode(self) -> bool:
        """Its policy runs as torch.utils.checkpoint's selective dispatch mode (models/ac.py), which sees every
        op of a wrapped block in forward and in recompute."""
        return "_spec" in self.__dict__ and self.spec.applied is Applied.SAVE_OPS


class Applied(enum.Enum):
    """How models/ac.py applies a policy to one block."""

    NOTHING = "nothing recomputed"
    WHOLE_BLOCK = "the block under torch.utils.checkpoint"
    SAVE_OPS = "the block under checkpoint with a selective policy over aten ops"
    ATTENTION_CORE = "F.scaled_dot_product_attention under checkpoint inside the block"
    BRANCH = "one submodule of the block (``branch``) under checkpoint"


# the fused attention kernels (CUDA flash / memory-efficient / cuDNN, and the CPU flash kernel)
SDPA_KERNELS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
MATMULS = ("mm", "addmm")  # a linear layer (with or without bias) on a 2-D view
# torchtitan's SAC save list names the FP8 GEMM beside mm (torchtitan/distributed/activation_checkpoint.py,
# _save_list: torch.ops.aten._scaled_mm.default): --fp8's GEMMs are served from the cache alike
CACHED_MATMULS = MATMULS + ("_scaled_mm",)
SOFTMAX = ("_softmax", "_safe_softmax")  # eager attention's, and SDPA's math path (CPU with dropout)


@dataclass(frozen=True)
class ACPolicySpec:
    """One per-layer policy's facts."""

    mode: ACMode
    label: str  # what it keeps, in the planner's and the docs' words
    applied: Applied
    kept: str  # the formula/checkpointing.py function counting what one layer keeps under it
    recompute_flops: str  # the formula/checkpointing.py function: forward FLOPs per token it repeats in backward
    saved_ops: tuple[str, ...] = ()  # SAVE_OPS: aten ops whose outputs it keeps
    alternate_ops: tuple[str, ...] = ()  # SAVE_OPS: ops of which it keeps the 1st, 3rd, ... call of the block
    save_others: bool = False  # SAVE_OPS: every op not named above is kept (else recomputed)
    branch: str = ""  # BRANCH: the block's submodule recomputed ("mlp": models/gpt.py and transformers' blocks)
    cached_in_recompute: tuple[str, ...] = ()  # ops the time model serves from its cache in the recompute
    needs_sdpa: bool = False  # only with attention=sdpa (RunConfig checks; the planner leaves it out otherwise)
    profile_term: str | None = None  # the layer profile's term for it (config/profile.py MODES); None: not profiled
    script_policy: str = ""  # the printed script's policy function (advise/torch_script.py), SAVE_OPS only
    script_context: str = ""  # the printed script's context_fn expression
    torchtitan: tuple[str, str | None] = ("selective", "op")  # torchtitan's (mode, selective_ac_option)
    torchtitan_exact: bool = False  # torchtitan's setting is this policy (else: the nearest, with a note)
    aliases: tuple[str, ...] = ()  # other spellings --ac and plans accept
    in_ladder: bool = False  # one of ``plan``'s AC steps (advise/plan.py: none, every:K, then these, in order)

    @property
    def recomputes(self) -> bool:
        return self.applied is not Applied.NOTHING

    @property
    def selective(self) -> bool:
        """A policy inside every block (neither nothing nor the whole block recomputed)."""
        return self.applied not in (Applied.NOTHING, Applied.WHOLE_BLOCK)

    @property
    def dispatch_mode(self) -> bool:
        return self.applied is Applied.SAVE_OPS


_ATTN = SDPA_KERNELS + SOFTMAX
# the planner's menu, and plans' policies, in this order: least recompute first
AC_POLICIES: dict[ACMode, ACPolicySpec] = {s.mode: s for s in (
    ACPolicySpec(ACMode.NONE, "nothing recomputed", Applied.NOTHING, "", "", profile_term="full",
                 torchtitan=("none", None), torchtitan_exact=True),
    ACPolicySpec(ACMode.SELECTIVE_OP, "torchtitan op: SDPA outputs and matmuls 1, 3, 5, ... kept",
                 Applied.SAVE_OPS, "selective_op_bytes", "selective_op_flops", saved_ops=SDPA_KERNELS,
                 alternate_ops=MATMULS, cached_in_recompute=CACHED_MATMULS, torchtitan_exact=True,
                 aliases=("op", "torchtitan-op"),
                 script_policy='''\
def every_other_matmul(counts):
    def policy(ctx, op, *args, **kwargs):
        if op in SDPA:
            return CheckpointPolicy.MUST_SAVE
        if op not in MATMULS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        key = "recompute" if ctx.is_recompute else "forward"
        counts[key] += 1
        return CheckpointPolicy.MUST_SAVE if counts[key] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
    return policy

''', script_context='lambda: create_selective_checkpoint_contexts(every_other_matmul({"forward": 0, "recompute": 0}))'),
    ACPolicySpec(ACMode.MEGATRON, "Megatron core_attn: the attention core recomputed", Applied.ATTENTION_CORE,
                 "megatron_bytes", "attention_core_flops", cached_in_recompute=CACHED_MATMULS, needs_sdpa=True,
                 aliases=("megatron", "core-attn"),
                 # the printed script's equivalent: a selective policy recomputing the fused kernel only
                 script_policy='''\
def attention_core_only(ctx, op, *args, **kwargs):  # recompute the attention core, keep everything else
    return CheckpointPolicy.PREFER_RECOMPUTE if op in SDPA else CheckpointPolicy.MUST_SAVE

''', script_context="lambda: create_selective_checkpoint_contexts(attention_core_only, allow_cache_entry_mutation=True)"),
    ACPolicySpec(ACMode.SELECTIVE, "every matmul output kept", Applied.SAVE_OPS, "selective_bytes",
                 "attention_core_flops", saved_ops=MATMULS, in_ladder=True, cached_in_recompute=CACHED_MATMULS, profile_term="selective",
                 script_policy='''\
def keep_matmuls(ctx, op, *args, **kwargs):  # keep every linear layer's output, recompute the rest
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE

''', script_context="lambda: create_selective_checkpoint_contexts(keep_matmuls)"),
    ACPolicySpec(ACMode.SELECTIVE_ATTN, "attention outputs kept, every matmul recomputed", Applied.SAVE_OPS,
                 "selective_attn_bytes", "all_matmul_flops", saved_ops=_ATTN,
                 cached_in_recompute=("_scaled_dot_product_flash_attention_for_cpu",) + SOFTMAX,
                 aliases=("keep-attention", "attn"),
                 script_policy='''\
def keep_attention(ctx, op, *args, **kwargs):  # keep the attention kernel's (eager: softmax's) outputs
    keep = op in SDPA or op in (torch.ops.aten._softmax.default, torch.ops.aten._safe_softmax.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

''', script_context="lambda: create_selective_checkpoint_contexts(keep_attention)"),
    ACPolicySpec(ACMode.SELECTIVE_MLP, "attention kept, the MLP recomputed", Applied.BRANCH, "mlp_recomputed_bytes",
                 "mlp_flops", branch="mlp", aliases=("mlp",)),
    ACPolicySpec(ACMode.FULL, "the whole block recomputed", Applied.WHOLE_BLOCK, "block_input_bytes", "",
                 profile_term="checkpointed", torchtitan=("full", None), torchtitan_exact=True, in_ladder=True),
)}


for _mode, _entry in AC_POLICIES.items():
    _mode.__dict__["_spec"] = _entry


@functools.lru_cache(maxsize=None)
def _only(applied: Applied) -> ACMode:
    (mode,) = (m for m, s in AC_POLICIES.items() if s.applied is applied)
    return mode


def no_recompute() -> ACMode:
    """The policy that recomputes nothing: every plan's and the planner's reference."""
    return _only(Applied.NOTHING)


def whole_block() -> ACMode:
    """The policy that recomputes the whole block (``full``; every:K's layers)."""
    return _only(Applied.WHOLE_BLOCK)


def layer_policies() -> tuple[ACMode, ...]:
    """What one layer may do, in the catalogue's order."""
    return tuple(AC_POLICIES)


def aliases() -> dict[str, str]:
    """Every other spelling of a policy -> its name."""
    return {a: s.mode.value for s in AC_POLICIES.values() for a in s.aliases}
