"""How a measurement is taken (not what is measured: that is the RunConfig).  Torch-free."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from batchlab.config import ConfigError


@dataclass(frozen=True)
class MeasureOptions:
    warmup: int = 2  # untimed updates first; >= 1, so the first update (lazy state, first-call costs) is never timed
    steps: int = 5  # timed updates
    isolate: bool = False  # run in a fresh subprocess: a kill or segfault becomes a recorded failure
    memory: bool = True  # one separate, untimed update that measures memory
    timing: bool = True
    timeout_s: float | None = None  # isolated runs only: wall-clock limit of the subprocess
    torch_device: str | None = None  # cpu, cuda, cuda:1, mps; None: the config's device backend
    # FSDP2 (ZeRO-2/3) with accumulation: reduce-scatter after every micro-batch (True, batchlab's choice), or
    # set_requires_gradient_sync(False) on all but the last (an unsharded gradient kept per rank meanwhile)
    fsdp_sync_every_micro_batch: bool = True
    timeline: bool = False  # one more untimed update after warmup, recorded as a memory timeline

    def __post_init__(self):
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 1:
            raise ConfigError("warmup", f"must be a whole number >= 1 (the first update is never timed), "
                                        f"got {self.warmup!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ConfigError("steps", f"must be a whole number >= 1, got {self.steps!r}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError("timeout", f"must be > 0 seconds, got {self.timeout_s!r}")
        if not (self.memory or self.timing):
            raise ConfigError("memory", "nothing to measure: memory and timing are both off")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MeasureOptions":
        return cls(**d)
