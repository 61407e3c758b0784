"""One optimizer update, exactly as a careful training loop does it, with a phase listener told each phase.

Semantics (each pinned by a test): the loss of every micro-batch is summed over tokens and divided by the
useful-token count of the whole update (so accumulated gradients equal the whole batch's gradient, padded
or not); under DDP all but the last micro-batch run in ``no_sync()`` (one all-reduce per update);
gradients are unscaled (fp16) and clipped after accumulation; optimizer, GradScaler and LR scheduler step
once per update.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch

from batchlab.config import ConfigError, Precision, RunConfig, optimizer_spec
from batchlab.measure.device import torch_device
from batchlab.models import Workload, build_workload
from batchlab.models.ac import apply_ac
from batchlab.models.compiled import apply_compile



class PhaseListener(Protocol):
    def mark(self, phase: str) -> None:
        """Called when a phase starts; ``"end"`` when the update is over."""


class _NoListener:
    def mark(self, phase: str) -> None:
        pass


def _autocast_dtype(precision: Precision) -> torch.dtype | None:
    return {Precision.BF16_MIXED: torch.bfloat16, Precision.FP16_MIXED: torch.float16}.get(precision)


def optimizer_class(cfg: RunConfig) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer class and its arguments (ZeroRedundancyOptimizer wraps the same ones), from the catalogue
    entry (config/optimizers.py)."""
    spec = optimizer_spec(cfg.optimizer)
    module, _, name = spec.torch_class.rpartition(".")
    if spec.package and importlib.util.find_spec(spec.package) is None:
        raise ConfigError("optimizer", f"{cfg.optimizer} needs {spec.torch_class} ({spec.package} is not installed "
                                       "here): measure another optimizer, or estimate this one by formula")
    cls = getattr(importlib.import_module(module), name, None)
    if cls is None:
        raise ConfigError("optimizer", f"{cfg.optimizer} needs {spec.torch_class}, which this torch "
                          f"({torch.__version__}) does not have")
    return cls, spec.torch_kwargs


def make_optimizer(cfg: RunConfig, params) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_class(cfg)
    if cfg.optimizer_in_backward:  # each parameter steps in its post-accumulate-grad hook (torchtune)
        from batchlab.measure.inbackward import StepInBackward

        return StepInBackward(cls, kwargs, params)
    return cls(list(params), **kwargs)


@dataclass
class UpdateResult:
    loss: float  # mean token loss of the update (useful tokens only)
    useful_tokens: int  # non-padding tokens this rank processed
    grad_norm: float


class Trainer:
    """Holds model, optimizer, scheduler and scaler for one config; ``update()`` runs one optimizer update."""

    def __init__(self, cfg: RunConfig, device: torch.device | str | None = None, *, workload: Workload | None = None,
                 rank: int = 0, world: int = 1, wrap=None, clip_norm: float | None = 1.0,
                 grads_to_none: bool = True, optimizer=make_optimizer):
        if cfg.precision is Precision.BF16_FSDP:
            raise ConfigError("precision", "bf16-fsdp (FSDP2 MixedPrecisionPolicy) is formula-only for now: measure "
                                           "bf16-mixed or bf16, or run it under FSDP2 with its own policy")
        self.cfg = cfg
        self.device = torch.device(device) if device is not None else torch_device(cfg)
        self.rank, self.world = rank, world
        torch.manual_seed(cfg.seed)
        self.workload = workload or build_workload(cfg)
        model = self.workload.model
        if self.workload.blocks is not None:
            self.wrapped_layers = apply_ac(self.workload.blocks, cfg.ac)
        else:
            self.wrapped_layers = []
        if cfg.precision is Precision.BF16:
            model = model.to(torch.bfloat16)
        model = model.to(self.device)
        model.train()
        # torch.compile after AC wrapping (torchtitan's order): the model or each block, in place; the backend's
        # name, or None (models/compiled.py; the trace's backend only partitions)
        self.compiled = apply_compile(self.workload, cfg.compile, self.device, world, cfg.ac.budget)
        self.raw_model = model
        # wrap: e.g. DDP or FSDP2; receives the model, returns the module to call
        self.model = wrap(model) if wrap is not None else model
        # optimizer(cfg, params): e.g. a ZeroRedundancyOptimizer (distributed.engines)
        self.optimizer = optimizer(cfg, model.parameters())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / 100))
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.precision is Precision.FP16_MIXED)
        # torchtune refuses clip_grad_norm with optimizer_in_bwd: no moment holds every gradient to clip
        self.clip_norm = None if cfg.optimizer_in_backward else clip_norm
        # False under DDP(gradient_as_bucket_view=True): zeroing in place keeps .grad a view of the bucket;
        # set to None, the no_sync micro-batches accumulate into fresh tensors (a second gradient copy)
        self.grads_to_none = grads_to_none
        self.updates_done = 0
        # one generator per rank: each rank sees distinct data, reproducibly
        self.generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + rank)

    # -- pieces, usable on their own (tests, trace)
    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.workload.make_batch(self.generator, self.cfg.micro_batch, self.cfg.seq, self.device)
                for _ in range(self.cfg.accum)]

    def _no_sync(self, last: bool):
        if last or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def _autocast(self):
        dtype = _autocast_dtype(self.cfg.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def _global_useful(self, local: int) -> int:
        if self.world == 1:
            return local
        import torch.distributed as dist

        t = torch.tensor([local], dtype=torch.int64, device=self.device)
        dist.all_reduce(t)
        return int(t.item())

    def reduce_gradients(self) -> None:
        """Gradient communication the wrapper does not do itself (none here: DDP and FSDP2 reduce in backward)."""

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), max_norm)

    def _number(self, t: torch.Tensor) -> float:
        """A scalar tensor's value; the trace overrides this, since fake tensors hold no values."""
        return float(t)

    def update(self, listener: PhaseListener | None = None, micro_batches: int | None = None) -> UpdateResult:
        """One optimizer update over the first ``micro_batches`` of ``batches()`` (default: all, the config's
        accumulation steps)."""
        listener = listener or _NoListener()
        listener.mark("data")
        batches = self.batches()[:micro_batches]
        local_useful = sum(int(self._number((t != -100).sum())) for _, t in batches)
        # DDP averages gradients over ranks, so each rank divides by the per-rank share of the global count.
        norm = self._global_useful(local_useful) / self.world
        total = 0.0
        for i, (tokens, targets) in enumerate(batches):
            last = i == len(batches) - 1
            with self._no_sync(last):
                listener.mark("forward")
                with self._autocast():
                    loss = self.workload.loss_sum(self.model, tokens, targets) / norm
                listener.mark("backward")
                self.scaler.scale(loss).backward()
            total += self._number(loss.detach()) * norm
            del loss
        listener.mark("optimizer")
        result = self._step(total, local_useful)
        listener.mark("end")
        return result

    def _step(self, total: float, local_useful: int) -> UpdateResult:
        """After the update's last backward: gradients reduced, unscaled, clipped; optimizer, scaler, scheduler."""
        self.reduce_gradients()
        self.scaler.unscale_(self.optimizer)
        grad_norm = float("nan")
        if self.clip_norm is not None:
            grad_norm = self._number(self.clip_gradients(self.clip_norm))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=self.grads_to_none)
        self.updates_done += 1
        return UpdateResult(loss=total / max(local_useful, 1), useful_tokens=local_useful, grad_norm=grad_norm)

    def gradients(self, batches=None) -> dict[str, torch.Tensor]:
        """Accumulated gradients of one update's batches, without stepping (for equivalence tests)."""
        batches = batches if batches is not None else self.batches()
        useful = sum(int((t != -100).sum()) for _, t in batches)
        self.optimizer.zero_grad(set_to_none=True)
        for i, (tokens, targets) in enumerate(batches):
            with self._no_sync(i == len(batches) - 1), self._autocast():
                loss = self.workload.loss_sum(self.model, tokens, targets) / useful
            loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in self.raw_model.named_parameters() if p.grad is not None}
        self.optimizer.zero_grad(set_to_none=True)
        return grads

