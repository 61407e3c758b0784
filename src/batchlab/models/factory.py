"""A user's own model: ``--model package.module:factory``.

The factory contract
--------------------
``factory(cfg)`` (or ``factory()`` if it takes no argument) is called once, with the RunConfig, and
returns one of:

* ``(model, make_batch)`` or ``(model, "image:3x224x224:classes=10")`` (an input spec, models/inputs.py)
* ``(model, make_batch, loss_sum)``
* a ``batchlab.models.Workload`` (to name the ``blocks`` for activation checkpointing yourself)

where

* ``model`` is a ``torch.nn.Module`` with at least one trainable parameter, built on the CPU (the harness
  moves it to the device).  Without ``loss_sum``, ``model(tokens)`` must return logits of shape
  (micro_batch, seq, vocab) or an object with ``.logits`` (Hugging Face style).
* ``make_batch(generator, micro_batch, seq, device) -> (inputs, targets)``: for a language model two tensors
  of shape (micro_batch, seq); ``targets`` are integer class indices, ``-100`` marking padding (not useful
  tokens, not counted in tokens/s and excluded from the loss).  For any other model (an image classifier)
  ``inputs`` has any shape with micro_batch first and ``targets`` shape (micro_batch,): each sample counts
  once (samples/s) and ``seq`` is ignored.  Draw randomness from ``generator`` only (a seeded
  ``torch.Generator``) so runs are reproducible.
* ``loss_sum(model, tokens, targets)`` returns the **summed** token loss; the harness divides by the
  useful-token count of the whole update, so accumulation gives the whole batch's gradient.
* blocks: with a tuple, ``model.blocks`` is used if it is an ``nn.ModuleList``; ``--ac`` other than
  ``none`` needs blocks.

The model shape fields of the config (layers, hidden, ...) describe the built-in presets; a factory may
read them or ignore them, and the calculator cannot see inside a factory model (``--trace`` can).
"""
from __future__ import annotations

import importlib
import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from batchlab.config import ConfigError, Counted, RunConfig
from batchlab.models import Workload


def _fail(source: str, message: str) -> ConfigError:
    return ConfigError("model", f"factory {source}: {message}")


def load_factory(source: str):
    module_name, _, attr = source.rpartition(":")
    if not module_name or not attr or not module_name.replace(".", "").replace("_", "").isalnum():
        raise ConfigError("model", f"{source!r} is not package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise _fail(source, f"cannot import module {module_name!r}: {e}") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 — the user's module raised (or exited) while importing
        raise _fail(source, f"importing {module_name!r} raised {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise _fail(source, f"module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise _fail(source, f"{attr!r} is of type {type(fn).__name__}, not a callable")
    return fn


def _call(fn, cfg: RunConfig, source: str):
    try:
        takes_cfg = bool(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        takes_cfg = True
    try:
        return fn(cfg) if takes_cfg else fn()
    except ConfigError:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 — reported as the factory's failure (exit 2), field model
        raise _fail(source, f"raised {type(e).__name__}: {e}") from None


def default_loss_sum(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    out = model(inputs)
    logits = getattr(out, "logits", out)
    if targets.dim() > 1:  # one class per token: (b, s, V) logits
        logits, targets = logits.flatten(0, 1), targets.reshape(-1)
    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")


def _as_workload(result, source: str) -> Workload:
    if isinstance(result, Workload):
        return result
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise _fail(source, f"returned {type(result).__name__}; expected (model, make_batch), "
                            "(model, make_batch, loss_sum) or a batchlab.models.Workload")
    model, make_batch = result[0], result[1]
    if isinstance(make_batch, str):
        from batchlab.models.inputs import batch_maker

        make_batch = batch_maker(make_batch)
    loss_sum = result[2] if len(result) == 3 else default_loss_sum
    blocks = getattr(model, "blocks", None)
    return Workload(model=model, blocks=blocks if isinstance(blocks, nn.ModuleList) else None,
                    make_batch=make_batch, loss_sum=loss_sum, description=f"factory {source}")


def _check(wl: Workload, cfg: RunConfig, source: str) -> Counted:
    """Raise on a broken contract; else what one example is (a class per token: tokens; per sample: samples)."""
    if not isinstance(wl.model, nn.Module):
        raise _fail(source, f"the model is of type {type(wl.model).__name__}, not a torch.nn.Module")
    if not any(p.requires_grad for p in wl.model.parameters()):
        raise _fail(source, "the model has no trainable parameters")
    for name in ("make_batch", "loss_sum"):
        if not callable(getattr(wl, name)):
            raise _fail(source, f"{name} is of type {type(getattr(wl, name)).__name__}, not a callable")
    if cfg.ac.recomputes and wl.blocks is None:
        raise ConfigError("ac", f"--ac {cfg.ac} needs the model's layers: give the model a `blocks` "
                                "nn.ModuleList or return a Workload with blocks")
    with torch.device("cpu"):  # a sample batch; on the CPU even when the model is built on the meta device
        try:
            batch = wl.make_batch(torch.Generator().manual_seed(cfg.seed), 1, cfg.seq, torch.device("cpu"))
        except Exception as e:  # noqa: BLE001
            raise _fail(source, f"make_batch(generator, 1, {cfg.seq}, cpu) raised {type(e).__name__}: {e}") from None
    ok = (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)
          and not batch[1].is_floating_point())
    per_token = ok and batch[0].shape == batch[1].shape == (1, cfg.seq)  # a language model: a class per token
    per_sample = ok and batch[1].shape == (1,) and batch[0].dim() >= 1 and batch[0].shape[0] == 1
    if not (per_token or per_sample):
        got = (f"({', '.join(f'{type(t).__name__} {tuple(t.shape)}' if isinstance(t, torch.Tensor) else type(t).__name__ for t in batch)})"
               if isinstance(batch, (tuple, list)) else type(batch).__name__)
        raise _fail(source, f"make_batch must return (tokens, targets), two tensors of shape (micro_batch, seq), "
                            f"or (inputs, targets) with targets of shape (micro_batch,), integer targets; got {got} "
                            f"for micro_batch 1, seq {cfg.seq}")
    return Counted.TOKENS if per_token else Counted.SAMPLES


def build_factory_workload(cfg: RunConfig) -> Workload:
    source = cfg.model_source
    workload = _as_workload(_call(load_factory(source), cfg, source), source)
    workload.counted = _check(workload, cfg, source)
    return workload
