"""Which installed code runs a config here (torch-free): an implementation that is not installed runs as the nearest
one that is, and a preset typed ``--impl hf`` as transformers' class of its family.  The harness builds what
``runnable`` gives (models/__init__.py); compare reads it to tell two sides that would run the same code
(measure/unexpressed.py)."""
from __future__ import annotations

from batchlab.config.choices import Implementation, MLPKind, ModelSource
from batchlab.config.run import RunConfig

# The installed code nearest to each implementation that is not installed here (formula/activations.py's terms):
# transformers' Llama has torchtitan's separate q/k/v and gate/up projections; batchlab's GPT has nanoGPT's fused
# qkv and fused GELU, and Megatron's fused qkv and Korthikanti's layer (with its own Python-op extras).
STAND_IN = {Implementation.TORCHTITAN: Implementation.HF, Implementation.NANOGPT: Implementation.BATCHLAB,
            Implementation.MEGATRON: Implementation.BATCHLAB}


def runnable(cfg: RunConfig) -> RunConfig:
    """The config whose code the harness runs: a preset with ``--impl hf`` is built with transformers' class of
    its family (what the calculator counts for it), as ``hf:gpt2`` / ``hf:llama-2-7b`` with its shape; torchtitan
    and nanoGPT are not installed here, so their shapes run as the nearest installed code (``STAND_IN``)."""
    if cfg.model_kind is not ModelSource.BUILTIN:
        return cfg
    if STAND_IN.get(cfg.model.impl, cfg.model.impl) is Implementation.HF:
        family = "llama-2-7b" if cfg.model.mlp is MLPKind.SWIGLU else "gpt2"
        stand_in = cfg.model.impl is not Implementation.HF  # torchtitan's Llama has no KV cache
        return cfg.replace(model_source="hf:" + family, impl=Implementation.HF,
                           use_cache=False if stand_in else cfg.model.use_cache)
    return cfg


def runs_as(cfg: RunConfig) -> RunConfig:
    """``runnable(cfg)`` with the implementation the built code really is (batchlab's GPT builds Megatron's and
    nanoGPT's shapes alike)."""
    out = runnable(cfg)
    if out.model_kind is ModelSource.BUILTIN and out.model.impl in STAND_IN:
        return out.replace(impl=STAND_IN[out.model.impl])
    return out


def stand_in_text(cfg: RunConfig) -> str | None:
    """What runs in place of the config's implementation when it is not installed here, else None."""
    if cfg.model_kind is not ModelSource.BUILTIN or cfg.model.impl not in STAND_IN:
        return None
    return f"{cfg.model.impl.label} is not installed here: {STAND_IN[cfg.model.impl].label} runs in its place"
