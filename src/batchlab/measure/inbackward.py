"""The optimizer step fused into backward, as torchtune runs it (training/memory.py ``OptimizerInBackwardWrapper``
and ``register_optim_in_bwd_hooks``): one optimizer per parameter, stepped in the parameter's post-accumulate-grad
hook, which then frees the gradient, so the update never holds all gradients at once."""
from __future__ import annotations

import torch


class StepInBackward(torch.optim.Optimizer):
    """One ``cls(**kwargs)`` per trainable parameter behind one Optimizer face: ``param_groups`` and ``state`` are
    the per-parameter optimizers' own (an LR scheduler sets their rates, a tracker reads their state);
    ``step`` and ``zero_grad`` have nothing left to do after backward."""

    def __init__(self, cls: type[torch.optim.Optimizer], kwargs: dict, params) -> None:
        params = [p for p in params if p.requires_grad]
        super().__init__(params, {})
        self.per_param = {p: cls([p], **kwargs) for p in params}
        self.param_groups = [o.param_groups[0] for o in self.per_param.values()]
        for p, opt in self.per_param.items():
            self.state[p] = opt.state[p]  # the same dict: filled by the first step
        self.handles = [p.register_post_accumulate_grad_hook(self._step_one) for p in self.per_param]

    def _step_one(self, p: torch.Tensor) -> None:
        opt = self.per_param[p]
        opt.step()
        opt.zero_grad(set_to_none=True)  # torchtune's hook: the gradient is freed as soon as it is used

    @torch.no_grad()
    def step(self, closure=None):  # every parameter stepped during backward
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:  # the hooks freed every gradient already
        return None

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
