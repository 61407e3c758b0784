"""batchlab calibrate: rate arithmetic, the per-device cache, the CPU measurement, auto-calibration and the command."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import time

import pytest
import torch
from typer.testing import CliRunner

from batchlab import calibrate as cal_mod
from batchlab.calibrate import run as run_mod
from batchlab.calibrate import Calibration, auto, ensure, load_all, load_cached, measure, save, timed_rates
from batchlab.cli import app
from batchlab.config import ConfigError, RunConfig
from batchlab.host import cpu_hardware
from batchlab.host.speed import BUNDLE


R = 5e10  # FLOP/s of a flat matmul curve
AUTOCAST = {"forward": 9e-6, "backward": 7e-6, "plain": 3e-6}  # s per op under autocast


def sample(**kw) -> Calibration:
    values = dict(device="cpu", hardware=f"{cpu_hardware()}, 1 threads", torch_device="cpu",
                  matmul_flops_fp32=R, matmul_flops_bf16=4 * R, memory_bytes_per_s=6e9,
                  matmul_size={"fp32": 1024, "bf16": 1024}, copy_bytes=2**28, threads=1,
                  measured_at="2025-01-01T00:00:00+00:00", torch_version=torch.__version__, seconds=9.5,
                  matmul_curve={"fp32": [[1e3, R], [1e12, R]], "bf16": [[1e3, 4 * R], [1e12, 4 * R]]},
                  memory_curve=[[1.0, 6e9], [1e9, 6e9]], strided_bytes_per_s=3e9,
                  element_seconds={"activation:fp32": 2e-9}, dispatch_seconds={"forward": 5e-6, "backward": 4e-6,
                                                                                "plain": 3e-6})
    values.update(kw)
    return Calibration(**values)


def test_timed_rates_divide_work_by_elapsed_time():
    ticks = iter(range(1000))
    clock = lambda: next(ticks) * 0.01  # noqa: E731 — every reading advances 10 ms
    rates = timed_rates(lambda: None, work=100.0, seconds=0.5, sync=lambda: None, clock=clock)
    # warm-up call takes 10 ms -> 2 calls per sample; each sample spans one 10 ms tick
    assert rates and all(r == pytest.approx(100.0 * 2 / 0.01) for r in rates)


def test_variants_are_timed_in_turns_and_a_slow_call_still_gets_its_samples(monkeypatch):
    """On a simulated clock that only the calls advance (the wall-clock budget and the sample clock alike), so
    a loaded machine cannot move what is asserted: the order of the turns, the rates, the samples a slow call
    still gets past its budget."""
    import types

    from batchlab.calibrate import kernels as k

    now = [0.0]
    monkeypatch.setattr(k, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    token = k.CLOCK.set(lambda: now[0])
    log = []

    def kernel(key, seconds):
        def call():
            log.append(key)
            now[0] += seconds
        return call, 1.0

    try:
        rates = k.alternated({"fp32": kernel("fp32", 0.001), "bf16": kernel("bf16", 0.002)}, 0.2, lambda: None,
                             turns=4)
        assert sum(x != y for x, y in zip(log, log[1:])) >= 7  # fp32 bf16 fp32 bf16 ...: four turns each
        assert rates["fp32"] / rates["bf16"] == pytest.approx(2.0)
        log.clear()
        t0 = now[0]
        rates = k.alternated({"fast": kernel("fast", 0.0005), "slow": kernel("slow", 0.03)}, 0.02, lambda: None,
                             at_least=4)
    finally:
        k.CLOCK.reset(token)
    assert log.count("slow") >= 1 + 4  # the warm-up call, then four samples though one call overruns the budget
    assert log.count("fast") < 200  # past the budget, one sample a turn: the fast one does not fill the wait
    assert rates["slow"] == pytest.approx(1 / 0.03) and now[0] - t0 < 0.5


def test_cache_round_trip_per_device_torch_version_and_threads(cache_home):
    cal = sample()
    path = save(cal)
    assert path.is_relative_to(cache_home) and torch.__version__.replace("+", "_") in path.name
    assert load_cached("cpu", threads=1) == cal
    assert load_cached("cpu") == cal  # the suite's processes start with OMP_NUM_THREADS=1
    assert load_cached("cpu", threads=2) is None  # CPU rates scale with threads: no stand-in
    save(sample(threads=2, hardware=f"{cpu_hardware()}, 2 threads", matmul_flops_fp32=2 * R))
    assert load_cached("cpu", threads=2).matmul_flops_fp32 == 2 * R and load_cached("cpu", 1) == cal
    assert "calibrated on" in cal.source and "1 thread(s)" in cal.source and "9.5 s" in cal.source
    assert load_cached("h100-sxm") is None  # never calibrated


def test_cpu_entry_from_other_hardware_and_corrupt_files_are_ignored():
    save(sample(hardware="Some Other CPU, 96 cores, 1 threads"))
    assert load_cached("cpu") is None
    path = save(sample())
    path.write_text("{not json")
    assert load_cached("cpu") is None


def test_ceiling_per_precision_and_a_cache_from_before_the_per_op_model():
    cal = sample()
    assert cal.matmul_flops("fp32") == R
    assert cal.matmul_flops("bf16-mixed") == cal.matmul_flops("bf16") == 4 * R
    assert sample(matmul_flops_bf16=None).matmul_flops("bf16-mixed") == R
    assert sample(matmul_curve={}, dispatch_seconds={}).op_costs() is None  # ensure() measures again


# -- what makes a cache current (calibrate.ensure): calibrate's measuring function replaced by one that counts
# its calls and returns this module's one real calibration (``calibrated``, checked against torch's own
# benchmark below), so each test sees whether a cache is measured again, and with what, without measuring
SIDE = 256  # the matmul the real calibration times (and the benchmark check compares)


@pytest.fixture(scope="module")
def calibrated(real_calibration) -> Calibration:
    """One real CPU calibration at one thread, matmuls of SIDE / 2 and SIDE cubed: one round (~3 s; merging rounds
    is tested by hand below), measured once for the run (tests/conftest.py, test_checks.py asserts on it too)."""
    return real_calibration()


@pytest.fixture
def measured(monkeypatch, calibrated) -> list[dict]:
    """The calls ensure / auto / the command make to measure; each returns a copy of the real calibration."""
    calls = []

    def fake(torch_device: str = "cpu", seconds: float = 10.0, shapes=None, threads=None,
             scope=run_mod.SCOPES) -> Calibration:
        calls.append(dict(torch_device=torch_device, seconds=seconds, threads=threads, scope=set(scope)))
        return dataclasses.replace(copy.deepcopy(calibrated), scope=[k for k in run_mod.SCOPES if k in scope])

    monkeypatch.setattr(run_mod, "measure", fake)
    monkeypatch.setattr(cal_mod, "measure", fake)
    return calls


ASKED = dict(torch_device="cpu", seconds=0.5, threads=1, scope={"bf16", "sac", "ranks"})  # ensure's default: all

@pytest.mark.slow

def test_a_real_calibration_is_current(calibrated):
    """What the stale-cache tests below rely on: today's measurement has every kind _current asks for."""
    assert calibrated.memory_curve_inplace and calibrated.op_costs() is not None
    assert calibrated.contention_processes == 2 and calibrated.allocator
    assert {"sdpa-fp32", "sdpa-backward-fp32"} <= set(calibrated.matmul_start)
    assert set(calibrated.dispatch_seconds_autocast) == {"forward", "backward", "plain"}
    # selective checkpointing's dispatch mode: dearer per op than plain dispatch (~40 against ~8 us here)
    assert calibrated.dispatch_seconds["forward-sac"] > calibrated.dispatch_seconds["forward"]
    assert calibrated.link == run_mod.LINK and calibrated.loopback_bytes_per_s > 0
    assert 0 <= calibrated.rank_skew < 1  # the slower of two ranks over the same matmuls, over their mean, less 1
    assert calibrated.probe == BUNDLE and 1e-4 < calibrated.probe_seconds < 1.0  # the host speed probe's reference
    assert {f"activation/silu:{t}" for t in ("fp32", "bf16")} <= set(calibrated.element_seconds)
    assert calibrated.matmul_shapes[-1] == [SIDE, SIDE, SIDE]  # what prices a call's bytes beyond its shape's
    if (os.cpu_count() or 1) >= 2:  # measured in each round, merged by median
        assert set(calibrated.contention) == {"compute", "memory", "dispatch"}
    assert calibrated.op_costs().contention == calibrated.contention  # the time model reads it as measured
    assert run_mod._current(calibrated)


# Each kind of figure today's per-op model prices with, taken out of the real calibration as a cache written
# before it was measured lacks it.  A cache without one is measured again, once; the new one is then cached.
MISSING = {
    "in-place memory curve (the step regime)": lambda c: dict(memory_curve_inplace=[]),
    "transcendental kernels by name": lambda c: dict(element_seconds={k: v for k, v in c.element_seconds.items()
                                                                      if "/" not in k}),
    "dispatch under selective checkpointing": lambda c: dict(dispatch_seconds={k: v for k, v in c.dispatch_seconds.items()
                                                                               if "sac" not in k}),
    "the matmul curve's shapes": lambda c: dict(matmul_shapes=[]),
    "fused attention's backward curve": lambda c: dict(matmul_start={k: v for k, v in c.matmul_start.items()
                                                                     if "backward" not in k}),
    "contention of the local ranks": lambda c: dict(contention_processes=0),
    "the allocator regime": lambda c: dict(allocator=""),
    "dispatch under autocast": lambda c: dict(dispatch_seconds_autocast={}),
    "gloo's all-reduce as the link": lambda c: dict(link=""),
    "the speed probe's reference": lambda c: dict(probe_seconds=0.0),
    "the speed probe's bundle": lambda c: dict(probe="another bundle"),
}


@pytest.mark.parametrize("kind", sorted(MISSING))
def test_a_cache_without_a_kind_the_model_prices_with_is_measured_again_once(measured, calibrated, kind):
    stale = dataclasses.replace(calibrated, **MISSING[kind](calibrated))
    save(stale)
    assert load_cached("cpu", threads=1) == stale  # still readable
    cal, fresh = ensure("cpu", threads=1, seconds=0.5)
    assert fresh and measured == [ASKED] and cal == calibrated
    assert ensure("cpu", threads=1) == (calibrated, False) and len(measured) == 1  # cached now


def test_a_device_whose_fused_attention_did_not_run_has_nothing_to_measure_again(measured, calibrated):
    no_sdpa = dataclasses.replace(calibrated, matmul_curve={k: v for k, v in calibrated.matmul_curve.items()
                                                            if not k.startswith("sdpa")},
                                  matmul_start={k: v for k, v in calibrated.matmul_start.items()
                                                if not k.startswith("sdpa")})
    save(no_sdpa)
    assert ensure("cpu", threads=1) == (no_sdpa, False) and measured == []


@pytest.mark.host
@pytest.mark.slow
def test_the_link_fitted_to_three_sizes_prices_another_all_reduce_timed_on_gloo():
    from batchlab.calibrate.link import allreduce_timed, allreduce_times, ring_fit

    size = 2 * 2**20  # between the fitted sizes (16 KiB, 1 MiB, 4 MiB), timed by its own two processes
    for _ in range(3):  # a burst of load from another process (the suite runs in parallel) does not last three
        bandwidth, latency = ring_fit(allreduce_times(0.3, launches=1)["seconds"])  # as the calibration fits it
        timed = allreduce_timed((size,), 0.3)["seconds"][size]
        if 0.5 < (size / bandwidth + 2 * latency) / timed < 2.0:
            break
    assert 1e7 < bandwidth < 1e12 and 0 <= latency < 1e-2, (bandwidth, latency)
    assert 0.5 < (size / bandwidth + 2 * latency) / timed < 2.0, (size / bandwidth + 2 * latency, timed)


def test_a_link_that_cannot_be_timed_is_left_unmeasured_with_a_warning_not_a_hang(monkeypatch):
    from batchlab.calibrate import link

    monkeypatch.setattr(link, "_rank", lambda *args: None)  # a rank that leaves without a result
    monkeypatch.setattr(link, "TIMEOUT_S", 0.3)
    start = time.perf_counter()
    with pytest.warns(UserWarning, match="gave no result"):
        assert link.allreduce_times(0.02) == {}
    assert link.ring_fit({}) == (0.0, 0.0)  # what the calibration then keeps: no link
    assert time.perf_counter() - start < 10
    assert sample(loopback_bytes_per_s=0.0).op_costs().link_bytes_per_s is None  # priced over the entry's link


def _contention_factors(processes: int, threads: int, alternations: int = 3) -> dict:
    from batchlab.calibrate.concurrency import Contention

    contention = Contention(processes, threads, 0.3 / (6 * alternations))
    try:
        for _ in range(alternations):
            contention.alternate()
        return contention.factors()
    finally:
        contention.close()


def test_contention_is_measured_only_where_the_processes_get_their_own_cores():
    from batchlab.calibrate.concurrency import KINDS

    cores = os.cpu_count() or 1
    # time-shared / nothing beside it
    assert _contention_factors(2, cores) == {} and _contention_factors(1, 1) == {}
    if cores < 2:
        pytest.skip("one core")
    factors = _contention_factors(2, 1)
    # CPU seconds per call (other load does not enter them): a second process never makes one 5x faster or slower
    assert set(factors) == set(KINDS) and all(0.5 < f < 5 for f in factors.values()), factors


def test_contention_alternations_spread_through_a_round_pool_into_their_median():
    """A calibration round keeps its workers and runs one alternation with each dispatch slice, seconds apart;
    each kind's factor is the median of every alternation's ratio."""
    from batchlab.calibrate.concurrency import KINDS, Contention

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core")
    contention = Contention(2, 1, 0.01)
    try:
        for _ in range(4):
            contention.alternate()
            time.sleep(0.05)  # the round's other kernels run here
    finally:
        contention.close()
    assert all(len(contention.samples[k]) == 4 for k in KINDS)  # one ratio per alternation, none merged early
    assert set(contention.factors()) == set(KINDS) and all(0.5 < f < 5 for f in contention.factors().values())
    assert all(not w.is_alive() for w in contention.workers)  # closed: no process left behind
    inert = Contention(2, os.cpu_count() or 1, 0.01)
    inert.alternate()
    assert inert.factors() == {} and inert.workers == []


def test_a_measured_rate_is_used_as_it_is_no_achievable_fraction_on_top():
    from batchlab.formula import estimate

    cal = sample()
    save(cal)
    cfg = RunConfig()
    t = estimate(cfg, load_all()).time
    # matmul seconds = FLOPs / the measured rate (not / 0.4 of it), whatever achievable_fraction says
    assert t.ops.by_class["matmul"] == pytest.approx(t.ops.flops / R)
    assert t.flops_ceiling == pytest.approx(R)
    assert estimate(cfg.replace(achievable_fraction=0.1), load_all()).time.ops.by_class["matmul"] == \
        pytest.approx(t.ops.flops / R)
    assert t.ceiling_source == cal.source and cal.source in t.model
    nominal = estimate(cfg).time  # pure: the cache on disk changes nothing unless passed in
    assert nominal.ceiling_source.startswith("nominal") and "/proc/cpuinfo" in nominal.ceiling_source
    assert "achievable fraction 0.4" in nominal.model


def test_a_mixed_precision_is_priced_with_the_dispatch_measured_under_autocast():
    from batchlab.formula import estimate
    from batchlab.formula.opcost import DISPATCH_KIND
    from batchlab.formula.oplist import update_ops

    cal = sample(dispatch_seconds_autocast=AUTOCAST)
    save(cal)
    for precision, per_op in (("bf16-mixed", AUTOCAST), ("fp16-mixed", AUTOCAST), ("fp32", cal.dispatch_seconds),
                              ("bf16", cal.dispatch_seconds)):  # pure bf16 runs no autocast
        cfg = RunConfig(precision=precision)
        t = estimate(cfg, load_all()).time
        # by hand: every op of the update's list at its kind's per-op cost
        want = sum(o.count * per_op[DISPATCH_KIND[o.phase]] for o in update_ops(cfg))
        assert t.ops.by_class["dispatch"] == pytest.approx(want), precision
        assert ("under autocast" in t.model) == (per_op is AUTOCAST), precision
    # a cache measured before it (no autocast figures): fp32's dispatch serves every precision
    save(sample())
    cfg = RunConfig(precision="bf16-mixed")
    t = estimate(cfg, load_all()).time
    assert t.ops.by_class["dispatch"] == pytest.approx(
        sum(o.count * cal.dispatch_seconds[DISPATCH_KIND[o.phase]] for o in update_ops(cfg)))


def test_the_rounds_figures_are_merged_by_their_median_per_key_and_per_size():
    rounds = [{"curve": [[1.0, 10.0], [2.0, 20.0]], "per_kind": {"f": 1.0}, "rate": 3.0},
              {"curve": [[1.0, 14.0], [2.0, 26.0], [4.0, 30.0]], "per_kind": {"f": 5.0}, "rate": 1.0},
              {"curve": [[1.0, 12.0]], "per_kind": {"f": 2.0, "g": 7.0}, "rate": 2.0}]  # its budget cut it short
    assert run_mod._median_rounds(rounds) == {"curve": [[1.0, 12.0], [2.0, 23.0], [4.0, 30.0]],
                                              "per_kind": {"f": 2.0, "g": 7.0}, "rate": 2.0}
    assert run_mod._median_rounds([[], []]) == []  # a dtype the device cannot run: no curve in any round


def test_rates_are_the_median_of_cpu_time_samples_and_the_upper_quartile_of_wall_clock_ones():
    from batchlab.calibrate.kernels import CLOCK, steady

    rates = [1.0, 2.0, 3.0, 4.0, 10.0]  # median 3; quartiles (inclusive) 2, 3, 4
    assert steady(rates, cpu_clock=True) == 3.0 and steady(rates, cpu_clock=False) == 4.0
    assert steady(rates) == 4.0  # the default clock is the wall clock: other work only slows a sample down
    token = CLOCK.set(time.thread_time)  # calibrate at one CPU thread: the host's own spread, met by steps too
    try:
        assert steady(rates) == 3.0
    finally:
        CLOCK.reset(token)
    assert steady([7.0]) == 7.0


def _calibrated_against_torch_benchmark(cal: Calibration, n: int = SIDE):
    """(calibrated / Timer-measured) rate of an n x n x n matmul and of a large in-place add, timed in thread
    CPU time as calibrate times one-thread CPU kernels (load elsewhere stays out of both)."""
    from torch.utils.benchmark import Timer

    x, w = torch.randn(n, n), torch.randn(n, n)
    # calibrate keeps the median of its CPU-time samples: compare median with median
    mm = 2 * n**3 / Timer("torch.mm(x, w.t())", globals={"torch": torch, "x": x, "w": w},
                          timer=time.thread_time).blocked_autorange(min_run_time=0.2).median
    big = 4 * 2**20
    a, b = torch.ones(big), torch.ones(big)
    add = 3 * 4 * big / Timer("a.add_(b)", globals={"a": a, "b": b}, timer=time.thread_time).blocked_autorange(
        min_run_time=0.2).median  # two reads and a write, as counted
    return cal.matmul_curve["fp32"][0][1] / mm, cal.memory_curve_inplace[-1][1] / add


@pytest.mark.host
@pytest.mark.slow
def test_measure_cpu_matches_a_matmul_and_an_add_timed_here(calibrated):
    # the same kernels timed by torch's own benchmark: a FLOP or byte count off by 2x falls outside on every
    # attempt; a burst of load from another process (the suite runs in parallel) does not last three
    cal = calibrated
    for attempt in range(3):
        if attempt:
            cal = measure("cpu", seconds=1.0, shapes=((SIDE, SIDE, SIDE),), threads=1, rounds=1)
        mm, add = _calibrated_against_torch_benchmark(cal)
        if 0.5 < mm < 2.0 and 0.5 < add < 2.0:
            break
    assert 0.5 < mm < 2.0 and 0.5 < add < 2.0, (mm, add)
    assert cal.device == "cpu" and cal.threads == 1 and cal.provenance == "calibrated"
    # an add into fresh outputs kept alive (a step's activations) is no faster than one that rewrites its input
    assert cal.memory_curve[-1][1] < 1.2 * cal.memory_curve_inplace[-1][1], cal.memory_curve
    assert all(1e-7 < s < 1e-3 for s in cal.dispatch_seconds.values()), cal.dispatch_seconds
    assert set(cal.dispatch_seconds) == {"forward", "backward", "plain", "forward-sac", "recompute-sac"}
    assert cal.op_costs() is not None and cal.seconds < 20  # the budget (1 s) bounds it, with each kernel's minimum
    _fused_attention_against_torch_benchmark(cal)
    from torch.utils.benchmark import Timer

    # a kernel timed by name: SiLU per element against torch's benchmark of the same call
    x = torch.rand(2048, 128)
    silu = Timer("F.silu(x)", globals={"F": torch.nn.functional, "x": x},
                 timer=time.thread_time).blocked_autorange(min_run_time=0.2).median / x.numel()
    assert 0.5 < cal.element_seconds["activation/silu:fp32"] / silu < 2.0, (cal.element_seconds, silu)


def _fused_attention_against_torch_benchmark(cal) -> None:
    """The calibrated start + per-entry model of scaled_dot_product_attention's forward and backward, at 8
    entries (calibrated at 2 and 16), against the calls timed by torch's own benchmark."""
    import torch.nn.functional as F
    from torch.utils.benchmark import Timer

    from batchlab.formula.opcost import OpClass, OpCount
    from batchlab.config.phase import Phase

    costs, flops_per_matmul = cal.op_costs(), 4 * 128 * 128 * 32
    q, k, v = (torch.randn(1, 8, 128, 32).requires_grad_() for _ in range(3))
    out, g = F.scaled_dot_product_attention(q, k, v, is_causal=True), torch.randn(1, 8, 128, 32)
    env = {"F": F, "torch": torch, "q": q, "k": k, "v": v, "out": out, "g": g}
    for stmt, name, flops in (("F.scaled_dot_product_attention(q, k, v, is_causal=True)", "", 8 * flops_per_matmul),
                              ("torch.autograd.grad(out, (q, k, v), g, retain_graph=True)", "_backward",
                               int(2.5 * 8 * flops_per_matmul))):
        timed = Timer(stmt, globals=env, timer=time.thread_time).blocked_autorange(min_run_time=0.2).median
        op = OpCount("_scaled_dot_product_flash_attention_for_cpu" + name, Phase.FORWARD, OpClass.MATMUL,
                     flops=flops, flops_per_matmul=flops_per_matmul)
        assert 0.5 < costs.work_seconds(op) / timed < 2.0, (name, costs.work_seconds(op), timed)


def test_auto_calibrates_once_and_says_so_then_stays_quiet(measured, calibrated):
    assert auto("h100-sxm", threads=1) is None  # not a CPU: nothing measured here
    assert "not calibrated" in auto("cpu", threads=1, enabled=False) and measured == []
    line = auto("cpu", threads=1)
    assert measured == [dict(torch_device="cpu", seconds=10.0, threads=1, scope=set())]  # no config: fp32 alone
    assert line.startswith("time model: calibrated this CPU once at 1 thread(s)") and "--no-calibrate" in line
    assert f"in {calibrated.seconds:.1f} s" in line
    assert auto("cpu", threads=1) is None and auto("cpu", threads=1, enabled=False) is None  # cached now
    assert ensure("cpu", threads=1, scope=())[1] is False and len(measured) == 1


def test_a_run_calibrates_the_parts_its_configs_need_and_a_wider_one_measures_every_part_again(measured,
                                                                                              monkeypatch):
    from batchlab.calibrate import calls

    fp32 = RunConfig()  # fp32, no selective checkpointing, DP 1: 16-bit kernels and local ranks unused
    auto("cpu", threads=1, cfgs=(fp32, fp32.replace(micro_batch=2)))
    assert [c["scope"] for c in measured] == [set()]
    # served: a checkpoint region's own call timed beside it, once (calibrate/calls.py; stubbed here)
    monkeypatch.setattr(calls, "measure_checkpoint", lambda: dict.fromkeys(calls.CHECKPOINT, 5e-5))
    assert "checkpoint region" in auto("cpu", threads=1, cfgs=(fp32.replace(ac="full"),)) and len(measured) == 1
    assert auto("cpu", threads=1, cfgs=(fp32.replace(ac="full"),)) is None and len(measured) == 1
    auto("cpu", threads=1, cfgs=(fp32, fp32.replace(precision="bf16-mixed")))
    auto("cpu", threads=1, cfgs=(fp32.replace(dp=2),))  # with what the cache had: fp32 and bf16 from one window
    auto("cpu", threads=1, cfgs=(fp32.replace(ac="selective"),))
    assert [c["scope"] for c in measured] == [set(), {"bf16"}, {"bf16", "ranks"}, {"bf16", "ranks", "sac"}]
    assert auto("cpu", threads=1, cfgs=(fp32.replace(precision="bf16-mixed", dp=2),)) is None


def test_a_calibration_without_a_part_prices_no_config_that_needs_it(calibrated):
    from batchlab.formula import calibrated_costs

    fp32_only, cfg = dataclasses.replace(calibrated, scope=[]), RunConfig()
    assert calibrated_costs(cfg, {cfg.device: fp32_only}) is not None
    for other in (cfg.replace(precision="bf16-mixed"), cfg.replace(ac="selective"), cfg.replace(dp=2)):
        # nominal rates, said so, rather than fp32's kernels standing in for bf16's or no contention at DP 2
        assert calibrated_costs(other, {cfg.device: fp32_only}) is None
        assert calibrated_costs(other, {cfg.device: calibrated}) is not None
    assert "parts measured: fp32" in fp32_only.source and "parts measured" not in calibrated.source


@pytest.mark.slow
def test_a_calibration_of_fp32_alone_times_no_16_bit_kernel_autocast_selective_dispatch_or_ranks():
    cal = measure("cpu", seconds=0.5, shapes=((SIDE, SIDE, SIDE),), threads=1, rounds=1, scope=())
    assert cal.scope == [] and set(cal.matmul_curve) == {"fp32", "bmm-fp32", "sdpa-fp32", "sdpa-backward-fp32"}
    assert cal.matmul_flops_bf16 is None and cal.memory_curve_bf16 == [] and cal.dispatch_seconds_autocast == {}
    assert set(cal.dispatch_seconds) == {"forward", "backward", "plain"}
    assert not any(k.endswith(":bf16") for k in cal.element_seconds) and "activation/silu:fp32" in cal.element_seconds
    assert cal.contention == {} and cal.contention_processes == 0 and cal.loopback_bytes_per_s == 0
    assert cal.memory_curve_inplace and cal.probe_seconds > 0
    assert run_mod._current(cal, set()) and not run_mod._current(cal, {"bf16"})


def test_unusable_device_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(ConfigError, match="torch_device"):
        measure("cuda", seconds=0.1)


def test_command_caches_and_prints_json(measured, calibrated):
    result = CliRunner().invoke(app, ["calibrate", "--seconds", "1", "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert measured == [dict(torch_device="cpu", seconds=1.0, threads=1, scope={"bf16", "sac", "ranks"})]  # all parts
    payload = json.loads(result.output)
    assert Calibration.from_dict(payload) == calibrated  # what measure returned, printed whole
    assert payload["provenance"] == "calibrated" and payload["source"].startswith("calibrated on")
    assert load_cached("cpu", threads=1).matmul_flops_fp32 == payload["matmul_flops_fp32"]
    assert payload["dispatch_seconds"]["backward"] > 0 and payload["matmul_curve"]["fp32"]


def test_command_names_each_curve_and_fused_attentions_cost_per_call(monkeypatch):
    curves = {**sample().matmul_curve, "bmm-fp32": [[1e3, R]], "sdpa-backward-bf16": [[5e5, 1e10], [2e6, 2e10]]}
    monkeypatch.setattr(cal_mod, "measure", lambda *a, **k: sample(
        matmul_curve=curves, matmul_start={"sdpa-backward-bf16": [[5e5, 1.2e-4], [2e6, 3.4e-4]]},
        loopback_bytes_per_s=1e9, loopback_latency_s=8e-4, link=run_mod.LINK, rank_skew=0.035, probe_seconds=6e-3))
    result = CliRunner().invoke(app, ["calibrate", "--seconds", "1"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "linear layers' matmuls, fp32" in out and "attention's batched matmuls, fp32" in out
    assert "fused attention backward, bf16" in out and "linear layers' matmuls, sdpa" not in out
    assert "10 GFLOP/s · 20 GFLOP/s; + 120 µs · 340 µs a call" in out
    assert "1 GB/s + 800 µs per message" in out and "+3.5%" in out and "6.00 ms" in out  # link, spread, probe


def test_command_bad_input_exits_2():
    assert CliRunner().invoke(app, ["calibrate", "--seconds", "0.1"]).exit_code == 2
    if not torch.cuda.is_available():
        assert CliRunner().invoke(app, ["calibrate", "--torch-device", "cuda", "--seconds", "1"]).exit_code == 2


def test_dispatch_slices_pool_into_per_op_figures_that_add_up_to_a_real_update():
    """A calibration times dispatch in slices spread through each round (the host's Python-bound speed moves
    2x between one-second windows); the pooled per-op figures, times the trainer's op counts, give the update's
    time, against the whole update timed on its own clock."""
    from batchlab.calibrate.dispatch import DispatchSampler, dispatch_trainers
    from batchlab.calibrate.kernels import CLOCK

    torch.set_num_threads(1)
    token = CLOCK.set(time.thread_time)
    try:
        trainers = dispatch_trainers(torch.device("cpu"), ("fp32",))
        sampler, (trainer, calls), whole = DispatchSampler(trainers, lambda: None), trainers["fp32"], []
        for _ in range(4):  # slices, with whole updates between them: both meet the host's speed alike
            sampler.run(0.05)
            for _ in range(5):
                t = time.thread_time()
                trainer.update()
                whole.append(time.thread_time() - t)
        assert len(sampler.per_op["fp32"]["forward"]) >= 4  # every slice ran updates; their samples pooled
        per_op = sampler.seconds()["fp32"]
        predicted = sum(per_op[kind] * n for kind, n in calls.items())
    finally:
        CLOCK.reset(token)
    whole.sort()
    assert 0.5 * whole[len(whole) // 2] < predicted < 1.6 * whole[len(whole) // 2]
