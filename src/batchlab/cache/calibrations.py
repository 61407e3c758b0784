"""The calibration cache: one JSON file per device, torch version and thread count under platformdirs' user cache
dir.  Read by the formula's callers, who pass what it holds to the calculator (formula/calibration.py keeps the
record and its checks; the calculator never reads a file).  Torch-free."""
from __future__ import annotations

import functools
import json
import os
import re
import sys
from pathlib import Path

from batchlab.formula.calibration import Calibration, check, drop_implausible_parts, loaded
from batchlab.host import PROBE_BUNDLE, cpu_hardware
from batchlab.util.files import write_atomic


def cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("batchlab")) / "calibration"


def default_threads() -> int:
    """The intra-op threads a torch process here starts with (OMP_NUM_THREADS, else the CPU count)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return os.cpu_count() or 1


def _file_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def _cache_path(device: str, torch_version: str, threads: int) -> Path:
    return cache_dir() / (_file_name(f"{device}-torch{torch_version}-{threads}threads") + ".json")


def lock_path(device: str, threads: int) -> Path:
    """The file one process locks while it measures ``device``'s calibration at ``threads`` (calibrate/run.py
    ``measuring``); a dot-file, never read as a calibration."""
    return cache_dir() / ("." + _file_name(f"{device}-{threads}threads") + ".lock")


def save(cal: Calibration) -> Path:
    path = _cache_path(cal.device, cal.torch_version, cal.threads)
    write_atomic(path, json.dumps(cal.to_dict(), indent=2), "calibration")  # two writers at once: no half file
    return path


def load_cached(device_name: str, threads: int | None = None) -> Calibration | None:
    """The cached calibration for a batchlab device name (``RunConfig.device``) at ``threads`` (default: what
    a process here starts with), or None.  CPU rates depend on the thread count, so only an entry measured
    with the same count serves; a CPU entry measured on other hardware (a shared home directory) is ignored.
    """
    # only that device's files (any torch version): the other devices' are neither read nor parsed
    files = cache_dir().glob(f"{_file_name(device_name)}-torch*.json")
    return _load(files, threads).get(device_name, say_loaded=False)  # its callers decide whether to measure again


class Cached(dict):
    """``load_all``'s answer: the usable calibrations by device name, and those refused by their checks, said once on
    stderr when a caller asks for that device (an estimate for an H100 says nothing of a refused CPU file); one
    measured under load is used, and said once too (``formula.calibration.loaded``)."""

    def __init__(self, usable: dict[str, Calibration], refused: dict[str, tuple[str, int, str]]):
        super().__init__(usable)
        self.refused = refused

    def get(self, device, default=None, say_loaded: bool = True):
        if device not in self and device in self.refused:
            _say_ignored(*self.refused[device])
        cal = super().get(device, default)
        if say_loaded and isinstance(cal, Calibration) and loaded(cal):
            _say_loaded(device, cal.measured_at, cal.other_cores)
        return cal


def load_all(threads: int | None = None) -> Cached:
    """Every usable cached calibration, by batchlab device name: what ``formula.estimate`` is given.
    Where one device has several (torch versions), the newest measurement wins.  One that fails its checks
    (``check``) is left out: the caller measures a fresh one and overwrites it, or prices with nominal rates."""
    return _load(cache_dir().glob("*.json"), threads)


def _load(files, threads: int | None) -> Cached:
    want = default_threads() if threads is None else threads
    usable, refused = [], {}
    for path in sorted(files):
        cal = _read(path)
        if cal is None or (cal.torch_device.startswith("cpu") and cal.threads != want):
            continue
        if dropped := drop_implausible_parts(cal):
            _say_dropped(str(path), path.stat().st_mtime_ns, "; ".join(dropped[:2]))
        bad = check(cal)
        if bad:
            refused[cal.device] = (str(path), path.stat().st_mtime_ns, "; ".join(bad[:2]))
        else:
            usable.append(cal)
    return Cached({cal.device: cal for cal in sorted(usable, key=lambda c: c.measured_at)}, refused)


def probe_reference(threads: int | None = None) -> float | None:
    """The host speed probe's read in this CPU's cached calibration at ``threads`` (seconds, host/speed.py);
    None without one, or where it timed another bundle (its reference says nothing about this one)."""
    cal = load_cached("cpu", threads)
    return cal.probe_seconds if cal is not None and cal.probe == PROBE_BUNDLE and cal.probe_seconds else None


def _read(path: Path) -> Calibration | None:
    """The calibration in ``path``; None where it is unreadable or from another CPU."""
    try:
        cal = Calibration.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, RecursionError):
        return None
    if cal.torch_device == "cpu" and not cal.hardware.startswith(cpu_hardware()):
        return None
    return cal


@functools.cache
def _say_ignored(path: str, mtime: int, why: str) -> None:
    # once per file version and process: load_all is read by every estimate of a sweep
    print(f"warning: ignored the cached calibration {path}: {why}; it is measured again where needed "
          "(`batchlab calibrate`), nominal rates meanwhile", file=sys.stderr)


@functools.cache
def _say_dropped(path: str, mtime: int, why: str) -> None:
    print(f"warning: left out implausible parts of the cached calibration {path}: {why}; they are measured again by "
          "the next measure or compare, the time model prices without them meanwhile", file=sys.stderr)


@functools.cache
def _say_loaded(device: str, measured_at: str, other_cores: float) -> None:
    # once per calibration and process: its every rate holds the load, so every time prediction made with it does
    print(f"warning: the cached calibration of {device} was measured at {measured_at} while other processes kept "
          f"{other_cores:.1f} core(s) busy: its time predictions carry that load; run `batchlab calibrate` on a "
          "quieter machine to measure it again", file=sys.stderr)
