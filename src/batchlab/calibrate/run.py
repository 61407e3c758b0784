"""Measuring a calibration (``measure``), and measuring it only when the cache has none (``ensure``,
``auto`` for measure and compare)."""
from __future__ import annotations

import datetime as _dt
import os
import statistics
import time

from batchlab import host
from batchlab.calibrate import calls, chain, compiled_rng, dtensor, family, shared_link
from batchlab.calibrate.concurrency import KINDS, Contention
from batchlab.calibrate.dispatch import SAC, DispatchSampler, dispatch_trainers
from batchlab.calibrate.kernels import (CLOCK, GPU_MATMUL_SHAPES, MATMUL_SHAPES, _bmm_curves, _element_seconds,
                                        _matmul_curves, _memory_curve, _sdpa_curves, monotone)
from batchlab.calibrate.link import allreduce_times, ring_fit, warm_latency
from batchlab.cache.calibrations import _cache_path, default_threads, load_cached, lock_path, save
from batchlab.formula.calibration import SCOPES, Calibration, check, loaded, needs
from batchlab.config import ConfigError
from batchlab.util.files import held_lock
from batchlab.host import PROBE_BUNDLE, SpeedProbe


def _hardware(device) -> str:
    import torch

    if device.type == "cpu":
        return f"{host.cpu_hardware()}, {torch.get_num_threads()} threads"
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def measure(torch_device: str = "cpu", seconds: float = 10.0, shapes: tuple[tuple[int, int, int], ...] | None = None,
            threads: int | None = None, rounds: int | None = None, scope: tuple[str, ...] = SCOPES) -> Calibration:
    """Measure what the per-op time model needs (``measure_here``), on CPU in the allocator regime batchlab's
    measuring processes run in (batchlab.host.regime: freed memory kept): in a child process started in it where
    this one is not (this process's allocator is the caller's and stays as it is)."""
    if seconds <= 0:
        raise ConfigError("seconds", f"must be > 0, got {seconds}")
    scope = tuple(k for k in SCOPES if k in scope)
    if torch_device.startswith("cpu") and host.needs_own_process():
        return _in_child(dict(torch_device=torch_device, seconds=seconds, shapes=shapes, threads=threads,
                              rounds=rounds, scope=scope))
    return measure_here(torch_device, seconds, shapes, threads, rounds, scope)


def _in_child(args: dict) -> Calibration:
    """In a fresh process started in the regime, at ``threads`` OpenMP threads from the start, as compare's
    measuring processes are (protocol.threads_env).  Not in a fork of the pre-imported process (host/forkcall.py):
    a fork's first write to each heap page it shares with its parent copies that page, and the element-wise
    kernels' outputs land on such pages, so the bandwidth curve read 0.8-6.6 GB/s at 3-50 MiB in half of the
    forked calibrations against 9.9-14.2 GB/s in fresh processes (docs/cpu.md); the measurements themselves
    break those pages in their warmup updates and are timed after it."""
    import json
    import subprocess
    import tempfile
    from pathlib import Path

    from batchlab.util.lifeline import module_command
    from batchlab.measure.runner import child_env

    start = time.perf_counter()
    env = child_env() | ({"OMP_NUM_THREADS": str(args["threads"])} if args.get("threads") else {})
    with tempfile.TemporaryDirectory(prefix="batchlab-calibrate-") as tmp:
        out = Path(tmp) / "calibration.json"
        proc = subprocess.run(module_command("batchlab.calibrate.child", json.dumps(args), str(out)),
                              env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"calibration process failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        cal = Calibration.from_dict(json.loads(out.read_text()))
    cal.seconds = time.perf_counter() - start  # the cost the caller paid: the child's start-up too
    return cal


def measure_here(torch_device: str = "cpu", seconds: float = 10.0,
                 shapes: tuple[tuple[int, int, int], ...] | None = None, threads: int | None = None,
                 rounds: int | None = None, scope: tuple[str, ...] = SCOPES) -> Calibration:
    """Measure what the per-op time model needs in ``ROUNDS`` rounds, the shares of ``seconds`` adding up to
    ~2x it (each kernel's minimum samples; docs/cpu.md gives a 2-core VM's figure): the matmul curves, fp32
    and bf16 of each shape timed in turns (34% linear layers, 8% attention's batched matmuls, 10% fused
    attention forward and backward, plus what its calls need for ``kernels.SWINGING`` samples each), element-wise bandwidth (12%), per-element kernels (15%), per-op
    dispatch in fp32, under autocast and under selective checkpointing (25%, in ``SLICES`` slices a round),
    on CPU the slowdown of two processes running alike at once (15%, one alternation with each slice, in CPU
    seconds: longer on a loaded machine; plus ~0.3 s a round to start them) and gloo's all-reduce between two
    local processes after compute (10%, plus ~0.4 s a round to start them; the ring model fitted once to the
    rounds' medians).
    ``threads``: the intra-op thread count to measure at (CPU; restored afterwards); ``rounds``: default
    ``ROUNDS`` (1: every kind once, as a quick check needs); ``scope``: which of calibration.SCOPES to measure
    beyond the fp32 kernels and dispatch (default all; each kernel measured is timed as long either way, so a
    smaller scope saves the others' time and changes no figure's sampling).  Without "bf16", "sac" or "ranks"
    the 16-bit kernels and autocast's dispatch, selective checkpointing's dispatch, or the contention and link
    are left out (empty in the record)."""
    import torch

    from batchlab.measure.clock import synchronizer
    from batchlab.measure.device import catalogue_name, usable

    device = usable(torch_device)
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as e:
        raise ConfigError("torch_device", f"{torch_device!r} is not usable here: {e}") from None
    shapes = shapes or (MATMUL_SHAPES if device.type == "cpu" else GPU_MATMUL_SHAPES)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    # one CPU thread: time its CPU seconds (kernels.CLOCK), so other processes' load does not enter the rates
    token = CLOCK.set(time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter)
    try:
        sync = synchronizer(device)
        start = time.perf_counter()
        n, trainers = rounds or ROUNDS, dispatch_trainers(device, _precisions(scope))
        probe = SpeedProbe(CLOCK.get()) if device.type == "cpu" else None
        load = host.LoadSampler(thread=False).start() if device.type == "cpu" else None
        k = _median_rounds([_round(device, shapes, seconds / n, sync, trainers, probe, scope) for _ in range(n)])
        others = load.stop()["other_cores"] if load is not None else None
        fp32, bf16 = monotone(k["fp32"]), monotone(k["bf16"])
        link, latency = ring_fit(k["link"].get("seconds", {}))  # once, to each size's median over the rounds
        assert fp32, "fp32 matmul failed"
        best32, best16 = max(fp32, key=lambda p: p[1]), max(bf16, key=lambda p: p[1]) if bf16 else None
        return Calibration(
            device=catalogue_name(device), hardware=_hardware(device), torch_device=str(device),
            matmul_flops_fp32=best32[1], matmul_flops_bf16=best16[1] if best16 else None,
            memory_bytes_per_s=k["mem"][-1][1], matmul_size={"fp32": int(best32[0]), **({"bf16": int(best16[0])} if best16 else {})},
            copy_bytes=int(k["mem"][-1][0]), threads=torch.get_num_threads(),
            measured_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            torch_version=torch.__version__, seconds=time.perf_counter() - start,
            matmul_curve={"fp32": fp32, **({"bf16": bf16} if bf16 else {}), **{name: monotone(v) for name, v in k["bmm"].items() if v}},
            matmul_start=k["sdpa_start"], matmul_shapes=[list(shape) for shape in shapes],
            memory_curve=k["mem"], memory_curve_bf16=k["mem16"], memory_curve_inplace=k["inplace"],
            strided_bytes_per_s=k["strided"], element_seconds=k["elements"], dispatch_seconds=k["dispatch"]["fp32"],
            dispatch_seconds_autocast=k["dispatch"].get("bf16-mixed", {}),
            loopback_bytes_per_s=link, loopback_latency_s=latency, link=LINK if device.type == "cpu" else "",
            loopback_warm_latency_s=min(latency, warm_latency(k["link"].get("warm"), link)),
            rank_skew=k["link"].get("skew", 0.0),
            cores=os.cpu_count() or 1,
            contention=k["contention"], contention_processes=2 if device.type == "cpu" and "ranks" in scope else 0,
            allocator=host.state() if device.type == "cpu" else "", probe_seconds=k["speed"],
            probe=PROBE_BUNDLE if device.type == "cpu" else "", scope=list(scope),
            other_cores=-1.0 if others is None else round(others, 2))
    finally:
        CLOCK.reset(token)
        torch.set_num_threads(before)


# what the CPU link figures are (calibrate/link.py)
LINK = "gloo all-reduce between 2 local processes after 15 ms of compute, median"

# Every kernel is timed in each of ROUNDS rounds of a third of the budget, and its figure is the median over
# them: a shared host can switch speed within seconds, so one window per kind (the fp32 dispatch in one second,
# the autocast dispatch in the next) made figures a change compares come from different speeds.  The contention
# of two processes can be bimodal for seconds at a time (two vCPUs on separate cores, or on one core's two
# hardware threads), and gloo's all-reduce moves with it; one window read either state (docs/cpu.md).
ROUNDS = 3


SLICES = 5  # the dispatch share of a round is timed in this many slices, one before each of its longer kinds


def _precisions(scope: tuple[str, ...]) -> tuple[str, ...]:
    """The dispatch trainers a scope times (dispatch.dispatch_trainers)."""
    return ("fp32",) + (("bf16-mixed",) if "bf16" in scope else ()) + ((SAC,) if "sac" in scope else ())


def _round(device, shapes, seconds: float, sync, trainers: dict, probe: SpeedProbe | None = None,
           scope: tuple[str, ...] = SCOPES) -> dict:
    """One round of every kernel kind, the shares of ``seconds`` as ``measure_here`` gives them; ``trainers``:
    the dispatch-bound updates (``dispatch_trainers``), built once for every round and timed in ``SLICES``
    slices spread through the round (calibrate/dispatch.py), each slice with one alternation of the two-process
    contention (CPU; calibrate/concurrency.py) and a read of the host speed probe (``speed``: the median of the
    round's reads, so the reference too is the round's speed, not that of its first and last 60 ms).
    ``scope`` (measure_here): each kind timed for as long as with every scope, the skipped ones not at all."""
    import torch

    cpu, low = device.type == "cpu", "bf16" in scope
    ranks = cpu and "ranks" in scope
    sampler, reads = DispatchSampler(trainers, sync), []
    window = 0.15 * seconds / (SLICES * len(KINDS) * 2)  # one kind alone or at once, in one slice
    contention = Contention(2, torch.get_num_threads(), window) if ranks else None
    per_trainer = len(_precisions(scope)) / len(_precisions(SCOPES))  # the updates alternate over the trainers

    def dispatch_slice():
        sampler.run(0.25 * seconds / SLICES * per_trainer)
        if contention is not None:
            contention.alternate()
        if probe is not None:
            reads.append(probe.read())

    # each kernel's precisions timed in turns; the shares are the two precisions' (``per``: one's without bf16)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16} if low else {"fp32": torch.float32}
    per = len(dtypes) / 2
    try:
        dispatch_slice()
        sdpa, sdpa_start = _sdpa_curves(device, dtypes, 0.10 * seconds * per, sync)
        dispatch_slice()
        mem, mem16, inplace, strided = _memory_curve(device, 0.12 * seconds, sync, low)
        dispatch_slice()
        matmul = _matmul_curves(device, dtypes, shapes, 0.34 * seconds * per, sync)
        dispatch_slice()
        bmm = {f"bmm-{name}": curve for name, curve in _bmm_curves(device, dtypes, 0.08 * seconds * per,
                                                                    sync).items()}
        bmm.update(sdpa)
        dispatch_slice()
        elements = _element_seconds(device, 0.15 * seconds, sync, low)
    finally:
        if contention is not None:
            contention.close()
    return dict(fp32=matmul["fp32"], bf16=matmul.get("bf16", []), bmm=bmm, sdpa_start=sdpa_start, mem=mem, mem16=mem16,
                inplace=inplace, strided=strided, elements=elements, dispatch=sampler.seconds(),
                contention=contention.factors() if contention is not None else {},
                link=allreduce_times(0.1 * seconds) if ranks else {},
                speed=statistics.median(reads) if reads else 0.0)


def _median_rounds(rounds: list):
    """The rounds' figures merged: per key of a dict, per size of a (size, figure) curve, the median of the
    rounds that have it (a curve cut short by its budget in one round lacks its largest sizes there)."""
    first = rounds[0]
    if isinstance(first, dict):
        keys = list(dict.fromkeys(key for r in rounds for key in r))
        return {key: _median_rounds([r[key] for r in rounds if key in r]) for key in keys}
    if isinstance(first, list):
        by_size: dict[float, list[float]] = {}
        for curve in rounds:
            for x, y in curve:
                by_size.setdefault(x, []).append(y)
        return [[x, statistics.median(ys)] for x, ys in sorted(by_size.items())]
    return statistics.median(rounds)


def _current(cached: Calibration, wanted: frozenset[str] | set[str] = frozenset(SCOPES)) -> bool:
    """Whether a cached calibration has what today's per-op model prices with, for the ``wanted`` scopes
    (calibration.SCOPES) and those it claims; each older kind is measured again."""
    cpu, has = cached.torch_device.startswith("cpu"), set(cached.scope)
    return (wanted <= has and cached.op_costs() is not None  # the per-op model itself
            and not loaded(cached)  # provisional: measured under others' load (ensure)
            and bool(cached.memory_curve_inplace)  # the step-regime curves (before them: warm loops)
            and "activation/silu:fp32" in cached.element_seconds  # transcendental kernels by name (before: by class)
            # dispatch under selective checkpointing (before: plain)
            and ("sac" not in has or "forward-sac" in cached.dispatch_seconds)
            and bool(cached.matmul_shapes)  # the curve's shapes, which price a call's bytes beyond theirs
            # fused attention's backward on its own curves (before: priced at the forward's rate); a device whose
            # SDPA did not run has neither curve
            and ("sdpa-backward-fp32" in cached.matmul_start or "sdpa-fp32" not in cached.matmul_curve)
            # CPU: the local ranks' contention, the allocator regime (before it: kernels faulted pages in),
            # dispatch under autocast with medians of CPU-time samples (before: fp32 dispatch for every precision,
            # upper quartiles), gloo's all-reduce after compute as the local ranks' link (before: a TCP echo over
            # loopback, then the lower quartile of idle all-reduces), the host speed probe's reference (before it: none)
            and (not cpu or bool(cached.allocator and cached.probe_seconds and cached.probe == PROBE_BUNDLE
                                 and ("bf16" not in has or cached.dispatch_seconds_autocast)
                                 and ("ranks" not in has or (cached.contention_processes and cached.link == LINK)))))


class Rejected(RuntimeError):
    """A calibration measured twice that failed its checks both times (formula.calibration.check): not cached."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems[:3]))


def ensure(torch_device: str = "cpu", threads: int | None = None, seconds: float = 10.0,
           scope: tuple[str, ...] = SCOPES) -> tuple[Calibration, bool]:
    """The cached calibration of a local device at ``threads`` that has the ``scope`` parts (calibration.SCOPES),
    measured and cached first when there is none, only an older kind (``_current``), one that fails its checks
    or one without a part: then every part measured at once (``scope`` and those the cache had), so that figures
    a prediction compares (fp32 against bf16) come from the same rounds.  (calibration, whether it was measured
    now).  Raises ``Rejected`` where the fresh measurement fails its checks twice.  One measured twice under
    other processes' load (calibration.loaded) is cached as provisional: its source says so, and the next
    ``ensure`` measures again, so the load of one moment does not stay in the predictions."""
    want, name = default_threads() if threads is None else threads, _device_name(torch_device)
    cached = load_cached(name, want)
    if cached is not None and _current(cached, set(scope)):
        return cached, False
    with measuring(name, want):
        cached = load_cached(name, want)  # measured by another process while this one waited
        if cached is not None and _current(cached, set(scope)):
            return cached, False
        kept = set(cached.scope) if cached is not None and (loaded(cached) or _current(cached, set())) else set()
        cal = checked(lambda: measure(torch_device, seconds=seconds, threads=want, scope=tuple(set(scope) | kept)))
        save(cal)
    return cal, True


def measuring(device_name: str, threads: int):
    """Held while one process measures a device's calibration at ``threads`` and caches it: two compares started
    together measured side by side, each under the other's load (both provisional), or twice over, and the last to
    save dropped the parts the other had just cached."""
    return held_lock(lock_path(device_name, threads),
                     f"waiting for another batchlab process calibrating {device_name} at {threads} thread(s)")


def measuring_device(torch_device: str, threads: int | None):
    """``measuring`` for a local torch device (``batchlab calibrate``)."""
    return measuring(_device_name(torch_device), default_threads() if threads is None else threads)


def checked(measure_once) -> Calibration:
    """``measure_once()`` and its checks; measured once more where they fail (a burst of load, a curve cut
    short by its budget) or where others' load stretched its wall-clock rates, the less loaded kept;
    ``Rejected`` where the second fails its checks too."""
    first = measure_once()
    first_bad = check(first)
    if not first_bad and not loaded(first):
        return first
    second = measure_once()
    bad = check(second)
    if bad:
        raise Rejected(bad)
    return second if first_bad or second.other_cores <= first.other_cores else first


def _calibrated_line(cal: Calibration) -> str:
    """What a fresh calibration tells the user: where it is cached, or that it is provisional (loaded)."""
    if loaded(cal):
        return (f"time model: calibrated this CPU at {cal.threads} thread(s) twice while other processes kept "
                f"{cal.other_cores:.1f} core(s) busy: its rates carry that load; cached as provisional, measured "
                "again by the next measure or compare")
    return (f"time model: calibrated this CPU once at {cal.threads} thread(s) in {cal.seconds:.1f} s and cached it "
            f"({_cache_path(cal.device, cal.torch_version, cal.threads)}); --no-calibrate skips this")


def _device_name(torch_device: str) -> str:
    """The batchlab device a torch device stands for; "cpu" without importing torch (~2 s a process), which
    finding a cached CPU calibration does not need."""
    if torch_device == "cpu":
        return "cpu"
    from batchlab.measure.device import catalogue_name, usable

    return catalogue_name(usable(torch_device))


def auto(device_name: str, threads: int | None, enabled: bool = True, cfgs: tuple = ()) -> str | None:
    """``measure`` / ``compare`` on this CPU: calibrate once (cached) so their time predictions use measured
    rates, the parts ``cfgs`` need (record.needs: a fp32 single-process compare times no 16-bit kernel and no
    local ranks), and measure once the own dispatch per op of each Hugging Face model among ``cfgs`` (family.py),
    for a tensor-parallel one, DTensor's host cost per op (dtensor.py) and gloo's all-reduce as a chain of them pays it
    (chain.py), for ranks time-sharing the cores the CPU share of gloo's link (shared_link.py), and for a compiled
    one with dropout inductor's in-kernel RNG (compiled_rng.py); a compiled graph's and a checkpoint region's own call where one runs them (calls.py).
    Returns the lines to show the user (None when the cache served, nothing to say)."""
    if device_name != "cpu":
        return None  # GPUs: `batchlab calibrate --torch-device cuda`; the catalogue's figures otherwise
    want = default_threads() if threads is None else threads
    if not enabled:
        cached = load_cached("cpu", want)
        return None if cached is not None else (
            f"time model: not calibrated (--no-calibrate): nominal CPU rates at {want} thread(s)")
    with measuring("cpu", want):  # the parts measured on first use too: each loads, adds to and saves the file
        return _auto(want, cfgs)


def _auto(want: int, cfgs: tuple) -> str | None:
    try:
        cal, fresh = ensure("cpu", threads=want, scope=tuple(set().union(*map(needs, cfgs))))
    except Rejected as e:
        return (f"time model: this CPU's calibration failed its checks twice ({e}); nothing cached, nominal CPU "
                f"rates at {want} thread(s) price the time")
    lines = [_calibrated_line(cal)] if fresh else []
    lines += [line for cfg in dict.fromkeys(cfgs) if (line := family.ensure(cfg, want))]
    # one rate serves every model: a model with dropout times the RNG's too
    drawn = next((cfg for cfg in cfgs if compiled_rng.wanted(cfg)), None) or next(
        (cfg for cfg in cfgs if compiled_rng.compiled_on_cpu(cfg)), None)
    lines += [line for line in (compiled_rng.ensure(drawn, want) if drawn else None,) if line]
    lines += [line for cfg in dict.fromkeys(cfgs) if (line := calls.ensure(cfg, want))]
    lines += [line for line in (dtensor.ensure(cfgs, want), shared_link.ensure(cfgs, want), chain.ensure(cfgs, want))
              if line]
    return "\n".join(lines) or None
