"""Watch a Lightning ``Trainer`` run and write an observed record to the notebook.

    from batchlab.integrations.lightning import BatchlabCallback
    cb = BatchlabCallback(notebook="lab.sqlite")
    L.Trainer(accumulate_grad_batches=2, callbacks=[cb]).fit(module, loader)
    print(cb.record.short(), cb.notebook_id)

One optimizer update = from the first micro-batch's ``on_train_batch_start`` to the ``on_train_batch_end`` of
the micro-batch whose optimizer step ran.  Phases: forward from ``on_train_batch_start``, backward from
``on_before_backward``, optimizer from ``on_before_optimizer_step``.  The per-device batch is read from the
batch itself (first tensor's first dimension); a batch of ``input_ids`` (a tensor of integers, or a dict)
gives the sequence length and useful tokens (``attention_mask`` sum).  Lightning zeroes gradients after the
next forward, so the previous update's gradients are counted while they are alive.
"""
from __future__ import annotations

from typing import Any

import torch

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package has the same Callback
    from pytorch_lightning import Callback

from batchlab.experiment.observed import Settings, Source
from batchlab.integrations.callback import NotebookCallback
from batchlab.integrations.mapping import hf_checkpointing, run_config
from batchlab.config.phase import Phase


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    return next((t for t in map(_first_tensor, values) if t is not None), None)


def _token_ids(batch: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(input_ids, attention_mask) when the batch holds token sequences."""
    if isinstance(batch, dict):
        return batch.get("input_ids"), batch.get("attention_mask")
    t = _first_tensor(batch)
    if t is not None and t.dim() == 2 and not t.is_floating_point():
        return t, None
    return None, None


def _hf_model(module: torch.nn.Module):
    """The first Hugging Face model inside the LightningModule (it has a ``config.model_type``)."""
    return next((m for m in module.modules() if hasattr(getattr(m, "config", None), "model_type")), None)


class BatchlabCallback(NotebookCallback, Callback):
    def __init__(self, notebook=None, predict: bool = True, warmup: int = 2, note: str = "",
                 memory_every: int | None = None):
        super().__init__(notebook, predict, warmup, note, memory_every)
        self._micro_batch: int | None = None
        self._stepped = False

    def on_train_start(self, trainer, pl_module) -> None:
        self.watch = self._watch(pl_module, trainer.optimizers[0], pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.watch is None:
            return
        if not self.watch.in_update:
            self._stepped = False
            self.watch.begin()
        first = _first_tensor(batch)
        self._micro_batch = int(first.shape[0]) if first is not None and first.dim() > 0 else self._micro_batch
        ids, mask = _token_ids(batch)
        if ids is not None:
            self._seq = int(ids.shape[-1])
            self.watch.count_tokens(mask.detach().sum() if mask is not None else ids.numel())
        self.watch.mark(Phase.FORWARD)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.watch is not None:
            self.watch.mark(Phase.BACKWARD)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.watch is not None:
            self._stepped = True
            self.watch.mark(Phase.OPTIMIZER)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.watch is not None and self._stepped:
            self.watch.end()

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.watch is not None:
            self.watch.abort(exception)

    def settings(self, trainer, pl_module) -> Settings:
        hf = _hf_model(pl_module)
        gc = hf_checkpointing(hf) if hf is not None else None
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        model = type(pl_module).__name__ + (f" ({type(hf).__name__})" if hf is not None else "")
        return Settings(micro_batch=self._micro_batch, accum=trainer.accumulate_grad_batches,
                        world_size=trainer.world_size, precision=str(trainer.precision), gradient_checkpointing=gc,
                        seq=self._seq, model=model, device=str(pl_module.device),
                        optimizer=type(optimizer).__name__ if optimizer is not None else "")

    def on_train_end(self, trainer, pl_module) -> None:
        if self.watch is None:
            return
        s = self.settings(trainer, pl_module)
        hf = _hf_model(pl_module)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        momentum = optimizer.defaults.get("momentum") if optimizer is not None else None
        cfg, unmapped = run_config(s, hf.config.to_dict() if hf is not None else None, momentum=momentum)
        self._finish(Source.LIGHTNING, s, cfg, unmapped)
