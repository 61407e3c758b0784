"""The model's shape (ModelSpec) and the published presets.  Pure Python."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from batchlab.config.choices import AttentionImpl, ConfigError, Implementation, MLPKind, NormKind, PositionKind
from batchlab.config.profile import LayerProfile
from batchlab.config.values import SIZE_MAX, flag, whole_number


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer shape: the calculator's model and the built-in GPT's constructor input."""

    name: str = "custom"
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int | None = None  # None: same as heads (multi-head attention)
    ffn: int | None = None  # None: 4h for GELU, Llama's rounded 8h/3 for SwiGLU
    mlp: MLPKind = MLPKind.GELU
    vocab: int = 512
    tied_embeddings: bool = True
    norm: NormKind = NormKind.LAYERNORM
    dropout: float = 0.0
    attention: AttentionImpl = AttentionImpl.EAGER
    position: PositionKind = PositionKind.LEARNED
    max_positions: int = 1024
    bias: bool = True  # biases on linear layers and norms (GPT-2 yes, Llama no)
    qkv_bias: bool | None = None  # biases on q, k, v only (Qwen2); None: as ``bias``
    family: str = ""  # the Hugging Face model_type it was read from ("": batchlab's own GPT shape)
    sliding_window: int | None = None  # attention window (Mistral): at seq >= window the code path changes
    impl: Implementation = Implementation.BATCHLAB  # whose code the built-in layer terms count (--impl)
    # transformers' use_cache: its training forward builds a DynamicCache (None: the config's default, on; only
    # transformers' code has one)
    use_cache: bool | None = None
    # the model's own code, traced and fitted (trace/profile.py); None: the calculator's built-in terms
    profile: LayerProfile | None = None

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "mlp", MLPKind.parse("mlp", self.mlp))
        set_(self, "norm", NormKind.parse("norm", self.norm))
        set_(self, "attention", AttentionImpl.parse("attention", self.attention))
        set_(self, "position", PositionKind.parse("position", self.position))
        set_(self, "impl", Implementation.parse("impl", self.impl))
        _check_impl(self.impl, self.mlp)
        for name in ("layers", "hidden", "heads", "vocab", "max_positions"):
            whole_number(name, getattr(self, name), maximum=SIZE_MAX)
        if self.kv_heads is None:
            set_(self, "kv_heads", self.heads)
        whole_number("kv_heads", self.kv_heads, maximum=SIZE_MAX)
        if self.hidden % self.heads:
            raise ConfigError("heads", f"must divide hidden ({self.hidden}), got {self.heads}")
        if self.heads % self.kv_heads:
            raise ConfigError("kv_heads", f"must divide heads ({self.heads}), got {self.kv_heads}")
        if self.ffn is None:
            set_(self, "ffn", default_ffn(self.hidden, self.mlp))
        whole_number("ffn", self.ffn, maximum=SIZE_MAX)
        if self.qkv_bias is None:
            set_(self, "qkv_bias", self.bias)
        if self.profile is not None:
            set_(self, "profile", LayerProfile.from_dict(self.profile))
        for name in ("tied_embeddings", "bias", "qkv_bias"):
            flag(name, getattr(self, name))
        if self.use_cache is not None:
            flag("use_cache", self.use_cache)
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout!r}")
        set_(self, "dropout", float(self.dropout))

    @property
    def kv_cache(self) -> bool:
        """Whether the model's code builds a KV cache in its forward: transformers' code with use_cache on."""
        return self.impl is Implementation.HF and self.use_cache is not False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_hidden(self) -> int:
        return self.kv_heads * self.head_dim

    def shape_id(self) -> str:
        """Every field a layer profile depends on (not the layer count, which it is a function of)."""
        skip = ("name", "layers", "max_positions", "profile")
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if f.name not in skip)

    def with_profile(self, profile: LayerProfile | None) -> "ModelSpec":
        return replace(self, profile=profile)

    @property
    def matching_profile(self) -> LayerProfile | None:
        """The profile if it was made for this shape (a --vary hidden=... makes it stale), else None."""
        p = self.profile
        return p if p is not None and p.shape == self.shape_id() else None


def _check_impl(impl: Implementation, mlp: MLPKind) -> None:
    """torchtitan's Llama has a SwiGLU MLP; nanoGPT's GPT a GELU one."""
    if impl is Implementation.TORCHTITAN and mlp is not MLPKind.SWIGLU:
        raise ConfigError("impl", "torchtitan is torchtitan's Llama (SwiGLU MLP); this shape has a GELU MLP: "
                                  "use hf, nanogpt or batchlab")
    if impl is Implementation.NANOGPT and mlp is not MLPKind.GELU:
        raise ConfigError("impl", "nanogpt is nanoGPT's GPT-2 (GELU MLP); this shape has a SwiGLU MLP: "
                                  "use hf, torchtitan or batchlab")


def default_ffn(hidden: int, mlp: MLPKind) -> int:
    if mlp is MLPKind.GELU:
        return 4 * hidden
    # Llama: 2/3 of 4h, rounded up to a multiple of 256 (Touvron et al. 2023, model code)
    return 256 * ((int(2 * 4 * hidden / 3) + 255) // 256)


# The published families' presets count transformers' code (GPT2LMHeadModel, LlamaForCausalLM) unless --impl
# names another implementation: the classes most people fine-tune these shapes with.
GPT2_FAMILY = dict(mlp="gelu", norm="layernorm", position="learned", bias=True, tied_embeddings=True,
                   vocab=50257, max_positions=1024, dropout=0.0, attention="sdpa", impl="hf")
LLAMA_FAMILY = dict(mlp="swiglu", norm="rmsnorm", position="rope", bias=False, tied_embeddings=False,
                    dropout=0.0, attention="sdpa", impl="hf")

# Shapes from the papers / released configs.  "tiny" and "small" are batchlab's own built-in models.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(layers=4, hidden=128, heads=4, vocab=512, max_positions=256, dropout=0.1,
                 attention="eager", mlp="gelu", norm="layernorm", position="learned", bias=True,
                 tied_embeddings=True),
    "small": dict(layers=6, hidden=384, heads=6, vocab=4096, max_positions=512, dropout=0.1,
                  attention="eager", mlp="gelu", norm="layernorm", position="learned", bias=True,
                  tied_embeddings=True),
    "gpt2": dict(GPT2_FAMILY, layers=12, hidden=768, heads=12),
    "gpt2-medium": dict(GPT2_FAMILY, layers=24, hidden=1024, heads=16),
    "gpt2-large": dict(GPT2_FAMILY, layers=36, hidden=1280, heads=20),
    "gpt2-xl": dict(GPT2_FAMILY, layers=48, hidden=1600, heads=25),
    "llama-2-7b": dict(LLAMA_FAMILY, layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000, max_positions=4096),
    "llama-2-13b": dict(LLAMA_FAMILY, layers=40, hidden=5120, heads=40, ffn=13824, vocab=32000, max_positions=4096),
    "llama-2-70b": dict(LLAMA_FAMILY, layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000,
                        max_positions=4096),
    "llama-3-8b": dict(LLAMA_FAMILY, layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                       max_positions=8192),
    "llama-3-70b": dict(LLAMA_FAMILY, layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256,
                        max_positions=8192),
    # Megatron / Korthikanti et al. 2022 Table 3: 96 layers, h 12288, 96 heads, s 2048
    "gpt3-175b": dict(GPT2_FAMILY, layers=96, hidden=12288, heads=96, vocab=51200, max_positions=2048,
                      tied_embeddings=True, impl="batchlab"),
}


OWN_MODELS = ("tiny", "small")  # batchlab's own test models: no other code trains them


def trained_with(spec: ModelSpec) -> tuple[Implementation, ...]:
    """The implementations a named preset's shape is trained with, each a valid ``--impl`` for it (transformers'
    and torchtitan's Llama for a SwiGLU shape, transformers' GPT-2 and nanoGPT for a GELU one); () for batchlab's
    own models and for shapes that are not presets."""
    if spec.name not in PRESETS or spec.name in OWN_MODELS:
        return ()
    other = Implementation.TORCHTITAN if spec.mlp is MLPKind.SWIGLU else Implementation.NANOGPT
    return (Implementation.HF, other)


def preset(name: str, **overrides: Any) -> ModelSpec:
    key = name.strip().lower()
    if key not in PRESETS:
        raise ConfigError("model", f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    values = dict(PRESETS[key])
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ModelSpec(name=key, **values)
