"""Declared inputs for models that are not language models: ``image:3x224x224`` (optionally
``image:3x224x224:classes=10``) or ``tokens:VOCAB``, turned into the harness's batch maker.

A factory may return ``(model, "image:3x32x32:classes=10")`` instead of a batch function; each sample is then
one image and one class id, and the useful count the harness reports per second is samples, not tokens.
"""
from __future__ import annotations

import re

import torch

from batchlab.config import ConfigError, DataKind
from batchlab.models import BatchMaker, synthetic_tokens

_IMAGE = re.compile(r"image:(\d+(?:x\d+)*)(?::classes=(\d+))?")
_TOKENS = re.compile(r"tokens:(\d+)")


def batch_maker(spec: str) -> BatchMaker:
    """The batch maker an input spec declares; ConfigError (field model) for anything else."""
    text = spec.strip().lower()
    if m := _TOKENS.fullmatch(text):
        return synthetic_tokens(int(m.group(1)), DataKind.FIXED)
    m = _IMAGE.fullmatch(text)
    if not m:
        raise ConfigError("model", f"input spec {spec!r}: expected image:CxHxW[:classes=N] or tokens:VOCAB")
    shape = tuple(int(d) for d in m.group(1).split("x"))
    classes = int(m.group(2) or 10)

    def make(gen: torch.Generator, micro_batch: int, seq: int, device: torch.device):
        # seq does not apply to images: each sample is one image and one class id
        images = torch.randn((micro_batch, *shape), generator=gen)
        labels = torch.randint(0, classes, (micro_batch,), generator=gen)
        return images.to(device), labels.to(device)

    return make
