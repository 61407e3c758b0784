"""The host around a measuring process's timed updates: the heap pre-touched once (host/regime.py), the speed
probe read before each update on CPU (host/speed.py), and the page faults each update took.

    around = TimedUpdates(speed_probe=device.type == "cpu")   # after warmup, before the first timed update
    for _ in range(steps):
        around.read_probe()             # before the update's clocks start
        with around.counting():
            ...one timed update...
    around.page_faults_per_update(), around.probe_seconds
"""
from __future__ import annotations

from batchlab.host import regime


class TimedUpdates:
    """``speed_probe``: read the speed probe before each update (CPU: which of the host's speeds it ran at);
    ``pretouch``: touch the heap's unused top first (batchlab's own measuring processes; never the user's own
    process, whose allocator stays as it is)."""

    def __init__(self, speed_probe: bool, pretouch: bool = True):
        self.faults = regime.Faults()
        if pretouch:
            regime.pretouch()  # the heap a long run has grown into: no fault bursts in the timed updates
        if speed_probe:
            from batchlab.host.speed import SpeedProbe

            self._probe: SpeedProbe | None = SpeedProbe()  # built after the pre-touch: it allocates ~12 MiB once
        else:
            self._probe = None
        self.probe_seconds: list[float] = []

    def read_probe(self) -> None:
        if self._probe is not None:
            self.probe_seconds.append(self._probe.read())

    def counting(self):
        """``with around.counting(): update()``: the minor page faults of that update."""
        return self.faults.counting()

    def page_faults_per_update(self) -> float:
        """The median over the updates counted: 0 in the steady regime after warmup."""
        return self.faults.per_update()
