"""The host allocator regime batchlab's own measuring processes run in: freed memory kept, as a GPU's caching
allocator keeps it.

glibc's malloc returns freed memory to the OS (blocks above the mmap threshold are unmapped on free; the heap top
is trimmed past the trim threshold), so a training step that frees its activations in backward maps the same memory
again in the next forward: thousands of minor page faults per update on the built-in tiny model (docs/cpu.md), a
cost per fault that depends on the host (a VM's nested paging), not on the ops.  With the three variables below
glibc keeps what it once mapped (no mmap per block, no trimming), and after warmup the measuring process touches
the heap's unused top once (``pretouch``: the heap's slow growth as glibc's free lists fragment), so the timed
updates fault no pages in: the steady state a long training run reaches, and the state the per-op model's
calibration is timed in.  glibc reads the variables at process start (``mallopt(3)`` names: M_MMAP_THRESHOLD,
M_TRIM_THRESHOLD, M_TOP_PAD), so they go into the environment of the processes batchlab starts (the isolated
worker, torchrun's ranks, the calibration); the user's own process (``batchlab.observe``, the integrations) is
never changed.  Other allocators (musl, macOS, a preloaded jemalloc or tcmalloc) ignore the variables: the regime
is then the platform's own, and said so.
Pure Python, no torch.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import resource
import statistics
import sys
from pathlib import Path

# glibc's environment names of the mallopt parameters (the trailing underscore is glibc's spelling)
STEADY_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(4 * 2**30),  # blocks up to 4 GiB come from the heap, not a fresh mmap each
    "MALLOC_TRIM_THRESHOLD_": str(64 * 2**30),  # the heap top is never returned to the OS
    "MALLOC_TOP_PAD_": str(256 * 2**20),  # the heap grows in 256 MiB steps (fewer brk calls while warming)
}
_PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")


def allocator() -> str:
    """Which malloc this process uses: "glibc", or what else (a preloaded allocator, musl, the platform's)."""
    loaded = started_with().get("LD_PRELOAD", "") + _maps()
    for name in _PRELOADED:
        if name in loaded:
            return name
    libc, _ = platform.libc_ver()
    return "glibc" if libc == "glibc" else (libc or platform.system() or "unknown")


def _maps() -> str:
    """The libraries mapped into this process (a preloaded allocator shows here); "" off Linux."""
    try:
        return Path("/proc/self/maps").read_text()
    except OSError:
        return ""


def steady_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a child batchlab starts to measure in: the steady regime's variables added (values the
    caller set itself are kept: theirs is the regime then, and ``describe`` reports it)."""
    out = dict(env)
    for k, v in STEADY_ENV.items():
        out.setdefault(k, v)
    return out


def started_with() -> dict[str, str]:
    """The environment this process started with, which is what glibc read: /proc/self/environ on Linux (a
    variable put into os.environ later changes nothing for this process); os.environ elsewhere."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return dict(os.environ)
    return dict(p.split("=", 1) for p in raw.decode(errors="replace").split("\0") if "=" in p)


def in_effect(env: dict[str, str] | None = None) -> bool:
    """Whether a process started with ``env`` (default: this one's own start) keeps freed memory: glibc, and
    the variables at (or beyond) the steady values."""
    env = started_with() if env is None else env
    try:
        return allocator() == "glibc" and all(int(env.get(k, "0")) >= int(v) for k, v in STEADY_ENV.items())
    except ValueError:
        return False


def missing() -> bool:
    """glibc, but this process started without the regime: a process started with ``steady_env`` would have it
    (under another allocator no child would)."""
    return allocator() == "glibc" and not in_effect()


def restart_in_regime() -> str | None:
    """Start this script again in the steady regime where it lacks it and a start with ``steady_env`` would have it
    (glibc reads it at start; children inherit it); returns what to tell the user where it cannot be had: another
    allocator, or the user's own MALLOC_* values below the steady ones (theirs are kept, never overridden, so a
    restart would not help: it is not tried again and again)."""
    env = steady_env(dict(os.environ))
    if missing() and in_effect(env):
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if missing():
        return f"measured without the steady allocator regime: {describe(env)} (this environment's MALLOC_* values)"
    return warning()


def describe(env: dict[str, str] | None = None) -> str:
    """One line for a report's "how measured": the allocator and whether freed memory is kept."""
    name = allocator()
    if in_effect(env):
        return "allocator: glibc, freed memory kept (no page faults after warmup)"
    if name == "glibc":
        return ("allocator: glibc defaults, freed memory returned to the OS (pages faulted in again each update; "
                "its cost depends on the host)")
    return f"allocator: {name} (its own policy; batchlab's steady glibc regime does not apply)"


def warning() -> str | None:
    """What to tell the user where batchlab cannot set the steady regime for its measuring processes."""
    name = allocator()
    if name == "glibc":
        return None
    return (f"host allocator is {name}, not glibc: measured CPU update times include its own page-fault "
            "policy; the time model's calibration ran under the same allocator")


class _MallInfo2(ctypes.Structure):  # glibc >= 2.33 mallinfo2(3): every field a size_t
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def pretouch() -> int:
    """Fault in the heap's unused top (glibc's reserve of up to MALLOC_TOP_PAD_ past the high-water mark) once,
    after warmup, in a process started in the steady regime; returns the bytes touched (0 elsewhere).

    Why: freed memory kept is not yet a heap that no longer grows.  glibc's free lists fragment over the first
    hundreds of updates, so the heap's high-water mark creeps up (tens of MiB, then flat: docs/cpu.md), and
    each creep faults ~1,000 fresh pages into one update.  A long run has paid those faults; touching the top
    now makes the measured updates see that state.  Kept resident (trim threshold 64 GiB): up to 256 MiB RSS."""
    if not in_effect():
        return 0
    try:
        libc = ctypes.CDLL(None)
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):  # glibc before 2.33: left as it is
        return 0
    mallinfo2.restype = _MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    top = mallinfo2().keepcost - 4096  # the top chunk, less its header and the page glibc keeps
    block = libc.malloc(top) if top > 0 else None
    if not block:
        return 0
    ctypes.memset(block, 0, top)
    libc.free(block)  # back into the top chunk, not trimmed: its pages stay mapped
    return top


def minor_faults() -> int:
    """Minor page faults of this process so far (getrusage; 0 where the platform does not count them)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Faults:
    """Minor page faults per timed update: ``with faults.counting(): update()`` for each, then ``per_update()``."""

    def __init__(self):
        self.counts: list[int] = []

    @contextlib.contextmanager
    def counting(self):
        f0 = minor_faults()
        yield  # an update that raised is not counted (nor timed)
        self.counts.append(minor_faults() - f0)

    def per_update(self) -> float:
        """The median over the timed updates (the heap's rare growth past its high-water mark aside): host
        pages mapped afresh by a typical update, 0 in the steady regime after warmup; 0 with none timed."""
        return statistics.median(self.counts) if self.counts else 0
