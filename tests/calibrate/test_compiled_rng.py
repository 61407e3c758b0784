"""Inductor's in-kernel RNG (calibrate/compiled_rng.py): timed once against bernoulli_ where a compiled model with
dropout is measured on this CPU, cached with the calibration as a per-element rate, and priced for the numbers a
compiled block draws (tests/formula/test_fusion.py, tests/trace/test_compiled_trace.py)."""
from __future__ import annotations

import pytest

from batchlab.calibrate import compiled_rng, load_cached, save
from batchlab.config import RunConfig, preset

from hosts import stub_calibration

pytestmark = pytest.mark.usefixtures("private_cache")  # its stub calibrations stay its own

DROPOUT = RunConfig(model=preset("tiny", layers=1), seq=16, micro_batch=1, compile="blocks")
# the in-kernel arithmetic and bool-load rates over bernoulli_ (stubbed: timing them compiles six kernels)
IN_KERNEL = {**{k: 0.25 for k in compiled_rng.ARITHMETIC_KEYS}, compiled_rng.SOFTMAX_KEY: 0.1,
             compiled_rng.MASK_LOAD_KEY: 0.125, compiled_rng.MASK_LOAD_RANDOM_KEY: 0.25}


@pytest.fixture(autouse=True)
def _in_kernel_stubbed(monkeypatch):
    calls = []
    monkeypatch.setattr(compiled_rng, "measure_in_kernel",
                        lambda seconds=compiled_rng.SECONDS: calls.append(1) or IN_KERNEL)
    return calls


def test_ensure_times_the_rng_once_for_a_compiled_dropout_model_and_caches_its_rate(monkeypatch):
    calls = []
    monkeypatch.setattr(compiled_rng, "measure", lambda seconds=compiled_rng.SECONDS: calls.append(1) or 2.5)
    monkeypatch.setattr(compiled_rng, "measure_mask", lambda seconds=compiled_rng.SECONDS: calls.append(2) or 1.5)
    assert compiled_rng.ensure(DROPOUT, threads=1) is None and not calls  # no calibration: nothing to scale
    save(stub_calibration(element_seconds={"random:fp32": 6e-9, **{k: 1e-9 for k in IN_KERNEL}}))
    for eager_or_no_dropout in (DROPOUT.replace(compile="none"), DROPOUT.replace(model=preset("tiny", layers=1,
                                                                                               dropout=0.0))):
        assert compiled_rng.ensure(eager_or_no_dropout, threads=1) is None and not calls
    line = compiled_rng.ensure(DROPOUT, threads=1)
    assert "x2.50 per element" in line and "15.0 ns" in line  # 2.5 x bernoulli_'s 6 ns
    assert "bool mask store" in line and "x1.50 per element" in line and "9.0 ns" in line
    rates = load_cached("cpu", 1).element_seconds
    assert rates[compiled_rng.KEY] == pytest.approx(15e-9) and rates[compiled_rng.MASK_KEY] == pytest.approx(9e-9)
    assert compiled_rng.ensure(DROPOUT, threads=1) is None and calls == [1, 2]  # cached: timed once


def test_a_calibration_with_the_rng_alone_times_the_mask_store_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(compiled_rng, "measure", lambda seconds=compiled_rng.SECONDS: calls.append(1) or 2.5)
    monkeypatch.setattr(compiled_rng, "measure_mask", lambda seconds=compiled_rng.SECONDS: calls.append(2) or 1.5)
    save(stub_calibration(element_seconds={"random:fp32": 6e-9, compiled_rng.KEY: 14e-9,
                                           **{k: 1e-9 for k in IN_KERNEL}}))
    assert "bool mask store" in compiled_rng.ensure(DROPOUT, threads=1) and calls == [2]
    assert load_cached("cpu", 1).element_seconds[compiled_rng.KEY] == pytest.approx(14e-9)


def test_a_failed_or_senseless_timing_caches_nothing(monkeypatch):
    save(stub_calibration(element_seconds={"random:fp32": 6e-9}))

    def no_compiler(seconds=compiled_rng.SECONDS):
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")

    monkeypatch.setattr(compiled_rng, "measure", no_compiler)
    monkeypatch.setattr(compiled_rng, "measure_mask", no_compiler)
    assert "not timed (InvalidCxxCompiler" in compiled_rng.ensure(DROPOUT, threads=1)
    save(stub_calibration(element_seconds={"random:fp32": 6e-9}))  # a fresh calibration: timed again
    monkeypatch.setattr(compiled_rng, "measure", lambda seconds=compiled_rng.SECONDS: float("nan"))
    monkeypatch.setattr(compiled_rng, "measure_mask", lambda seconds=compiled_rng.SECONDS: float("nan"))
    assert "not cached" in compiled_rng.ensure(DROPOUT, threads=1)
    assert not {compiled_rng.KEY, compiled_rng.MASK_KEY} & set(load_cached("cpu", 1).element_seconds)


def test_an_in_kernel_rate_a_thousand_times_the_bulk_draw_is_neither_cached_nor_read(monkeypatch):
    from batchlab.formula.plausible import problems

    save(stub_calibration(element_seconds={"random:fp32": 6e-9}))
    monkeypatch.setattr(compiled_rng, "measure", lambda seconds=compiled_rng.SECONDS: 1000.0)
    monkeypatch.setattr(compiled_rng, "measure_mask", lambda seconds=compiled_rng.SECONDS: 2.0)
    assert "timed at 1e+03 x ATen's bernoulli_" in compiled_rng.ensure(DROPOUT, threads=1)
    cached = load_cached("cpu", 1)
    assert compiled_rng.KEY not in cached.element_seconds and cached.element_seconds[compiled_rng.MASK_KEY] == 12e-9
    # a cache edited (or written by an older batchlab) to the same 1000x is flagged where calibrations are read
    cached.element_seconds[compiled_rng.KEY] = 6e-6
    assert any(compiled_rng.KEY in p and "x1e+03" in p for p in problems(cached))
    cached.element_seconds[compiled_rng.KEY] = 12e-9
    assert not any(compiled_rng.KEY in p for p in problems(cached))


def test_any_compiled_model_times_inductors_in_kernel_arithmetic_once_and_an_eager_one_none(_in_kernel_stubbed):
    # no dropout: the RNG's rates are not wanted, the in-kernel tanh, exp, ..., softmax and bool-load rates are
    plain = DROPOUT.replace(model=preset("tiny", layers=1, dropout=0.0))
    save(stub_calibration(element_seconds={"random:fp32": 8e-9}))
    assert compiled_rng.ensure(plain.replace(compile="none"), threads=1) is None and not _in_kernel_stubbed
    line = compiled_rng.ensure(plain, threads=1)
    assert "in-kernel arithmetic" in line and "tanh 2.00 ns" in line and "mask_load 1.00 ns" in line  # x 8 ns
    rates = load_cached("cpu", 1).element_seconds
    assert rates["activation/inductor_tanh:fp32"] == pytest.approx(2e-9)
    assert rates[compiled_rng.SOFTMAX_KEY] == pytest.approx(0.8e-9)
    assert compiled_rng.KEY not in rates and compiled_rng.MASK_KEY not in rates
    assert compiled_rng.ensure(plain, threads=1) is None and _in_kernel_stubbed == [1]  # cached: timed once


def test_an_in_kernel_rate_a_hundredfold_from_atens_kernel_of_the_op_is_implausible():
    """A cached in-kernel tanh checked against ATen's tanh (its fallback): a stalled or zero timing is refused, a
    vectorised in-loop rate well below ATen's kernel is not."""
    from batchlab.formula.plausible import in_kernel_problems

    rates = {"activation/tanh:fp32": 2.5e-9, "random:fp32": 6e-9}
    assert not in_kernel_problems({**rates, "activation/inductor_tanh:fp32": 1.5e-9})
    assert not in_kernel_problems({**rates, "activation/inductor_tanh:fp32": 0.1e-9})
    (bad,) = in_kernel_problems({**rates, "activation/inductor_tanh:fp32": 1e-14})
    assert "activation/inductor_tanh:fp32" in bad and "ATen's activation/tanh:fp32" in bad
    assert in_kernel_problems({**rates, "random/inductor_random:fp32": 1e-12})  # the RNG's own band, as before


def test_a_failed_timing_is_remembered_and_not_retried_until_the_next_calibration(monkeypatch, _in_kernel_stubbed):
    """Each compiled measure on a host where inductor cannot time a rate would otherwise compile and fail again."""
    calls = []

    def no_compiler(seconds=compiled_rng.SECONDS):
        calls.append(1)
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")

    monkeypatch.setattr(compiled_rng, "measure", no_compiler)
    monkeypatch.setattr(compiled_rng, "measure_mask", no_compiler)
    monkeypatch.setattr(compiled_rng, "measure_in_kernel", no_compiler)
    save(stub_calibration(element_seconds={"random:fp32": 6e-9}))
    line = compiled_rng.ensure(DROPOUT, threads=1)
    assert "in-kernel arithmetic not timed (InvalidCxxCompiler" in line and "bool mask store not timed" in line
    assert len(calls) == 3
    cached = load_cached("cpu", 1)
    assert cached.untimed[compiled_rng.KEY].startswith("InvalidCxxCompiler")
    assert compiled_rng.SOFTMAX_KEY in cached.untimed and compiled_rng.KEY not in cached.element_seconds
    assert compiled_rng.ensure(DROPOUT, threads=1) is None and len(calls) == 3  # remembered: not tried again
    save(stub_calibration(element_seconds={"random:fp32": 6e-9}))  # a fresh calibration tries again
    compiled_rng.ensure(DROPOUT, threads=1)
    assert len(calls) == 6


def test_a_calibration_lacking_the_random_mask_rate_adds_it_and_keeps_the_rates_it_has(_in_kernel_stubbed):
    """A cache written before the dropout mask's own read rate existed: the next compiled measure times it; the
    rates already cached (which earlier figures were priced with) stay as they were."""
    plain = DROPOUT.replace(model=preset("tiny", layers=1, dropout=0.0))
    older = {k: 3e-9 for k in IN_KERNEL if k != compiled_rng.MASK_LOAD_RANDOM_KEY}
    save(stub_calibration(element_seconds={"random:fp32": 8e-9, **older}))
    assert "mask_load_random 2.00 ns" in compiled_rng.ensure(plain, threads=1)  # 0.25 x 8 ns
    rates = load_cached("cpu", 1).element_seconds
    assert rates[compiled_rng.MASK_LOAD_RANDOM_KEY] == pytest.approx(2e-9)
    assert all(rates[k] == 3e-9 for k in older)

