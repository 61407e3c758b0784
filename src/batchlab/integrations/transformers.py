"""Watch a Hugging Face ``Trainer`` run and write an observed record to the notebook.

    from batchlab.integrations.transformers import BatchlabCallback
    cb = BatchlabCallback(notebook="lab.sqlite")
    Trainer(model, args, train_dataset=ds, callbacks=[cb]).train()
    print(cb.record.short(), cb.notebook_id)

One optimizer update = ``on_step_begin`` .. ``on_step_end`` (all its micro-batches).  Phases: forward from the
model's forward pre-hook, backward from its forward hook (HF models compute the loss inside forward, and the
Trainer has no event between forward and backward), optimizer from ``on_pre_optimizer_step``.  The two hooks
sit on the root model only (no per-module hooks), so the callback's Python per update stays a small fraction
of a millisecond (docs/accuracy/index.md, "Overheads").  Useful tokens: the ``attention_mask`` sum of every micro-batch
(``input_ids`` size without a mask).  Nothing the trainer computes is changed.
"""
from __future__ import annotations

from transformers import TrainerCallback

from batchlab.experiment.observed import Settings, Source
from batchlab.integrations.callback import NotebookCallback
from batchlab.integrations.mapping import hf_checkpointing, run_config
from batchlab.config.phase import Phase


def _precision(args) -> str:
    return "bf16-mixed" if args.bf16 else "fp16-mixed" if args.fp16 else "fp32"


def _model_text(model) -> str:
    cfg = getattr(model, "config", None)
    shape = (f" ({cfg.model_type}, {getattr(cfg, 'num_hidden_layers', '?')} layers, "
             f"hidden {getattr(cfg, 'hidden_size', '?')})") if cfg is not None else ""
    return type(model).__name__ + shape


class BatchlabCallback(NotebookCallback, TrainerCallback):
    def __init__(self, notebook=None, predict: bool = True, warmup: int = 2, note: str = "",
                 memory_every: int | None = None):
        super().__init__(notebook, predict, warmup, note, memory_every)
        self._hooks: list = []
        self._model = self._optimizer = None

    # -- hooks on the model: phase marks and token counts, no change to inputs or outputs
    def _pre_forward(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and getattr(ids, "dim", lambda: 0)() == 2:
            self._seq = int(ids.shape[1])
        mask = kwargs.get("attention_mask")
        if self.watch is not None and self.watch.in_update:
            self.watch.mark(Phase.FORWARD)
            if mask is not None:
                self.watch.count_tokens(mask.detach().sum())
            elif ids is not None:
                self.watch.count_tokens(ids.numel())

    def _post_forward(self, module, args, kwargs, output) -> None:
        if self.watch is not None:
            self.watch.mark(Phase.BACKWARD)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._model, self._optimizer = model, optimizer
        self.watch = self._watch(model, optimizer, args.device)
        self._hooks = [model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                       model.register_forward_hook(self._post_forward, with_kwargs=True)]

    def on_step_begin(self, args, state, control, **kwargs):
        if self.watch is not None:
            self.watch.begin()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.watch is not None:
            self.watch.mark(Phase.OPTIMIZER)

    def on_step_end(self, args, state, control, **kwargs):
        if self.watch is not None:
            self.watch.end()

    def settings(self, args) -> Settings:
        model = self._model
        gc = bool(getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing
                  or hf_checkpointing(model))
        # transformers 5 activation_checkpointing_kwargs (gradient_checkpointing_kwargs its alias before)
        kw = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs or {}
        return Settings(micro_batch=args.per_device_train_batch_size, accum=args.gradient_accumulation_steps,
                        world_size=args.world_size, precision=_precision(args), gradient_checkpointing=gc,
                        checkpoint_every=int(kw.get("every_n_layers", 1)),
                        seq=self._seq, model=_model_text(model), device=str(args.device),
                        optimizer=type(getattr(self._optimizer, "optimizer", self._optimizer)).__name__)

    def on_train_end(self, args, state, control, **kwargs):
        if self.watch is None:
            return
        for h in self._hooks:
            h.remove()
        s = self.settings(args)
        hf = self._model.config.to_dict() if getattr(self._model, "config", None) is not None else None
        inner = getattr(self._optimizer, "optimizer", self._optimizer)
        momentum = (inner.defaults.get("momentum") if inner is not None else None)
        cfg, unmapped = run_config(s, hf, momentum=momentum)
        self._finish(Source.TRANSFORMERS, s, cfg, unmapped)
