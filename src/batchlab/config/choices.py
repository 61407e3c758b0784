"""The closed sets users choose from (enums whose values are the spellings they type) and ConfigError
(defined in util/errors.py, below every package that raises it).

Pure Python, no torch.
"""
from __future__ import annotations

import enum
from typing import Any

from batchlab.util.errors import ConfigError


class Choice(str, enum.Enum):
    """A closed set whose values are the spellings users type (every enum a user chooses from, Phase too);
    ``parse(field, value)`` turns what they typed into a member or one ConfigError naming the allowed values."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, field_name: str, value: Any):
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ConfigError(field_name, f"{value!r} is not one of: {allowed}") from None


class Precision(Choice):
    FP32 = "fp32"
    BF16_MIXED = "bf16-mixed"  # bf16 compute, fp32 master weights
    FP16_MIXED = "fp16-mixed"  # fp16 compute, fp32 master weights, dynamic loss scaling
    BF16 = "bf16"  # pure bf16: weights, grads and optimizer state in bf16
    # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) (torchtitan's setting): every op computes
    # in bf16 (residual stream, norm inputs and saved activations bf16, no autocast cast cache); the fp32
    # parameters are the sharded master copy, Adam state fp32 sharded, gradients reduced and kept in fp32
    BF16_FSDP = "bf16-fsdp"

    @property
    def compute_bytes(self) -> int:
        """Bytes of one activation element."""
        return 4 if self is Precision.FP32 else 2

    @property
    def mixed(self) -> bool:
        return self in (Precision.BF16_MIXED, Precision.FP16_MIXED)

    @property
    def low_precision_residual(self) -> bool:
        """The residual stream and norm inputs are 16-bit (no autocast keeping them fp32)."""
        return self in (Precision.BF16, Precision.BF16_FSDP)


class MLPKind(Choice):
    GELU = "gelu"  # 2 matrices h->ffn->h (GPT-2, Megatron)
    SWIGLU = "swiglu"  # 3 matrices: gate, up, down (Llama)


class NormKind(Choice):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class AttentionImpl(Choice):
    EAGER = "eager"  # s x s scores materialised (softmax, dropout mask kept for backward)
    SDPA = "sdpa"  # fused scaled_dot_product_attention: no s^2 term kept


class PositionKind(Choice):
    LEARNED = "learned"  # GPT-2 position embedding table
    ROPE = "rope"  # rotary (Llama): no parameters
    ALIBI = "alibi"  # attention biases (BLOOM, Falcon-RW): no parameters


class LossMode(Choice):
    """How the LM loss is computed over the vocabulary (formula/loss.py counts what each keeps)."""

    FULL = "full"  # F.cross_entropy(logits.float()) on all tokens at once: fp32 copy and log-softmax kept
    CHUNKED = "chunked"  # over N token chunks, each checkpointed: one chunk's fp32 logits live at a time
    FUSED = "fused"  # a fused cross-entropy kernel (flash-attn): 16-bit logits and log-sum-exp, no fp32 copies
    # the LM head's matmul fused with the loss (Liger's LigerFusedLinearCrossEntropy): logits only a chunk at a time
    FUSED_LINEAR = "fused-linear"
    # torch.compile'd F.cross_entropy(logits.float()): the min-cut partitioner keeps the 16-bit logits and two
    # per-row fp32 statistics, and backward writes the 16-bit gradient in one fused kernel
    COMPILED = "compiled"
    # no LM head: a pooled sequence classifier (Hugging Face *ForSequenceClassification): b x labels logits
    CLASSIFIER = "classifier"


class CompileMode(Choice):
    """What ``torch.compile`` wraps in a measured or traced run (``--compile``)."""

    NONE = "none"  # eager PyTorch
    MODEL = "model"  # the whole model, one compiled module (torchtune, OLMo-core)
    BLOCKS = "blocks"  # each transformer block on its own, after AC wrapping (torchtitan)


class Backend(Choice):
    CPU = "cpu"
    CUDA = "cuda"  # NVIDIA, and AMD through ROCm's torch.cuda
    MPS = "mps"


class DataKind(Choice):
    FIXED = "fixed"  # every sequence full length
    PADDED = "padded"  # variable lengths padded to seq; only non-padding tokens are useful


class Keep(Choice):
    """What a one-variable change holds fixed besides everything else."""

    GLOBAL_BATCH = "global-batch"  # accum re-derived when micro_batch or dp changes
    ACCUM = "accum"  # accum fixed: the global batch (and so the training run) changes


class Counted(Choice):
    """What one training example is, and so what throughput counts: a language model's useful tokens, or
    samples (an image and its class) for a model whose targets are one per example (models/factory.py)."""

    TOKENS = "tokens"
    SAMPLES = "samples"

    @property
    def per_second(self) -> str:
        return f"{self.value}/s"

    def update_text(self, global_batch: int, tokens_per_update: int) -> str:
        """The end of the global-batch line: what one update holds."""
        if self is Counted.SAMPLES:
            return f"{global_batch} samples per update"
        return f"{global_batch} sequences ({tokens_per_update:,} tokens per update)"


class Implementation(Choice):
    """Whose code a preset's layer terms describe (``--impl``): the tensors a block keeps differ between
    implementations of the same shape (fused or split q/k/v, RoPE's dtype, the norm's kernel, GELU in Python ops)."""

    HF = "hf"  # transformers' LlamaForCausalLM / GPT2LMHeadModel
    TORCHTITAN = "torchtitan"  # torchtitan's Llama (torchtitan/models/llama3/model.py)
    NANOGPT = "nanogpt"  # Karpathy's nanoGPT model.py (GPT-2 shapes)
    BATCHLAB = "batchlab"  # batchlab's own GPT (models/gpt.py)
    MEGATRON = "megatron"  # Megatron-LM / Megatron-Core's GPT layer (Korthikanti et al. 2022, sec. 4.1)

    @property
    def label(self) -> str:
        return {"hf": "transformers' code", "torchtitan": "torchtitan's Llama", "nanogpt": "nanoGPT's model.py",
                "batchlab": "batchlab's GPT", "megatron": "Megatron-LM's GPT"}[self.value]


class ModelSource(Choice):
    """Which code trains the model, from ``RunConfig.model_source``'s spelling."""

    BUILTIN = "builtin"  # batchlab's own GPT (models.gpt), built from the ModelSpec
    HF = "hf"  # hf:FAMILY or hf:path/config.json: transformers' code with the ModelSpec's shape
    FACTORY = "factory"  # package.module:factory: user code the calculator cannot see inside

    @classmethod
    def of(cls, source: str) -> "ModelSource":
        if source == "builtin":
            return cls.BUILTIN
        # anything else goes to the factory loader, which names the error (models/factory.py)
        return cls.HF if source.startswith("hf:") else cls.FACTORY
