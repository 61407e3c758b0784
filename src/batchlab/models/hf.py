"""Hugging Face ``transformers`` causal LMs as workloads, built from a config with random init (no weights
are downloaded, nothing touches the network).

``hf:gpt2`` / ``hf:llama-2-7b`` (any batchlab preset) build the family's config class from the run's
ModelSpec (so ``--layers 2`` and friends apply); ``hf:path/config.json`` starts from that file's fields
(rope_theta, eps, ...) and sets the shape fields from the ModelSpec (which was read from the same file,
plus overrides).  The blocks handed to activation checkpointing are the model's own layer ModuleList.
"""
from __future__ import annotations

import json
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from batchlab.config import ConfigError, MLPKind, ModelSpec, RunConfig, read_file
from batchlab.models import Workload, synthetic_tokens

INSTALL_HINT = "pip install 'batchlab[hf]' (or pip install transformers)"
# model_type families batchlab can set the shape of; anything else would silently ignore --layers etc.
GPT2_TYPES = ("gpt2",)
LLAMA_TYPES = ("llama", "mistral", "qwen2")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("model", f"hf: models need the transformers package, which is not installed; "
                                   f"{INSTALL_HINT}") from None
    return transformers


def _family(spec: ModelSpec, raw: dict[str, Any] | None) -> str:
    if raw is not None:
        kind = str(raw.get("model_type", "")).lower()
        if kind in GPT2_TYPES + LLAMA_TYPES:
            return kind
        raise ConfigError("model", f"model_type {kind!r} is not supported by hf:; supported: "
                                   f"{', '.join(GPT2_TYPES + LLAMA_TYPES)}")
    name = spec.name.lower()
    if name.startswith(("gpt2", "gpt3")):
        return "gpt2"
    if name.startswith("llama"):
        return "llama"
    return "llama" if spec.mlp is MLPKind.SWIGLU else "gpt2"


def _shape_fields(family: str, spec: ModelSpec) -> dict[str, Any]:
    """The HF config fields that carry the ModelSpec's shape (names differ per family)."""
    if family in GPT2_TYPES:
        return dict(n_layer=spec.layers, n_embd=spec.hidden, n_head=spec.heads, n_inner=spec.ffn,
                    vocab_size=spec.vocab, n_positions=spec.max_positions, resid_pdrop=spec.dropout,
                    embd_pdrop=spec.dropout, attn_pdrop=spec.dropout, tie_word_embeddings=spec.tied_embeddings)
    return dict(num_hidden_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
                num_key_value_heads=spec.kv_heads, intermediate_size=spec.ffn, vocab_size=spec.vocab,
                max_position_embeddings=spec.max_positions, attention_dropout=spec.dropout,
                tie_word_embeddings=spec.tied_embeddings, attention_bias=spec.bias, mlp_bias=spec.bias)


def hf_config(cfg: RunConfig):
    """The transformers config object for ``cfg`` (the ModelSpec decides the shape)."""
    transformers = _transformers()
    target = cfg.model_source[len("hf:"):]
    raw = None
    if target.endswith(".json"):
        raw = read_file("model", target, json.loads, "a JSON config")
    family = _family(cfg.model, raw)
    values = {k: v for k, v in (raw or {}).items() if k not in ("model_type", "architectures", "transformers_version")}
    values.update(_shape_fields(family, cfg.model))
    # training: no KV cache; special tokens inside the (possibly shrunk) vocabulary
    values.update(use_cache=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.AutoConfig.for_model(family, **values)


def _layers(model: nn.Module) -> nn.ModuleList:
    """The repeated decoder layers: the longest ModuleList of one module class."""
    best = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            if best is None or len(module) > len(best):
                best = module
    if best is None:
        raise ConfigError("model", f"{type(model).__name__} has no ModuleList of layers to wrap for activation checkpointing")
    return best


def _hf_loss_sum(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # targets are already shifted by the batch maker, so the model is not given labels (HF would shift again)
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.reshape(-1), ignore_index=-100, reduction="sum")


def build_hf_workload(cfg: RunConfig) -> Workload:
    transformers = _transformers()
    config = hf_config(cfg)
    attn = "sdpa" if cfg.model.attention.value == "sdpa" else "eager"
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # random-init notices are expected here
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    finally:
        transformers.logging.set_verbosity(verbosity)
    # HF's own gradient checkpointing stays off: batchlab's ACPolicy wraps the layers (models/ac.py)
    return Workload(model=model, blocks=_layers(model), make_batch=synthetic_tokens(cfg.model.vocab, cfg.data),
                    loss_sum=_hf_loss_sum,
                    description=f"transformers {type(model).__name__} ({cfg.model_source}, random init)")
