"""transformers' KV cache in the training forward: whether the run builds one and what turning it off changes.

A transformers model whose config has ``use_cache`` on (every family's default) builds a DynamicCache in its
training forward too, unless a layer is recomputed: transformers then turns the cache off with a warning
(RunConfig.kv_cache).  The built-in terms count what the cache changes (formula/activations.py); a profiled model's
own terms were traced with the config's setting, so the other setting's difference is the trace's to give.
"""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.config import RunConfig


@dataclass(frozen=True)
class KVCache:
    on: bool  # the training forward builds the cache (after the activation-checkpointing rule)
    use_cache: bool | None  # the model config's setting (None: the config's default, on)
    off_under_ac: bool  # the config has it on, and a recomputed layer turns it off
    # the other setting's figures less this one's, by the built-in terms (None: a profiled model's, unknown here)
    toggle_activations: int | None
    toggle_peak: int | None
    profiled_plain_layers: bool = False  # a plan's plain layers counted by a profile traced with the cache on

    @property
    def text(self) -> str:
        setting = "use_cache=" + ("True" if self.use_cache is not False else "False")
        default = ", the config's default" if self.use_cache is None else ""
        if self.off_under_ac:
            return (f"KV cache: off: the config has {setting}{default}, but transformers turns it off (with a warning) "
                    "under gradient checkpointing, and so does batchlab under --ac" + (
                        "; the layer profile's plain layers were traced with it on, so this plan's plain layers are "
                        "counted with it (estimate --trace runs the plan; --no-use-cache profiles them without)"
                        if self.profiled_plain_layers else ""))
        flag = "--no-use-cache" if self.on else "--use-cache"
        change = (f"changes the peak by {_signed_bytes(self.toggle_peak)}, activations by "
                  f"{_signed_bytes(self.toggle_activations)} [formula]" if self.toggle_peak is not None
                  else f"changes what is kept (estimate --trace {flag} shows how much)")
        built = "builds a DynamicCache" if self.on else "builds none"
        return f"KV cache: {'on' if self.on else 'off'} ({setting}{default}): the training forward {built}; {flag} {change}"


def held_in_forward_bytes(cfg: RunConfig) -> int:
    """What the cache itself holds beyond the tensors backward keeps, until the loss is computed and the model's
    output (which carries the cache) is dropped.  transformers' Llama rotates k with cos/sin in the hidden states'
    dtype, fp32 under autocast: the cache keeps each layer's fp32 k, while SDPA casts it to 16 bits and keeps that.
    GPT-2's cache copies are the very tensors SDPA keeps (counted in its layer terms)."""
    from batchlab.formula.activations import Impl, implementation

    if not cfg.kv_cache or not cfg.precision.mixed or implementation(cfg.model_kind, cfg.model) is not Impl.HF_LLAMA:
        return 0
    m = cfg.model
    return m.layers * cfg.seq * cfg.micro_batch * m.kv_hidden * 4


def _signed_bytes(n: int) -> str:
    from batchlab.util.units import fmt_bytes

    return ("+" if n > 0 else "-" if n < 0 else "±") + fmt_bytes(abs(n))


def kv_cache(cfg: RunConfig, memory, this=None) -> KVCache | None:
    """The cache's state for cfg, None where the model's code has no KV cache (batchlab's GPT, torchtitan, nanoGPT,
    a factory); ``memory(cfg)``: the formula's MemoryEstimate of a config, for the other setting's change;
    ``this``: cfg's own MemoryEstimate where the caller has it already (else ``memory(cfg)`` makes it)."""
    from batchlab.config import Implementation

    if cfg.model.impl is not Implementation.HF:
        return None
    if cfg.model.kv_cache and not cfg.kv_cache:
        plain = any(not m.spec.recomputes for m in cfg.ac.layer_modes(cfg.model.layers))
        return KVCache(on=False, use_cache=cfg.model.use_cache, off_under_ac=True, toggle_activations=None,
                       toggle_peak=None, profiled_plain_layers=plain and cfg.model.matching_profile is not None)
    if cfg.model.matching_profile is not None:  # a profile of the other setting is not at hand
        return KVCache(on=cfg.kv_cache, use_cache=cfg.model.use_cache, off_under_ac=False, toggle_activations=None,
                       toggle_peak=None)
    this, other = this or memory(cfg), memory(cfg.replace(use_cache=not cfg.kv_cache))
    return KVCache(on=cfg.kv_cache, use_cache=cfg.model.use_cache, off_under_ac=False,
                   toggle_activations=other.activations_bytes - this.activations_bytes,
                   toggle_peak=other.peak_tensor_bytes - this.peak_tensor_bytes)
