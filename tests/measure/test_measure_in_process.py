"""batchlab.run.measure in this process: discipline, memory budget, OOM, JSON round trip, observe()."""
from __future__ import annotations

import json
import statistics

import pytest
import torch

from batchlab.config import ConfigError, RunConfig, preset
from batchlab.measure import MeasureOptions, Outcome, load_measurement, measurement_to_dict, measurement_to_json
from batchlab.run import measure as run
from batchlab.measure.harness import Trainer
from batchlab.measure.memory import BudgetExceeded, StorageTracker, track_update
from batchlab.measure.oom_classify import OOMKind, classify_oom

SMALL = dict(model=preset("tiny", layers=2), seq=16, micro_batch=2)
FAST = MeasureOptions(warmup=1, steps=2)


def tiny_param_bytes(spec) -> int:
    """By hand: token + position embeddings (head tied), per layer 2 LN + qkv + proj + MLP, final LN; fp32."""
    h, v, p, f = spec.hidden, spec.vocab, spec.max_positions, spec.ffn
    layer = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    return 4 * (v * h + p * h + spec.layers * layer + 2 * h)


@pytest.fixture(scope="module")
def measured():
    """One ok measurement of the small config, shared by the tests that only read it (with its progress)."""
    seen: list[tuple[int, str]] = []
    m = run(RunConfig(**SMALL), MeasureOptions(warmup=2, steps=3), progress=lambda d, t, label: seen.append((d, label)))
    return m, seen


def test_run_ok_discipline_and_progress(measured):
    m, seen = measured
    assert m.outcome is Outcome.OK and m.ok
    assert len(m.time.samples) == 3 and m.time.warmup == 2
    # each update is reported when it starts and when it is done; order: the first update is warmup (never
    # timed), then the memory update (never timed), the rest of the warmup, then the timed updates
    started = [label for d, label in seen[1::2]]
    assert started == ["warmup 1/2", "memory", "warmup 2/2", "timed 1/3", "timed 2/3", "timed 3/3"]
    assert [d for d, _ in seen[2::2]] == [1, 2, 3, 4, 5, 6]
    # on CPU the per-phase split comes from the timed updates and adds up to (about) the update time
    assert set(m.time.phase_seconds) == {"data", "forward", "backward", "optimizer"}
    for k in m.time.phase_seconds:
        assert len(m.time.phase_samples[k]) == 3
    per_update = [sum(m.time.phase_samples[k][i] for k in m.time.phase_samples) for i in range(3)]
    assert all(0.5 * s <= p <= s for p, s in zip(per_update, m.time.samples))
    assert len(m.time.cpu_seconds) == 3 and all(c > 0 for c in m.time.cpu_seconds)
    # the host speed probe read before each timed update (a ~6 ms bundle: well under an update of this model)
    assert len(m.time.probe_seconds) == 3 and all(0 < p < 1 for p in m.time.probe_seconds)
    # memory: the tracker's peak holds at least parameters + AdamW's two moments, computed by hand
    params = tiny_param_bytes(RunConfig(**SMALL).model)
    assert m.memory.breakdown["parameters"] == params
    assert m.memory.breakdown["optimizer"] == 2 * params
    assert m.memory.peak_bytes == sum(m.memory.breakdown.values()) > 3 * params
    assert m.memory.provenance == "allocator" and m.time.provenance == "wall-clock"
    assert m.environment["threads"] == torch.get_num_threads()
    assert m.environment["torch"] == torch.__version__
    assert m.global_batch == 2 and m.useful_tokens_per_update == 2 * 16
    assert m.tokens_per_second == pytest.approx(32 / statistics.median(m.time.samples))


def test_memory_matches_a_separate_tracked_update(measured):
    """run()'s memory update equals track_update on an identically built trainer (same state, same data)."""
    m = measured[0]
    tr = Trainer(RunConfig(**SMALL))
    tr.update()
    snap = track_update(tr)  # second update, like run()'s memory update
    assert m.memory.peak_bytes == snap.peak_bytes
    assert m.memory.peak_phase == snap.peak_phase
    assert m.memory.activations_bytes == snap.activations_bytes


def test_padded_tokens_per_second_counts_useful_tokens_only():
    cfg = RunConfig(**SMALL, data="padded", accum=2)
    m = run(cfg, FAST)
    assert cfg.tokens_per_update // 2 <= m.useful_tokens_per_update < cfg.tokens_per_update
    assert m.tokens_per_second < cfg.tokens_per_update / m.time.update_seconds_median


def test_json_round_trip_and_derived_keys(measured):
    m = measured[0]
    d = json.loads(measurement_to_json(m))
    assert d["time"]["update_seconds_median"] == statistics.median(d["time"]["samples"])
    q = statistics.quantiles(d["time"]["samples"], n=4, method="inclusive")
    assert d["time"]["update_seconds_iqr"] == pytest.approx(q[2] - q[0])
    assert d["provenance"]["memory"] == "allocator" and d["provenance"]["tokens_per_second"] == "wall-clock"
    back = load_measurement(json.dumps(d))
    assert back == m
    assert measurement_to_dict(back) == d


def test_budget_smaller_than_parameters_is_a_config_error():
    params = tiny_param_bytes(RunConfig(**SMALL).model)
    with pytest.raises(ConfigError) as e:
        run(RunConfig(**SMALL, memory_budget=params - 1), FAST)
    assert e.value.field == "memory_budget"


def test_budget_below_peak_is_an_oom_budget_outcome(measured):
    cfg = RunConfig(**SMALL)
    peak = measured[0].memory.peak_bytes
    params = tiny_param_bytes(cfg.model)
    budget = (params * 3 + peak) // 2  # holds parameters and AdamW state, not the whole update
    m = run(cfg.replace(memory_budget=budget), FAST)
    assert m.outcome is Outcome.OOM_BUDGET
    assert m.oom_phase in ("forward", "backward", "optimizer")
    assert "memory budget" in m.outcome_detail
    # just above the steady-state peak fits (the first update, creating AdamW's state, is a few bytes higher:
    # its scalar step counters are created inside the tracked window)
    ok = run(cfg.replace(memory_budget=peak + 4096), FAST)
    assert ok.outcome is Outcome.OK and ok.memory.peak_bytes == peak


def test_budget_aborts_at_the_first_allocation_over_it():
    """The tracker refuses as soon as live bytes pass the budget: at most one op's output past it."""
    chunk = 1 << 20
    tracker = StorageTracker(budget=5 * chunk + 100)
    kept = []
    with pytest.raises(BudgetExceeded) as e:
        with tracker:
            for _ in range(100):
                kept.append(torch.empty(chunk, dtype=torch.uint8))
    assert len(kept) == 5  # the sixth allocation was refused (raised right after it was made)
    assert e.value.live_bytes == 6 * chunk
    assert classify_oom(e.value) is OOMKind.BUDGET


def test_cuda_absent_is_a_config_error_on_device():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError) as e:
        run(RunConfig(**SMALL, device="h100-sxm"), FAST)
    assert e.value.field == "device" and "cuda" in str(e.value)
    with pytest.raises(ConfigError) as e:
        run(RunConfig(**SMALL), MeasureOptions(torch_device="cuda"))
    assert e.value.field == "torch_device"


def test_options_validation():
    with pytest.raises(ConfigError) as e:
        MeasureOptions(warmup=0)
    assert e.value.field == "warmup"
    with pytest.raises(ConfigError):
        MeasureOptions(steps=0)


def _real_cpu_oom() -> RuntimeError:
    try:
        torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: c10's DefaultCPUAllocator refuses
    except RuntimeError as e:
        return e
    pytest.skip("the allocator accepted 1 PiB")


@pytest.mark.parametrize("exc, kind", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), OOMKind.DEVICE),
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), OOMKind.CUDA_RUNTIME),
    (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), OOMKind.LIBRARY),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), OOMKind.LIBRARY),
    (RuntimeError("MPS backend out of memory (MPS allocated: 1.2 GB, other allocations: 0 bytes)"), OOMKind.DEVICE),
    (MemoryError(), OOMKind.HOST),
    (RuntimeError("Expected all tensors to be on the same device"), None),
    (ValueError("out of range"), None),
])
def test_oom_classification(exc, kind):
    assert classify_oom(exc) is kind


def test_oom_classification_of_real_and_chained_errors():
    real = _real_cpu_oom()
    assert classify_oom(real) is OOMKind.HOST
    try:
        try:
            raise real
        except RuntimeError as inner:
            raise RuntimeError("while running the model") from inner
    except RuntimeError as outer:
        assert classify_oom(outer) is OOMKind.HOST


def test_observe_records_the_users_own_loop():
    import batchlab

    cfg = RunConfig(**SMALL)
    tr = Trainer(cfg)
    with batchlab.observe(tr.raw_model, tr.optimizer, warmup=2, config=cfg) as obs:
        for _ in range(6):
            with obs.update(tokens=32):
                tr.update(listener=obs)
    m = obs.measurement
    assert m.outcome is Outcome.OK
    assert len(m.time.samples) == 6 - 2 - 1  # two warmup updates and one memory update are not timed
    assert set(m.time.phase_seconds) == {"data", "forward", "backward", "optimizer"}
    # the memory update was the 2nd: it must agree with a tracked 2nd update of an identical trainer
    twin = Trainer(cfg)
    twin.update()
    assert m.memory.peak_bytes == track_update(twin).peak_bytes
    assert m.tokens_per_second == pytest.approx(32 / m.time.update_seconds_median)


def test_observe_records_an_oom_and_reraises():
    import batchlab

    tr = Trainer(RunConfig(**SMALL))
    with pytest.raises(RuntimeError):
        with batchlab.observe(tr.raw_model, tr.optimizer, warmup=1, memory=False) as obs:
            with obs.update():
                obs.mark("forward")
                torch.empty(1 << 50, dtype=torch.uint8)
    assert obs.measurement.outcome is Outcome.OOM and obs.measurement.oom_phase == "forward"


def test_budget_between_forward_and_backward_peaks_stops_in_backward():
    """The refusal propagates out of autograd's backward with its phase (SGD: no optimizer state)."""
    cfg = RunConfig(**SMALL, optimizer="sgd")
    peaks = track_update(Trainer(cfg), steady=False).phase_peaks
    assert peaks["backward"] > peaks["forward"]
    m = run(cfg.replace(memory_budget=(peaks["forward"] + peaks["backward"]) // 2), FAST)
    assert m.outcome is Outcome.OOM_BUDGET and m.oom_phase == "backward"
