"""A pipeline stage of a Hugging Face Llama-family causal LM (``LlamaForCausalLM`` and the classes laid out as it is).

The stage holds the model's own parts: the first the token embedding (``model.model.embed_tokens``), every one its
decoder layers (``model.model.layers[i]``), the last the final norm and the LM head.  Each stage computes what
``LlamaModel.forward`` hands every decoder layer from its own hidden states — position ids, the causal mask
(``create_causal_mask``: None under SDPA without padding, its ``is_causal`` path) and the rotary position
embeddings (``model.model.rotary_emb``) — and calls each layer as that forward does, with no cache.
The parts keep the names the built-in GPT's ``Stage`` gives them (``embed``, ``blocks``, ``head``), which the
tied-embedding handling and FSDP2's wrapping read.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from batchlab.config import ConfigError

_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def _refuse(model: nn.Module, what: str) -> ConfigError:
    return ConfigError("pp", f"{type(model).__name__} {what}: measured pipelines cut a Llama-family Hugging Face "
                             "causal LM (model.embed_tokens / layers / norm / rotary_emb, lm_head) or the built-in "
                             "GPT; use `batchlab estimate` for this model")


def check_llama_like(model: nn.Module) -> None:
    """A ConfigError naming ``pp`` unless ``model`` is laid out as ``LlamaForCausalLM``, every layer a
    pre-norm decoder layer on full causal attention (no sliding windows or per-layer mask kinds)."""
    inner = getattr(model, "model", None)
    missing = [p for p in _PARTS if not hasattr(inner, p)] if inner is not None else ["model"]
    if missing or getattr(model, "lm_head", None) is None:
        raise _refuse(model, f"has no {(missing or ['lm_head'])[0]}")
    # by name among its modules: an activation-checkpointing wrapper (models/ac.py) holds the layer inside it
    names = {n.rsplit(".", 1)[-1] for n, _ in inner.layers[0].named_modules()}
    absent = [p for p in _LAYER_PARTS if p not in names]
    if absent:
        raise _refuse(model, f"layers have no {absent[0]}")
    config = model.config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if getattr(config, "sliding_window", None) or kinds != {"full_attention"}:
        raise _refuse(model, "uses sliding-window attention")


def _mask_function(inner: nn.Module):
    import sys

    return getattr(sys.modules[type(inner).__module__], "create_causal_mask")


class HFStage(nn.Module):
    """Decoder layers ``layers`` of ``model``, with the token embedding when ``first``, the final norm and the LM
    head when ``last``."""

    def __init__(self, model: nn.Module, layers: tuple[int, ...], first: bool, last: bool):
        super().__init__()
        inner = model.model
        self.config = model.config
        self.rotary = inner.rotary_emb
        self._mask = _mask_function(inner)
        self._mask_takes = set(inspect.signature(self._mask).parameters)
        if first:
            self.embed = inner.embed_tokens
        self.blocks = nn.ModuleList(inner.layers[i] for i in layers)
        if last:
            self.norm_f, self.head = inner.norm, model.lm_head

    def _causal_mask(self, x: torch.Tensor, position_ids: torch.Tensor):
        kwargs = dict(config=self.config, inputs_embeds=x, attention_mask=None, position_ids=position_ids)
        # the cache's argument, under its name in this transformers (older ones: past_key_values)
        cache = next((n for n in ("cache", "past_key_values") if n in self._mask_takes), None)
        if cache is not None:
            kwargs[cache] = None
        if "cache_position" in self._mask_takes:
            kwargs["cache_position"] = position_ids[0]
        return self._mask(**kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "embed"):
            x = self.embed(x)
        # as LlamaModel.forward derives them with no cache: positions 0..s-1 of every sequence
        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        mask = self._causal_mask(x, position_ids)
        position_embeddings = self.rotary(x, position_ids=position_ids)
        for layer in self.blocks:
            x = layer(x, attention_mask=mask, position_embeddings=position_embeddings, position_ids=position_ids,
                      use_cache=False)
        if hasattr(self, "head"):
            x = self.head(self.norm_f(x))
        return x
