"""The local torch device a config runs on (validated: one user line when it is absent), and the batchlab
catalogue entry a local torch device stands for.  Every torch-side caller (harness, session, DDP ranks,
trace, calibrate) goes through here; what the host is, without torch, is batchlab.host.
"""
from __future__ import annotations

import torch

from batchlab.config import ConfigError, RunConfig, catalogue_key

ALLOWED = "cpu, cuda, cuda:N, mps"


def torch_device(cfg: RunConfig, requested: str | None = None) -> torch.device:
    """``requested`` (cpu / cuda / cuda:1 / mps), else the backend of the config's device entry; a device
    this machine lacks is a ConfigError on ``torch_device`` (requested) or ``device`` (the config's)."""
    if requested:
        return usable(requested, "torch_device", estimate_with=cfg.device)
    return usable(cfg.device_spec.backend.value, "device", backend_of=cfg.device, estimate_with=cfg.device)


def usable(name: str, field: str = "torch_device", *, backend_of: str | None = None,
           estimate_with: str | None = None) -> torch.device:
    """The torch device ``name`` if this machine has it.  For the message: ``backend_of``, the batchlab
    device whose backend ``name`` is; ``estimate_with``, the device to suggest predicting for instead."""
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(field, f"{name!r} is not a torch device; allowed: {ALLOWED}") from None
    why = f" (the backend of device {backend_of})" if backend_of else ""
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            hint = f", or predict with `batchlab estimate --device {estimate_with}`" if estimate_with else ""
            raise ConfigError(field, f"cuda{why} is not available here (torch {torch.__version__}, "
                                     f"torch.cuda.is_available() is False); measure with --device cpu{hint}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(field, f"{name} does not exist: {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError(field, f"mps{why} is not available here; measure with --device cpu")
    elif dev.type != "cpu":
        raise ConfigError(field, f"{name!r} is not supported; allowed: {ALLOWED}")
    return dev


def catalogue_name(dev: torch.device) -> str:
    """The batchlab device a local torch device stands for: ``cpu``, a catalogue GPU, or the backend."""
    if dev.type == "cpu":
        return "cpu"
    if dev.type == "cuda":
        return catalogue_key(torch.cuda.get_device_name(dev)) or "cuda"
    return dev.type
