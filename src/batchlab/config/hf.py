"""A Hugging Face ``config.json`` (any model_type) read as a ModelSpec, without transformers.  Pure Python.

Families spell the same shape differently (``n_layer`` / ``num_hidden_layers``, ``n_embd`` / ``hidden_size``
/ ``d_model``, ``ffn_dim``, ``n_inner``, Falcon's ``multi_query``); ALIASES lists each spelling.  The shape
is what the calculator and ``--vary`` use; the layer terms come from the model's own code (a layer profile,
``trace/profile.py``), and without one from the nearest built-in family.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from batchlab.config.choices import ConfigError
from batchlab.config.values import SIZE_MAX, finite_number, read_file, whole_number

# ModelSpec field -> the config.json keys that carry it, in order of preference
ALIASES: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model", "dim"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "d_ff"),
    "vocab": ("vocab_size",),
    "max_positions": ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"),
}
# gated MLPs (SwiGLU / GeGLU: gate, up, down projections)
GATED = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
         "phi3", "granite", "granitemoe", "olmo", "olmo2", "cohere", "cohere2", "stablelm", "deepseek_v3", "glm",
         "exaone4", "smollm3", "ministral", "helium"}
LAYERNORM_GATED = {"stablelm", "cohere", "cohere2"}  # gated MLPs with LayerNorm, not RMSNorm
LEARNED_POSITIONS = {"gpt2", "opt", "gpt_bigcode", "biogpt", "xglm", "gpt_neo"}
ALIBI = {"bloom", "mpt"}
UNTIED_BY_DEFAULT = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "gpt_neox",
                     "granite", "olmo", "olmo2", "stablelm", "falcon_mamba"}
NO_SDPA = {"bloom"}  # transformers implements only eager attention for these


MODEL_TYPE = re.compile(r"[a-z][a-z0-9_]*")  # how transformers spells a model_type (mistral, qwen2, gpt_neox)


def hf_config_path(target: str | Path) -> Path:
    """A config.json, or a directory holding one."""
    p = Path(target)
    return p / "config.json" if p.is_dir() else p


def family_config(kind: str) -> dict[str, Any] | None:
    """transformers' default config for the model_type ``kind`` (``AutoConfig.for_model(kind)``: the family's
    reference size, mistral's is Mistral-7B-v0.1), or None without transformers or for a kind it does not know."""
    if not MODEL_TYPE.fullmatch(kind):
        return None
    try:
        from transformers import AutoConfig

        return AutoConfig.for_model(kind).to_dict()
    except (ImportError, ValueError, KeyError):
        return None


def is_family(target: str | Path) -> bool:
    """``hf:mistral``: not a file, but a model_type transformers has a default config for."""
    return not hf_config_path(target).exists() and family_config(str(target)) is not None


def read_hf_config(target: str | Path, field_name: str = "model") -> dict[str, Any]:
    """A config.json (or a directory holding one), or transformers' default config for a bare model_type."""
    p = hf_config_path(target)
    if not p.exists() and (defaults := family_config(str(target))) is not None:
        return defaults
    raw = read_file(field_name, p, json.loads, "a JSON config")
    if not isinstance(raw, dict) or not raw.get("model_type"):
        raise ConfigError(field_name, f"{p} is not a Hugging Face config (no model_type)")
    return raw


def _first(raw: dict[str, Any], field: str) -> Any:
    return next((raw[k] for k in ALIASES[field] if raw.get(k) is not None), None)


def _kv_heads(raw: dict[str, Any], kind: str, heads: int) -> int:
    if kind == "falcon" and not raw.get("new_decoder_architecture"):
        return 1 if raw.get("multi_query", True) else heads
    return int(_first(raw, "kv_heads") or heads)


def _bias(raw: dict[str, Any], kind: str) -> tuple[bool, bool]:
    """(biases on linear layers and norms, biases on q/k/v)."""
    if kind in ("qwen2", "qwen2_moe"):
        return False, True  # Qwen2: q, k, v projections carry biases, nothing else does
    for key in ("attention_bias", "bias", "use_bias", "enable_bias", "add_bias_linear"):
        if key in raw:
            return bool(raw[key]), bool(raw[key])
    b = kind in ("gpt2", "opt", "gpt_neox", "bloom", "gpt_bigcode", "phi")
    return b, b


def _dropout(raw: dict[str, Any]) -> float:
    """The largest dropout probability the config names; each one checked (a string or NaN is an error)."""
    keys = [k for k in raw if (k.endswith("dropout") or k.endswith("pdrop")) and raw[k] is not None
            and not k.startswith("classifier")]
    return max((finite_number(k, raw[k], minimum=0.0, maximum=1.0) for k in keys), default=0.0)


def _whole(field: str, value: Any) -> int:
    """A shape field as a JSON whole number (``"2"`` or ``2.5`` is an error naming the ModelSpec field)."""
    whole_number(field, value, maximum=SIZE_MAX)
    return value


def _family_defaults(kind: str) -> dict[str, int]:
    """The optional shape fields (MLP width, position table) a config.json may leave out, as the family's
    config class fills them when transformers builds the model; {} without transformers (no torch needed)."""
    defaults = family_config(kind)
    if defaults is None:  # not installed, or a model_type this version does not know
        return {}
    out = {f: _first(defaults, f) for f in ("ffn", "max_positions")}
    return {f: v for f, v in out.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}


def spec_fields(raw: dict[str, Any], source: str = "config.json", field_name: str = "model") -> dict[str, Any]:
    """ModelSpec keyword arguments for a config.json's contents (any model_type); ``field_name``: the option
    that named the file, for errors about the file as a whole."""
    kind = str(raw["model_type"]).lower()
    values = {f: _first(raw, f) for f in ALIASES}
    for f in ("layers", "hidden", "heads", "vocab"):
        if values[f] is None:
            raise ConfigError(field_name, f"{source} ({kind}) has none of the fields {', '.join(ALIASES[f])}")
    values = {f: (_whole(f, v) if v is not None else None) for f, v in values.items()}
    if values["ffn"] is None or values["max_positions"] is None:  # only then: importing transformers costs ~1 s
        values.update({f: v for f, v in _family_defaults(kind).items() if values[f] is None})
    hidden, heads = values["hidden"], values["heads"]
    bias, qkv_bias = _bias(raw, kind)
    gated = kind in GATED or (kind not in LEARNED_POSITIONS and raw.get("hidden_act") in ("silu", "swish"))
    if kind in LEARNED_POSITIONS:
        position = "learned"
    else:
        position = "alibi" if kind in ALIBI or raw.get("alibi") else "rope"
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    attention = str(raw.get("_attn_implementation") or raw.get("attn_implementation") or "")
    return dict(
        family=kind, impl="hf", layers=int(values["layers"]), hidden=hidden, heads=heads,
        kv_heads=_kv_heads(raw, kind, heads), ffn=int(values["ffn"]) if values["ffn"] else None,
        mlp="swiglu" if gated else "gelu", vocab=int(values["vocab"]),
        tied_embeddings=bool(raw.get("tie_word_embeddings", kind not in UNTIED_BY_DEFAULT)),
        norm="rmsnorm" if "rms_norm_eps" in raw or (kind in GATED and kind not in LAYERNORM_GATED) else "layernorm",
        dropout=_dropout(raw), position=position,
        attention="eager" if kind in NO_SDPA or attention == "eager" else "sdpa",
        max_positions=int(values["max_positions"] or 1 << 20), bias=bias, qkv_bias=qkv_bias,
        sliding_window=int(window) if isinstance(window, int) and window > 0 else None,
        use_cache=raw["use_cache"] if isinstance(raw.get("use_cache"), bool) else None)
