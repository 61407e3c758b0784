"""batchlab calibrate: rate arithmetic, the per-device cache, the CPU measurement and the command."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from batchlab import calibrate as cal_mod
from batchlab.calibrate import Calibration, load_cached, measure, save, timed_rates
from batchlab.cli import app
from batchlab.config import ConfigError
from batchlab.host import cpu_hardware


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # platformdirs' user cache dir on Linux
    return tmp_path


def sample(**kw) -> Calibration:
    values = dict(device="cpu", hardware=f"{cpu_hardware()}, 2 threads", torch_device="cpu",
                  matmul_flops_fp32=8e10, matmul_flops_bf16=1.2e12, memory_bytes_per_s=6e9,
                  matmul_size={"fp32": 1024, "bf16": 1024}, copy_bytes=2**28, threads=2,
                  measured_at="2025-01-01T00:00:00+00:00", torch_version=torch.__version__)
    values.update(kw)
    return Calibration(**values)


def test_timed_rates_divide_work_by_elapsed_time():
    ticks = iter(range(1000))
    clock = lambda: next(ticks) * 0.01  # noqa: E731 — every reading advances 10 ms
    rates = timed_rates(lambda: None, work=100.0, seconds=0.05, sync=lambda: None, clock=clock)
    # warm-up call takes 10 ms -> 2 calls per sample; each sample spans one 10 ms tick
    assert rates and all(r == pytest.approx(100.0 * 2 / 0.01) for r in rates)


def test_cache_round_trip_and_source(cache_home):
    cal = sample()
    path = save(cal)
    assert path.is_relative_to(cache_home)
    loaded = load_cached("cpu")
    assert loaded == cal
    assert "calibrated on" in loaded.source and cal.hardware in loaded.source
    assert load_cached("h100-sxm") is None  # never calibrated


def test_cpu_entry_from_other_hardware_is_ignored():
    save(sample(hardware="Some Other CPU, 96 cores, 96 threads"))
    assert load_cached("cpu") is None


def test_corrupt_cache_is_ignored():
    save(sample())
    cal_mod._cache_path("cpu").write_text("{not json")
    assert load_cached("cpu") is None


def test_ceiling_per_precision():
    cal = sample()
    assert cal.matmul_flops("fp32") == 8e10
    assert cal.matmul_flops("bf16-mixed") == cal.matmul_flops("bf16") == 1.2e12
    assert sample(matmul_flops_bf16=None).matmul_flops("bf16-mixed") == 8e10


def reference_seconds(stmt: str, seconds: float = 0.3, **tensors) -> float:
    """Median seconds of ``stmt`` timed here by torch.utils.benchmark (an independent timer)."""
    from torch.utils.benchmark import Timer

    return Timer(stmt, globals={"torch": torch, **tensors}).blocked_autorange(min_run_time=seconds).median


def test_measure_cpu_matches_a_matmul_timed_here():
    n = 256
    cal = measure("cpu", seconds=0.6, sizes=(n,), copy_bytes=8 * 2**20)
    ref = 2 * n**3 / reference_seconds("torch.mm(a, b)", a=torch.randn(n, n), b=torch.randn(n, n))
    src = torch.ones(2 * 2**20)  # 8 MiB of fp32, as calibrated
    copy_ref = 2 * src.nbytes / reference_seconds("dst.copy_(src)", src=src, dst=torch.empty_like(src))
    assert cal.device == "cpu" and cal.provenance == "calibrated"
    assert cal.matmul_size["fp32"] == n and cal.copy_bytes == 8 * 2**20
    assert cal.threads == torch.get_num_threads()
    # the same product timed by torch's own benchmark: a FLOP count off by 2x (n^3, 4 n^3) falls outside
    assert 0.55 < cal.matmul_flops_fp32 / ref < 1.8, (cal.matmul_flops_fp32, ref)
    # bytes read + written: counting only one of them (or both twice) falls outside
    assert 0.55 < cal.memory_bytes_per_s / copy_ref < 1.8, (cal.memory_bytes_per_s, copy_ref)


def test_the_time_model_uses_the_cached_rate_and_only_when_given():
    from batchlab.calibrate import load_all
    from batchlab.config import RunConfig
    from batchlab.formula import estimate

    cal = sample(matmul_flops_fp32=5e10, memory_bytes_per_s=3e9)
    save(cal)
    cfg = RunConfig()
    measured = estimate(cfg, load_all()).time
    assert measured.flops_ceiling == 5e10 * 0.4  # achievable fraction 0.4 of the cached rate
    assert measured.ceiling_source == cal.source
    datasheet = estimate(cfg).time  # pure: the cache on disk changes nothing unless passed in
    assert datasheet.flops_ceiling == 160e9 * 0.4 and datasheet.ceiling_source.startswith("nominal")
    # FLOP-bound compute: the micro-batch time drops by the rate ratio once the per-op overhead is taken off
    ratio = ((measured.compute_seconds_per_micro_batch - measured.overhead_seconds_per_micro_batch)
             / (datasheet.compute_seconds_per_micro_batch - datasheet.overhead_seconds_per_micro_batch))
    assert ratio == pytest.approx(160e9 / 5e10)
    assert load_all() == {"cpu": cal}


def test_unusable_device_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(ConfigError, match="torch_device"):
        measure("cuda", seconds=0.1)


def test_command_caches_and_prints_json(monkeypatch):
    monkeypatch.setattr(cal_mod, "_defaults", lambda device: ((64, 128), 4 * 2**20))
    result = CliRunner().invoke(app, ["calibrate", "--seconds", "0.2", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["provenance"] == "calibrated" and payload["source"].startswith("calibrated on")
    assert load_cached("cpu").matmul_flops_fp32 == payload["matmul_flops_fp32"]


def test_command_bad_device_exits_2():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    result = CliRunner().invoke(app, ["calibrate", "--torch-device", "cuda", "--seconds", "0.1"])
    assert result.exit_code == 2
