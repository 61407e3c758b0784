"""The optimizer step fused into backward (torchtune ``optimizer_in_bwd``): what it changes in one update's
memory and time (no torch).

torchtune training/memory.py ``register_optim_in_bwd_hooks``: each parameter has an optimizer of its own, stepped
in the parameter's post-accumulate-grad hook, which then sets its gradient to None.  So no phase holds all
gradients: at most the one being stepped (with its step's temporaries), and the optimizer phase after backward
has nothing left to do.
"""
from __future__ import annotations

import dataclasses

from batchlab.config import RunConfig
from batchlab.formula.states import ModelStates


def walk_states(cfg: RunConfig, states: ModelStates) -> ModelStates:
    """The states the backward walk grows gradients from: none accumulate under the fused step."""
    return dataclasses.replace(states, gradients=0) if cfg.optimizer_in_backward else states


def in_flight_gradient(states: ModelStates, params: int, largest: int) -> int:
    """Bytes of the one gradient alive at a time: the largest parameter's (``largest`` elements of ``params``)."""
    return largest * states.gradients // max(params, 1)


def stepping_bytes(cfg: RunConfig, in_flight: int, step_temporaries: int) -> int:
    """What a layer's backward adds while a fused step runs in it: the gradient and the step's temporaries."""
    return in_flight + step_temporaries if cfg.optimizer_in_backward else 0


def phases(cfg: RunConfig, phases: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The phases' parts with the step moved into backward: forward holds no gradient, the optimizer phase
    neither.  Backward: the walk places the stepping bytes layer by layer (stepping_bytes); a profiled backward
    is left as traced, its excess already holding the traced top layers' gradients, more than one in flight."""
    if not cfg.optimizer_in_backward:
        return phases
    out = dict(phases)
    out["forward"] = dict(phases["forward"], gradients=0)
    out["optimizer"] = dict(phases["optimizer"], gradients=0, temporaries=0)
    return out
