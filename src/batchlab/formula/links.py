"""The links a layout's messages cross, as each message on them is priced (no torch): the device entry's links, or
on a CPU host gloo's link between local processes as calibrated, and that link as ranks time-sharing the cores meet
it.  Data-, tensor- and pipeline-parallel messages of a CPU layout are priced on the same one."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from batchlab.config import Backend, RunConfig
from batchlab.formula.opcost import OpCosts, interpolate
from batchlab.formula.sharding import collective_seconds, ring_messages


COLD_GAP_S = 0.015  # the compute before each all-reduce the link calibration times (calibrate/link.py BURST_S)
CHAIN_BYTES = 2**14  # the all-reduce calibrate/chain.py chains: small, its per-message cost


@dataclass(frozen=True)
class Link:
    """A link as a message on it is priced: bytes over its bandwidth plus a fixed cost per message (nccl-tests'
    alpha-beta model); ``source`` names where the figures come from."""

    bytes_per_s: float
    latency_s: float
    source: str
    # gloo has no reduce-scatter of its own: ProcessGroupGloo::reduce_scatter_tensor_coalesced clones the input,
    # all-reduces the whole clone and copies this rank's chunk out (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp)
    reduce_scatter_all_reduces: bool = False

    def runs_as(self, kind: str) -> str:
        """The collective the link's backend runs for ``kind``."""
        return "all_reduce" if kind == "reduce_scatter" and self.reduce_scatter_all_reduces else kind

    def collective_seconds(self, kind: str, nbytes: float, n: int) -> float:
        """One ring collective over ``n`` ranks (as the backend runs it, ``runs_as``): its share of the buffer over
        the link, one latency per message."""
        kind = self.runs_as(kind)
        return collective_seconds(kind, nbytes, n, self.bytes_per_s) + ring_messages(kind, n) * self.latency_s

    def send_seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    def time_shared(self, factor: float, cpu: Mapping[str, float] | None = None) -> Link:
        """The link as ranks time-sharing the cores (``factor`` threads a core) meet it, calibrated with a core
        each.  A message's time is the ranks' own CPU work (wake-ups, syscalls, copies), which runs at 1/factor of
        a core, and waiting for the peer, during which the other ranks use the core (processor sharing): only the
        CPU part stretches, ``cpu`` seconds of it per message ("message") and per byte ("byte") as
        calibrate/shared_link.py measures them (at most the link's own figure); unmeasured, all of it."""
        if factor <= 1.0:
            return self
        message, byte = (self.latency_s, 1 / self.bytes_per_s) if not cpu else (
            min(cpu.get("message", self.latency_s), self.latency_s), min(cpu.get("byte", 0.0), 1 / self.bytes_per_s))
        how = (f"its CPU part ({message * 1e6:.0f} us a message, {byte * 1e9:.2f} ns a byte, calibrated)"
               if cpu else "all of it")
        return Link(1 / (1 / self.bytes_per_s + byte * (factor - 1)), self.latency_s + message * (factor - 1),
                    f"{self.source}; {how} x{factor:g} with the local ranks time-sharing the cores",
                    self.reduce_scatter_all_reduces)

    def after_gap(self, warm_latency_s: float, gap_s: float) -> Link:
        """The link as a message meets it ``gap_s`` after the previous one: the calibrated per-message cost holds
        after a step's compute (``COLD_GAP_S``: gloo's threads asleep, the peer arriving apart), back to back it is
        ``warm_latency_s``; between, in proportion to the gap (0 warm: as calibrated)."""
        if not warm_latency_s or warm_latency_s >= self.latency_s:
            return self
        latency = warm_latency_s + (self.latency_s - warm_latency_s) * min(1.0, max(0.0, gap_s) / COLD_GAP_S)
        return Link(self.bytes_per_s, latency, f"{self.source}; {latency * 1e6:.0f} us a message "
                    f"{gap_s * 1e3:.2g} ms after the last ({warm_latency_s * 1e6:.0f} us back to back, calibrated)",
                    self.reduce_scatter_all_reduces)

    def in_chain(self, chain: Mapping[str, float], warm_latency_s: float, gap_s: float) -> Link:
        """The link as a chain of collectives ``gap_s`` apart pays each (calibrate/chain.py: the mean of chained
        all-reduces of ``CHAIN_BYTES`` between 2 ranks at a few gaps, ``{gap: s}``, its heavy tail included):
        per message, the figure at ``gap_s`` (linear between the measured gaps, the nearest beyond them) less its
        bytes, over its 2 messages, and never below ``after_gap``'s price from the medians of single calls (a
        mean over a tail is no less than the median); ``after_gap`` where nothing was measured."""
        single = self.after_gap(warm_latency_s, gap_s)
        points = tuple(sorted((float(g), s) for g, s in chain.items()))
        if not points:
            return single
        latency = max(0.0, interpolate(points, gap_s) - CHAIN_BYTES / self.bytes_per_s) / 2
        if latency <= single.latency_s:
            return single
        return Link(self.bytes_per_s, latency, f"{self.source}; as a chain of them pays it: {latency * 1e6:.0f} us "
                    f"a message {gap_s * 1e3:.2g} ms after the last (the mean of chained calls, calibrated)",
                    self.reduce_scatter_all_reduces)

    def text(self) -> str:
        return f"{self.bytes_per_s / 1e9:g} GB/s + {self.latency_s * 1e6:.0f} us per message ({self.source})"


def local_link(cfg: RunConfig, costs: OpCosts | None) -> Link | None:
    """CPU ranks all on this host with gloo's link between local processes calibrated (calibrate/link.py)."""
    if (costs is None or costs.link_bytes_per_s is None or cfg.device_spec.backend is not Backend.CPU
            or cfg.parallel.world_size < 2):
        return None
    return Link(costs.link_bytes_per_s, costs.link_latency_s,
                "gloo's all-reduce between local processes right after compute, calibrated; a reduce-scatter runs "
                "as an all-reduce of its whole input", reduce_scatter_all_reduces=True)


def _device_link(cfg: RunConfig, costs: OpCosts | None, ranks: int) -> Link:
    """The calibrated local link, else the device entry's link for a group of ``ranks``: intra-node while they fit
    one node."""
    local = local_link(cfg, costs)
    if local is not None:
        return local
    dev = cfg.device_spec
    if ranks <= dev.gpus_per_node:
        return Link(dev.intra_node_bytes_per_s, 0.0, f"{dev.name}'s intra-node link, no per-message cost known")
    return Link(dev.inter_node_bytes_per_s, 0.0, f"{dev.name}'s inter-node link, no per-message cost known")


def tp_link(cfg: RunConfig, costs: OpCosts | None = None) -> Link:
    return _device_link(cfg, costs, cfg.tp)


def pp_link(cfg: RunConfig, costs: OpCosts | None = None) -> Link:
    return _device_link(cfg, costs, cfg.parallel.world_size)  # a stage boundary may cross nodes


def shared(cfg: RunConfig, costs: OpCosts | None, link: Link, time_shared: float) -> Link:
    """``link`` as the ranks meet it mid-update: a local link stretched by the cores' time-sharing."""
    if local_link(cfg, costs) is None:
        return link
    return link.time_shared(max(1.0, time_shared), costs.link_cpu_seconds or None)


def dp_link(cfg: RunConfig, costs: OpCosts | None, time_shared: float) -> Link | None:
    """The local link the data-parallel ring of CPU ranks crosses, as they meet it (``shared``); None off a CPU
    host's calibrated link (the device entry's bus bandwidth prices it: formula/timing.py)."""
    local = local_link(cfg, costs)
    return None if local is None else shared(cfg, costs, local, time_shared)
