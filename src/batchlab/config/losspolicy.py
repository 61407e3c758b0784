"""The loss path a run takes over the vocabulary (formula/loss.py counts what each keeps).  Pure Python."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from batchlab.config.choices import ConfigError, LossMode


@dataclass(frozen=True)
class LossPolicy:
    """The loss path: ``full``, ``chunked`` / ``chunked:N`` (N token chunks, default 8 as torchtune's
    CEWithChunkedOutputLoss), ``fused`` (a fused cross-entropy kernel; with --impl megatron Megatron's
    --cross-entropy-loss-fusion), ``fused-linear`` (the LM head and the loss in one chunked kernel, Liger's),
    ``compiled`` (the full loss under torch.compile) or ``classifier`` (no LM head: a pooled sequence classifier);
    the last four formula only."""

    mode: LossMode = LossMode.FULL
    chunks: int = 1

    def __post_init__(self):
        object.__setattr__(self, "mode", LossMode.parse("loss", self.mode))
        if self.chunks < 1 or (self.mode is not LossMode.CHUNKED and self.chunks != 1):
            raise ConfigError("loss", "N in chunked:N must be >= 1, and only chunked takes it")

    @classmethod
    def parse(cls, value: Any) -> "LossPolicy":
        if isinstance(value, LossPolicy):
            return value
        text = str(value).strip().lower()
        m = re.fullmatch(r"chunked(?::(\d+))?", text)
        if m:
            return cls(LossMode.CHUNKED, int(m.group(1) or 8))
        try:
            return cls(LossMode(text))
        except ValueError:
            raise ConfigError("loss", f"{value!r} is not one of: full, chunked, chunked:N, fused, fused-linear, compiled, classifier") from None

    def __str__(self) -> str:
        return f"chunked:{self.chunks}" if self.mode is LossMode.CHUNKED else self.mode.value
