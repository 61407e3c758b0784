"""Other implementations of a named preset under which a configuration that does not fit would fit.

The same shape keeps different tensors in different code (formula/activations.py): a Llama 2 13B step that
transformers' LlamaForCausalLM cannot hold on a card can fit as torchtitan's Llama.  When the chosen ``--impl``
does not fit, estimate names each other implementation the preset is trained with that does.  Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.config import Implementation, ModelSource, RunConfig, trained_with
from batchlab.formula.memory import MemoryEstimate, memory


@dataclass(frozen=True)
class Alternative:
    """``impl`` fits where the chosen implementation does not: its reserved bytes per rank and why."""

    impl: Implementation
    reserved_bytes: int
    why: str  # what that code keeps less of, e.g. "torchtitan's Llama keeps less per layer"

    def line(self) -> str:
        from batchlab.util.units import fmt_bytes

        return f"fits with --impl {self.impl} ({fmt_bytes(self.reserved_bytes)} reserved) [formula]: {self.why}"


def alternatives(cfg: RunConfig, chosen: MemoryEstimate) -> tuple[Alternative, ...]:
    """The implementations of cfg's preset (``config.trained_with``) that fit the device while ``chosen``
    (cfg's own memory) does not; () when it fits, or when the model is not a named preset."""
    if chosen.fits or cfg.model_kind is not ModelSource.BUILTIN:
        return ()
    out = []
    for impl in trained_with(cfg.model):
        if impl is cfg.model.impl:
            continue
        other = memory(cfg.replace(impl=impl))
        if other.fits:
            out.append(Alternative(impl=impl, reserved_bytes=other.reserved_bytes, why=_why(impl, chosen, other)))
    return tuple(out)


def _why(impl: Implementation, chosen: MemoryEstimate, other: MemoryEstimate) -> str:
    """The part of the difference a person can act on: per-layer activations, else all activations."""
    if max(other.activations_per_layer_bytes) < max(chosen.activations_per_layer_bytes):
        return f"{impl.label} keeps less per layer"
    if other.activations_bytes < chosen.activations_bytes:
        return f"{impl.label} keeps fewer activations"
    return f"{impl.label} needs less at the peak"
