"""Which module of a model is running: forward hooks keep a stack of running modules, so that a tracker can
label each new storage with its owner (trace/tree.py sums them into a tree; the measured timeline labels with
it too).  An activation-checkpointing wrapper and the block it wraps share the block's name."""
from __future__ import annotations

import torch.nn as nn

from batchlab.models.ac import Checkpointed

OUTSIDE = "(outside the model)"  # e.g. the loss scaled by the harness after the model returns


def module_labels(model: nn.Module) -> dict[nn.Module, str]:
    """Qualified names, with an activation-checkpointing wrapper and the block it wraps sharing the
    block's place in the model (``blocks.3``, not ``blocks.3.block``)."""
    names = dict((m, n) for n, m in model.named_modules())
    renames = {f"{names[m]}.block" if names[m] else "block": names[m]
               for m in names if isinstance(m, Checkpointed)}
    labels = {}
    for m, name in names.items():
        for src, dst in renames.items():
            if name == src or name.startswith(src + "."):
                name = dst + name[len(src):]
                break
        labels[m] = name
    return labels


class HookSet:
    """Hooks registered on a model's modules (``self._handles``), all removed by ``close()``."""

    def __init__(self):
        self._handles: list = []

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class ModuleStack(HookSet):
    """Forward hooks on every module keep a stack of running modules; ``current()`` is the innermost."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.labels = module_labels(model)
        self._stack: list[str] = []
        for m, label in self.labels.items():
            self._handles.append(m.register_forward_pre_hook(self._enter(label)))
            self._handles.append(m.register_forward_hook(self._leave, always_call=True))

    def _enter(self, label: str):
        def hook(module, args) -> None:
            self._stack.append(label)
        return hook

    def _leave(self, module, args, output) -> None:  # returns None: a forward hook's value replaces the output
        self._stack.pop()

    def current(self) -> str:
        return self._stack[-1] if self._stack else OUTSIDE
