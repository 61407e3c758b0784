"""The calculator's stated assumptions (RunConfig.assumptions): fractions, margins and versions a user may
override; None means the model's own figure.  Pure Python."""
from __future__ import annotations

import re
from dataclasses import dataclass

from batchlab.config.choices import ConfigError
from batchlab.config.values import finite_number, flag


@dataclass(frozen=True)
class Assumptions:
    """The calculator's stated assumptions (printed with every estimate)."""

    # of peak FLOP/s reached by real kernels (HFU-like); None: the device's published default (formula/efficiency.py)
    achievable_fraction: float | None = None
    comm_overlap: float | None = None  # fraction of communication hidden; None: the engine's overlap model
    # a fixed caching-allocator slack on top of tensor bytes; None: formula/allocator.py's model of it
    allocator_margin: float | None = None
    optimizer_bytes_per_param: float | None = None  # overrides the optimizer's own state size
    op_overhead_seconds: float | None = None  # fixed cost per op (dispatch/launch); None: the backend's default
    # False: the loop zeroes .grad in place (zero_grad(set_to_none=False): PyTorch < 2.0's default, and what
    # Hugging Face's Trainer called then), so last update's gradients are live through forward
    zero_grad_set_to_none: bool = True
    # "MAJOR.MINOR" of the PyTorch the run used, where older autograd formulas or pipeline schedules kept more;
    # None: a current one
    torch_version: str | None = None

    def torch_before(self, major: int, minor: int) -> bool:
        """The run's PyTorch is older than MAJOR.MINOR (False when no version is given: a current one)."""
        if self.torch_version is None:
            return False
        have = tuple(int(x) for x in self.torch_version.split("."))
        return have < (major, minor)

    def __post_init__(self):
        for name, lo, hi in (("achievable_fraction", 0.0, 1.0), ("comm_overlap", 0.0, 1.0),
                             ("allocator_margin", 0.0, 1.0)):
            v = getattr(self, name)
            if v is None:
                continue
            if not isinstance(v, (int, float)) or not (lo <= v <= hi) or (name == "achievable_fraction" and v == 0):
                raise ConfigError(name, f"must be a fraction in ({lo}, {hi}], got {v!r}")
        if self.optimizer_bytes_per_param is not None:
            finite_number("optimizer_bytes_per_param", self.optimizer_bytes_per_param, minimum=0, maximum=1e6)
        if self.torch_version is not None and not isinstance(self.torch_version, str):  # TOML reads 2.10 as 2.1
            quote = 'quote it, e.g. "2.10"' if isinstance(self.torch_version, float) else 'a string MAJOR.MINOR, e.g. "2.10"'
            raise ConfigError("torch_version", f"{quote} (got {self.torch_version!r}, not a string)")
        if self.torch_version is not None and not re.fullmatch(r"\d+\.\d+", self.torch_version):
            raise ConfigError("torch_version", f"must be MAJOR.MINOR such as 1.10, got {self.torch_version!r}")
        flag("zero_grad_set_to_none", self.zero_grad_set_to_none)
        if self.op_overhead_seconds is not None and not (
                0 <= finite_number("op_overhead_seconds", self.op_overhead_seconds, minimum=0) < 1):
            raise ConfigError("op_overhead_seconds", f"must be seconds in [0, 1), got {self.op_overhead_seconds!r}")
