"""A calibration that cannot poison predictions: each rate checked against the device's nominal figures and its
own curve, a failing cache ignored with one line and measured again, a failing measurement measured once more
and never cached, a model's own dispatch ratio that meets no zero, and a prediction 10x off a measurement of
the same run called a broken time model."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from batchlab.calibrate import Calibration, family, load_all, load_cached, save
from batchlab.calibrate import run as run_mod
from batchlab.cli import app
from batchlab.config import RunConfig
from batchlab.config.devices import DEVICES
from batchlab.formula import estimate
from batchlab.cache.calibrations import _cache_path
from batchlab.formula.calibration import check, loaded
from batchlab.formula.plausible import BROKEN, ratio_text


@pytest.fixture(scope="module")
def real(real_calibration) -> Calibration:
    """One real CPU calibration at one thread, two matmul sizes, one short round (the run's, tests/conftest.py)."""
    return real_calibration()


def poisoned(cal, **kw):
    """The cache the issue's user was left with: one point of the fp32 curve, at 4.1 MFLOP/s."""
    curve = {**cal.matmul_curve, "fp32": [[65536.0, 4.1e6]]}
    return dataclasses.replace(cal, matmul_curve=curve, matmul_flops_fp32=4.1e6, **kw)


def levelled(cal):
    """``cal`` with each bandwidth curve flat at its best measured rate: a curve without a stall, whatever the
    host's load did to the live second it was measured in."""
    flat = lambda curve: [[x, max(r for _, r in curve)] for x, _ in curve] if curve else curve  # noqa: E731
    return dataclasses.replace(cal, memory_curve=flat(cal.memory_curve), memory_curve_bf16=flat(cal.memory_curve_bf16),
                               memory_curve_inplace=flat(cal.memory_curve_inplace))


def test_a_real_calibration_passes_every_check(real):
    # a live second on a busy host can catch a real stall, which the check is right to name (its own case is
    # below): nothing else of a real measurement is refused, and its curves without a stall pass whole
    assert [line for line in check(real) if "(a stall)" not in line] == []
    assert check(levelled(real)) == []
    assert not loaded(real) and real.other_cores >= 0  # one thread times CPU seconds: others' load stays out


@pytest.mark.parametrize("damage, said", [
    (lambda c: poisoned(c), "1 point(s)"),
    (lambda c: dataclasses.replace(c, matmul_curve={**c.matmul_curve,
                                                    "fp32": [[1e4, 4.1e6], [1e6, 4.2e6], [1e8, 4.3e6]]}),
     "the nominal peak"),
    (lambda c: dataclasses.replace(c, matmul_curve={**c.matmul_curve, "fp32": [[1e4, 5e9], [1e6, 1e9]]}),
     "the rate falls"),
    (lambda c: dataclasses.replace(c, dispatch_seconds={**c.dispatch_seconds, "forward": 0.0}), "dispatch forward"),
    (lambda c: dataclasses.replace(c, memory_bytes_per_s=0.0), "bandwidth"),
    # a loaded 2-thread calibration here: 20 GB/s, 0.33 GB/s, 5.2 GB/s at 192 KiB, 3 MiB, 48 MiB
    (lambda c: dataclasses.replace(c, memory_curve=[[196608.0, 2.0e10], [3145728.0, 3.3e8], [50331648.0, 5.2e9]]),
     "below both neighbouring sizes"),
    (lambda c: dataclasses.replace(c, memory_curve=[[1.0, float("nan")], [2.0, 1e9]]), "bandwidth curve fp32"),
    (lambda c: dataclasses.replace(c, element_seconds={"activation:fp32": -1.0}), "per-element"),
    (lambda c: dataclasses.replace(c, family_dispatch={"hf:x": {"forward": float("inf")}}), "own dispatch"),
    (lambda c: dataclasses.replace(c, dispatch_seconds={"forward": "fast"}), "dispatch forward"),
    (lambda c: dataclasses.replace(c, dtensor_seconds={"forward": "[red]x"}), "DTensor forward"),
    (lambda c: dataclasses.replace(c, dtensor_seconds={"backward": -1.0}), "DTensor backward"),
    (lambda c: dataclasses.replace(c, other_cores="busy"), "other_cores"),
    # tables a hand-edited or shared cache can hold as something else (op_costs reads them as dicts)
    (lambda c: dataclasses.replace(c, untimed="abc"), "untimed"),
    (lambda c: dataclasses.replace(c, link_cpu_seconds=["message"]), "link_cpu_seconds"),
])
def test_each_kind_of_damage_is_named(real, damage, said):
    bad = check(damage(real))
    assert bad and any(said in line for line in bad), bad


def test_the_nominal_range_is_the_devices_own(real):
    """A GPU's calibration is held to its catalogue peak: an H100 that 'measured' a CPU's rates is refused."""
    gpu = dataclasses.replace(real, device="h100-sxm", torch_device="cuda:0", hardware="NVIDIA H100")
    assert any("nominal peak" in line for line in check(gpu))
    peak = DEVICES["h100-sxm"].peak_flops_fp32
    scaled = {k: [[x, y * peak / real.matmul_flops_fp32 / 2] for x, y in v] for k, v in real.matmul_curve.items()}
    fast = dataclasses.replace(gpu, matmul_curve=scaled, matmul_flops_fp32=peak / 2,
                               memory_bytes_per_s=DEVICES["h100-sxm"].hbm_bytes_per_s / 2,
                               strided_bytes_per_s=DEVICES["h100-sxm"].hbm_bytes_per_s / 4,
                               memory_curve=[[x, DEVICES["h100-sxm"].hbm_bytes_per_s / 2] for x, _ in real.memory_curve])
    assert not any("nominal peak" in line or "bandwidth" in line for line in check(fast)), check(fast)


def test_a_poisoned_cache_is_ignored_with_one_line_and_the_estimate_is_the_uncalibrated_one(real, capsys):
    cfg = RunConfig()
    save(poisoned(real))
    assert load_all() == {}
    estimate(cfg.replace(device="h100-sxm"), load_all())  # another device's estimate: nothing to say
    assert capsys.readouterr().err == ""
    assert load_all().get("cpu") is None  # asked for this CPU's: said once
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: ignored the cached calibration") and "4.1e+06" in err[0]
    nominal = estimate(cfg, {}).time.update_seconds
    assert estimate(cfg, load_all()).time.update_seconds == nominal  # and the warning is not repeated
    assert capsys.readouterr().err == ""
    save(real)  # a sound one serves again
    assert estimate(cfg, load_all()).time.update_seconds != nominal


def test_one_implausible_part_is_left_out_and_measured_again_the_rest_serves(real, monkeypatch, capsys):
    """A cache edited (or left by an older batchlab) with a wild part measured on first use -- a chained all-reduce
    of half a second, a negative DTensor cost -- keeps the rest of the calibration: refusing it priced every
    estimate at nominal rates.  The part is said once and measured again by the next TP measure or compare."""
    from batchlab.calibrate import chain
    from batchlab.formula import calibration

    monkeypatch.setattr(calibration, "loaded_by", lambda other, cores, threads: False)  # other workers' load
    tp = RunConfig(tp=2, dp=2, accum=2)
    save(dataclasses.replace(real, dtensor_seconds={"forward": 7e-5}))
    kept = estimate(tp, load_all()).time.update_seconds
    save(dataclasses.replace(real, link_chain_seconds={"0": 0.5, "0.002": 1.8e-3},
                             dtensor_seconds={"forward": 7e-5, "backward": -1.0}))
    capsys.readouterr()
    cal = load_all().get("cpu")
    assert cal is not None and cal.link_chain_seconds == {} and cal.dtensor_seconds == {"forward": 7e-5}
    assert estimate(tp, load_all()).time.update_seconds == kept != estimate(tp, {}).time.update_seconds
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "left out implausible parts" in err[0] and "chained all-reduce 0.5" in err[0], err
    curve = {0.0: 4 * real.loopback_latency_s, 2e-3: 5 * real.loopback_latency_s}
    monkeypatch.setattr(chain, "measure", lambda: dict(curve))
    assert "measured once" in chain.ensure((tp,), threads=1)
    assert load_cached("cpu", 1).link_chain_seconds == {"0": curve[0.0], "0.002": curve[2e-3]}


def test_two_processes_needing_a_calibration_at_once_measure_it_once(real, monkeypatch):
    """The second waits for the first's calibration and takes it, rather than measuring beside it (each under the
    other's load) or twice.  Two threads open the lock file apart, so flock holds between them as between
    processes."""
    import threading
    import time

    calls = []

    def slow(*a, **k):
        calls.append(k)
        time.sleep(0.5)  # long enough for the other thread to arrive while this one measures
        return real

    from batchlab.formula import calibration

    monkeypatch.setattr(calibration, "loaded_by", lambda other, cores, threads: False)  # other workers' load
    monkeypatch.setattr(run_mod, "measure", slow)
    got = []
    threads = [threading.Thread(target=lambda: got.append(run_mod.ensure("cpu", threads=1, scope=())))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and sorted(fresh for _, fresh in got) == [False, True]
    assert all(cal == real for cal, _ in got)


def test_a_poisoned_cache_is_measured_again_and_replaced(real, monkeypatch):
    calls = []
    monkeypatch.setattr(run_mod, "measure", lambda *a, **k: calls.append(k) or real)
    save(poisoned(real))
    cal, fresh = run_mod.ensure("cpu", threads=1, scope=())
    assert fresh and cal == real and len(calls) == 1
    assert load_cached("cpu", 1) == real


def test_a_measurement_failing_its_checks_is_measured_once_more_and_never_cached(real, monkeypatch):
    results = [poisoned(real), real]
    monkeypatch.setattr(run_mod, "measure", lambda *a, **k: results.pop(0))
    assert run_mod.ensure("cpu", threads=1, scope=()) == (real, True)  # the outlier measured again
    assert load_cached("cpu", 1) == real

    _cache_path("cpu", real.torch_version, 1).unlink()
    monkeypatch.setattr(run_mod, "measure", lambda *a, **k: poisoned(real))
    with pytest.raises(run_mod.Rejected, match="1 point"):
        run_mod.ensure("cpu", threads=1, scope=())
    assert not _cache_path("cpu", real.torch_version, 1).exists()
    line = run_mod.auto("cpu", threads=1)
    assert "failed its checks twice" in line and "nominal CPU rates" in line
    assert not _cache_path("cpu", real.torch_version, 1).exists()


def test_the_command_refuses_to_cache_a_calibration_that_fails_twice(real, monkeypatch):
    monkeypatch.setattr(run_mod, "measure", lambda *a, **k: poisoned(real))
    import batchlab.calibrate as cal_mod

    monkeypatch.setattr(cal_mod, "measure", lambda *a, **k: poisoned(real), raising=False)
    result = CliRunner().invoke(app, ["calibrate", "--seconds", "1", "--threads", "1"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "failed its checks twice and was not cached" in result.output
    assert not list(_cache_path("cpu", real.torch_version, 1).parent.glob("*.json"))


def test_a_wall_clock_calibration_under_others_load_is_provisional(real, monkeypatch):
    """Two threads time wall-clock: others' load stretches every rate.  Measured twice, the less loaded kept,
    cached as provisional (its source says so) and measured again by the next run that needs it."""
    two = dict(threads=2, cores=2, hardware=real.hardware.replace("1 threads", "2 threads"))
    busy = [dataclasses.replace(real, other_cores=1.5, **two), dataclasses.replace(real, other_cores=0.9, **two)]
    calls = []
    monkeypatch.setattr(run_mod, "measure", lambda *a, **k: calls.append(k) or busy[len(calls) - 1])
    cal, fresh = run_mod.ensure("cpu", threads=2, scope=())
    assert fresh and cal.other_cores == 0.9 and len(calls) == 2
    assert loaded(cal) and "other processes kept 0.9 core(s) busy" in cal.source
    quiet = dataclasses.replace(real, other_cores=0.1, **two)
    monkeypatch.setattr(run_mod, "measure", lambda *a, **k: calls.append(k) or quiet)
    assert run_mod.ensure("cpu", threads=2, scope=()) == (quiet, True)  # provisional: measured again
    assert run_mod.ensure("cpu", threads=2, scope=()) == (quiet, False) and len(calls) == 3


def test_a_family_ratio_meets_no_zero():
    """The crash of a CPU whose GPT dispatch is below what the work model prices: beyond-work 0."""
    assert family.ratio(2e-6, 1e-6, 5e-6, 4e-6) == pytest.approx(2.0)
    assert family.ratio(2e-6, 0.0, 6e-6, 4e-6) == pytest.approx(1.5)  # whole times per op instead
    assert family.ratio(2e-6, 1e-9, 6e-6, 4e-6) == pytest.approx(1.5)  # a few ns: not separable from noise
    # 0.1 µs of the GPT's 2 µs is not separable: whole times, 1 s / 2 µs = 5e5 as measured, not clamped to x50
    # (plausible.family_problems refuses it: tests/calibrate/test_family_dispatch.py)
    assert family.ratio(1.0, 1e-7, 1.0, 2e-6) == pytest.approx(5e5)
    assert family.ratio(0.0, 0.0, 0.0, 0.0) == 1.0  # nothing timed: batchlab's GPT's cost serves


def test_an_estimate_with_a_calibration_measured_under_load_says_so_once(monkeypatch, capsys):
    """2 threads timed wall-clock on 2 cores while others kept 1.5 busy (over the 0.25 spare): every rate holds
    that load.  The estimate uses it and says so once per process, naming the command that measures it again;
    calibrate's own reader (it decides whether to measure again) says nothing."""
    from batchlab.formula.calibration import Calibration
    from batchlab.host import cpu_hardware

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    busy = Calibration(device="cpu", hardware=f"{cpu_hardware()}, 2 threads", torch_device="cpu",
                       matmul_flops_fp32=1e10, matmul_flops_bf16=None, memory_bytes_per_s=1e9, matmul_size={},
                       copy_bytes=1, threads=2, cores=2, other_cores=1.5, measured_at="2026-01-02T00:00:00+00:00",
                       torch_version=torch.__version__, seconds=1.0)
    save(busy)
    assert load_cached("cpu", 2) is not None and capsys.readouterr().err == ""
    first, second = (CliRunner().invoke(app, ["estimate", "--device", "cpu", "--json"]) for _ in range(2))
    assert first.exit_code == second.exit_code == 0, first.output
    said = [line for line in first.stderr.splitlines() if "measured at 2026-01-02" in line]
    assert len(said) == 1 and said[0].startswith("warning: ") and "1.5 core(s) busy" in said[0], first.stderr
    assert "`batchlab calibrate`" in said[0]
    assert "2026-01-02" not in second.stderr  # once per process
    quiet = dataclasses.replace(busy, other_cores=0.1, measured_at="2026-01-03T00:00:00+00:00")
    save(quiet)
    r = CliRunner().invoke(app, ["estimate", "--device", "cpu", "--json"])
    assert r.exit_code == 0 and "busy" not in r.stderr, r.stderr


def test_a_cached_file_of_the_wrong_shape_is_ignored_not_a_crash(real, capsys):
    path = save(real)
    raw = json.loads(path.read_text())
    for broken in ({**raw, "matmul_curve": {"fp32": "fast"}}, {**raw, "dispatch_seconds": {"forward": None}},
                   {**raw, "matmul_curve": {"fp32": [[1, 2, 3]]}}):
        path.write_text(json.dumps(broken))
        assert load_all() == {}
    path.write_text("[" * 100000)
    assert load_all() == {}


def test_a_prediction_ten_times_off_the_measurement_is_a_broken_time_model():
    assert ratio_text(1.0, 1.0) is None and ratio_text(0.5, 1.0) is None and ratio_text(1.0, 5.0) is None
    assert "broken" in ratio_text(1260.0, 0.1) and "broken" in ratio_text(1.0, BROKEN * 1.01)
    assert ratio_text(0.0, 1.0) is None  # no prediction: nothing to call broken


def test_measure_says_the_time_model_is_broken_when_its_prediction_is_far_off(monkeypatch):
    """A time model told its kernels reach 1/10^5 of the nominal peak (an assumption the user can set) against a
    real run of the tiny model."""
    result = CliRunner().invoke(app, ["measure", "--seq", "32", "--micro-batch", "2", "--steps", "2",
                                      "--achievable-fraction", "0.00001", "--no-calibrate"])
    assert result.exit_code == 0, result.output
    assert "the time model is broken here, not the run" in " ".join(result.output.split())


def test_a_plan_of_selective_layers_needs_what_its_preset_needs(real):
    """A calibration without selective checkpointing's dispatch prices neither the preset nor a plan that runs it:
    priced apart, a plan of all selective-op layers undercut the very preset it equals (2x here)."""
    from batchlab.formula import calibrated_costs

    cfg = RunConfig()
    fp32_only = dataclasses.replace(real, scope=[])
    for ac in ("selective-op", "plan:selective-op*4", "plan:none*2,selective*2"):
        assert calibrated_costs(cfg.replace(ac=ac), {"cpu": fp32_only}) is None, ac
    assert calibrated_costs(cfg.replace(ac="plan:full*2,none*2"), {"cpu": fp32_only}) is not None
    preset, plan = (estimate(cfg.replace(ac=ac), {"cpu": real}).time.update_seconds
                    for ac in ("selective-op", "plan:selective-op*4"))
    assert plan == pytest.approx(preset, rel=1e-9)


def test_the_cache_of_one_device_is_read_from_its_own_files_only(real, monkeypatch):
    from batchlab.cache import calibrations

    save(real)
    other = save(dataclasses.replace(real, device="h100-sxm", torch_device="cuda:0"))
    read = []
    original = calibrations._read
    monkeypatch.setattr(calibrations, "_read", lambda path: read.append(path.name) or original(path))
    assert load_cached("cpu", 1) == real
    assert read == [_cache_path("cpu", real.torch_version, 1).name]
    load_cached("h100-sxm", 1)  # (a CPU's rates fail an H100's checks: read, then refused)
    assert read[-1] == other.name
    assert load_cached("h100", 1) is None  # a device whose name begins another's reads nothing of it
    assert len(read) == 2


def test_a_device_name_with_path_or_markup_characters_locks_a_file_in_the_cache_folder_itself():
    from batchlab.cache.calibrations import cache_dir, lock_path

    path = lock_path("../NVIDIA A100/80GB [red]x", 2)
    assert path.parent == cache_dir() and "/" not in path.name and path.name.endswith("-2threads.lock")
