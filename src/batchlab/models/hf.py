"""Hugging Face ``transformers`` models as workloads, built from a config with random init (no weights are
downloaded, nothing touches the network).

``hf:FILE_OR_DIR`` (a config.json or a directory holding one): any model_type ``AutoConfig`` knows, built
with the Auto class its ``architectures`` names (causal LM by default, masked LM, sequence classification);
the file's fields stay (attention implementation, sliding window, GQA, MoE routing, tied embeddings), and
the shape fields the user overrode (``--layers 2``) are written back under the family's own names.
``hf:gpt2`` / ``hf:llama-2-7b`` (any batchlab preset) build the GPT-2 or Llama class from the ModelSpec.

The loss is the model's own (``labels=``), as a user's HF training loop runs it; the blocks handed to
activation checkpointing are the model's own layer ModuleList.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

from batchlab.config import ConfigError, DataKind, MLPKind, ModelSpec, RunConfig
from batchlab.config.hf import ALIASES, NO_SDPA, hf_config_path, spec_fields
from batchlab.config.load import hf_raw
from batchlab.models import Workload, synthetic_tokens

INSTALL_HINT = "pip install 'batchlab[hf]' (or pip install transformers)"
# ModelSpec fields fixed by a family's code: a different value cannot be written into its config
_FIXED = ("mlp", "norm", "position", "bias", "qkv_bias", "family")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("model", f"hf: models need the transformers package, which is not installed; "
                                   f"{INSTALL_HINT}") from None
    return transformers


def _preset_family(spec: ModelSpec) -> str:
    name = spec.name.lower()
    if name.startswith(("gpt2", "gpt3")):
        return "gpt2"
    if name.startswith("llama"):
        return "llama"
    return "llama" if spec.mlp is MLPKind.SWIGLU else "gpt2"


def _preset_fields(family: str, spec: ModelSpec) -> dict[str, Any]:
    """The HF config fields that carry a preset ModelSpec's shape (names differ per family)."""
    if family == "gpt2":
        return dict(n_layer=spec.layers, n_embd=spec.hidden, n_head=spec.heads, n_inner=spec.ffn,
                    vocab_size=spec.vocab, n_positions=spec.max_positions, resid_pdrop=spec.dropout,
                    embd_pdrop=spec.dropout, attn_pdrop=spec.dropout, tie_word_embeddings=spec.tied_embeddings)
    return dict(num_hidden_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
                num_key_value_heads=spec.kv_heads, intermediate_size=spec.ffn, vocab_size=spec.vocab,
                max_position_embeddings=spec.max_positions, attention_dropout=spec.dropout,
                tie_word_embeddings=spec.tied_embeddings, attention_bias=spec.bias, mlp_bias=spec.bias)


def _file_fields(raw: dict[str, Any], spec: ModelSpec, source: str) -> dict[str, Any]:
    """The file's fields with the ModelSpec's overrides written back under the family's own key names."""
    kind = raw["model_type"]
    read = ModelSpec(**spec_fields(raw, source))
    values = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    for name in _FIXED:
        if getattr(spec, name) != getattr(read, name):
            raise ConfigError(name, f"is fixed by the {kind} code in transformers ({getattr(read, name)}); "
                                    f"{getattr(spec, name)} cannot be set for hf:{source}")
    for name, keys in ALIASES.items():
        value = getattr(spec, name)
        if value != getattr(read, name):
            values[next((k for k in keys if k in raw), keys[0])] = value
            if name == "layers":  # per-layer lists follow the new count (the config class rebuilds them)
                values.pop("layer_types", None)
    if raw.get("head_dim") == read.hidden // read.heads and (spec.hidden, spec.heads) != (read.hidden, read.heads):
        values["head_dim"] = spec.hidden // spec.heads  # the file's head_dim was hidden / heads: it follows them
    if spec.tied_embeddings != read.tied_embeddings:
        values["tie_word_embeddings"] = spec.tied_embeddings
    if spec.dropout != read.dropout:
        for k in raw:
            if (k.endswith("dropout") or k.endswith("pdrop")) and not k.startswith("classifier"):
                values[k] = spec.dropout
    return values


def hf_config(cfg: RunConfig):
    """The transformers config object for ``cfg`` (the ModelSpec decides the shape)."""
    transformers = _transformers()
    target = cfg.model_source[len("hf:"):]
    raw = hf_raw(target)
    if raw is not None:  # a config.json, or transformers' defaults of a model_type (hf:mistral)
        family, values = raw["model_type"], _file_fields(raw, cfg.model, str(hf_config_path(target)))
    else:
        family = _preset_family(cfg.model)
        values = _preset_fields(family, cfg.model)
    # the KV cache as the user's training forward builds it (RunConfig.kv_cache); special tokens inside the
    # (possibly shrunk) vocabulary
    values.update(use_cache=cfg.kv_cache, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if any(a.endswith("ForSequenceClassification") for a in values.get("architectures") or ()):
        values["pad_token_id"] = 0  # the classifier finds each row's last token by it (batches > 1 need one)
    try:
        config = transformers.AutoConfig.for_model(family, **values)
    except ValueError as e:  # an unknown model_type, or a value the config class rejects
        raise ConfigError("model", f"transformers cannot build a {family} config from {target}: {e}") from None
    for name, keys in ALIASES.items():  # each override must have landed (a family may have no such field)
        if name in ("kv_heads", "max_positions") or getattr(cfg.model, name) is None:
            continue
        got = next((getattr(config, k) for k in keys if getattr(config, k, None) is not None), None)
        if got is not None and got != getattr(cfg.model, name):
            raise ConfigError(name, f"the {family} config has no field for it ({got} is fixed by its code)")
    return config


def _architecture(config) -> str:
    names = list(getattr(config, "architectures", None) or [])
    for suffix in ("ForMaskedLM", "ForSequenceClassification"):
        if any(n.endswith(suffix) for n in names):
            return suffix
    return "ForCausalLM"


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


def _takes_shift_labels(model: nn.Module) -> bool:
    params = inspect.signature(model.forward).parameters.values()
    return any(p.kind is p.VAR_KEYWORD or p.name == "shift_labels" for p in params)


def _model_loss(causal: bool):
    """The model's own loss (``labels=``) as a token sum; the harness divides by the whole update's count.

    The batch maker shifts targets already, so a causal LM gets them as ``shift_labels`` (transformers' loss
    then does not shift again).  HF losses are means over non-ignored labels: x count = the sum.
    """

    def loss_sum(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        extra = {"shift_labels": targets} if causal else {}
        loss = model(input_ids=tokens, labels=targets, **extra).loss
        return loss * (targets != -100).sum()

    return loss_sum


def _class_targets(num_labels: int, vocab: int):
    """Sequence classification: random tokens, one class id per sequence."""
    tokens = synthetic_tokens(vocab, DataKind.FIXED)

    def make(gen: torch.Generator, micro_batch: int, seq: int, device: torch.device):
        inputs, _ = tokens(gen, micro_batch, seq, device)
        return inputs, torch.randint(0, num_labels, (micro_batch,), generator=gen).to(device)

    return make


def _attention(cfg: RunConfig, family: str) -> str:
    return "eager" if family in NO_SDPA or cfg.model.attention.value == "eager" else "sdpa"


def build_hf_workload(cfg: RunConfig) -> Workload:
    transformers = _transformers()
    config = hf_config(cfg)
    head = _architecture(config)
    auto = {"ForCausalLM": transformers.AutoModelForCausalLM, "ForMaskedLM": transformers.AutoModelForMaskedLM,
            "ForSequenceClassification": transformers.AutoModelForSequenceClassification}[head]
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # random-init notices are expected here
    try:
        try:
            model = auto.from_config(config, attn_implementation=_attention(cfg, config.model_type))
        except ValueError as e:  # a class without SDPA (Gemma2): its eager attention is the only code there is
            if "scaled_dot_product_attention" not in str(e):
                raise
            model = auto.from_config(config, attn_implementation="eager")
    finally:
        transformers.logging.set_verbosity(verbosity)
    causal = head == "ForCausalLM"
    if causal and not _takes_shift_labels(model):
        raise ConfigError("model", f"{type(model).__name__}.forward takes no shift_labels; batchlab cannot run its "
                                   "own labels loss on pre-shifted targets")
    make_batch = (_class_targets(config.num_labels, cfg.model.vocab) if head == "ForSequenceClassification"
                  else synthetic_tokens(cfg.model.vocab, cfg.data))
    # HF's own gradient checkpointing stays off: batchlab's ACPolicy wraps the layers (models/ac.py)
    return Workload(model=model, blocks=_layers(model), make_batch=make_batch, loss_sum=_model_loss(causal),
                    description=f"transformers {type(model).__name__} ({cfg.model_source}, random init, own loss)")
