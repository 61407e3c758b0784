"""Gloo's all-reduce as a chain of them pays it (calibrate/chain.py): measured once, the first time a tensor-parallel
CPU layout is met, cached with the CPU's calibration, refused where implausible."""
from __future__ import annotations

import dataclasses

import pytest

from batchlab.calibrate import chain, load_cached, save
from batchlab.config import RunConfig
from batchlab.formula.plausible import link_chain_problems, problems

from hosts import stub_calibration

pytestmark = pytest.mark.usefixtures("private_cache", "quiet")  # its stub calibrations stay its own


@pytest.fixture
def quiet(monkeypatch):
    """This machine's own load (other test workers) out of the tests: the load rule is asked, not sampled."""
    from batchlab.formula import calibration

    monkeypatch.setattr(calibration, "loaded_by", lambda other, cores, threads: False)

CURVE = {0.0: 1.9e-3, 0.5e-3: 1.7e-3, 2e-3: 1.8e-3, 8e-3: 3e-3}


def _cal(**extra):
    return dataclasses.replace(stub_calibration(), loopback_bytes_per_s=1e9, loopback_latency_s=1e-3,
                               loopback_warm_latency_s=3e-4, cores=2, **extra)


def test_a_tensor_parallel_layout_gets_the_chain_measured_once(monkeypatch):
    measured = []
    monkeypatch.setattr(chain, "measure", lambda: measured.append(1) or dict(CURVE))
    save(_cal())
    assert chain.ensure((RunConfig(dp=2),), threads=1) is None  # no tensor parallelism: nothing chained
    assert "1.70 ms after 0.5 ms" in chain.ensure((RunConfig(tp=2),), threads=1)
    assert chain.ensure((RunConfig(tp=2, dp=2),), threads=1) is None and measured == [1]  # cached
    assert load_cached("cpu", 1).link_chain_seconds == {"0": 1.9e-3, "0.0005": 1.7e-3, "0.002": 1.8e-3, "0.008": 3e-3}


def test_a_chain_timed_under_others_load_is_not_cached_and_timed_again(monkeypatch):
    from batchlab.formula import calibration

    asked = []
    monkeypatch.setattr(calibration, "loaded_by", lambda other, cores, threads: asked.append(threads) or True)
    monkeypatch.setattr(chain, "measure", lambda: dict(CURVE))
    save(_cal())
    assert "not cached, timed again next time" in chain.ensure((RunConfig(tp=2),), threads=1)
    assert asked[-1] == 2  # the timing asked as two ranks' wall clock, whatever the calibration's threads
    cal = load_cached("cpu", 1)
    assert not cal.link_chain_seconds and "link_chain" not in cal.untimed
    monkeypatch.setattr(calibration, "loaded_by", lambda other, cores, threads: False)
    assert "1.70 ms after 0.5 ms" in chain.ensure((RunConfig(tp=2),), threads=1)


def test_a_failed_or_implausible_chain_is_remembered_and_never_priced(monkeypatch):
    def broken():
        raise RuntimeError("two ranks did not start")

    monkeypatch.setattr(chain, "measure", broken)
    save(_cal())
    tp = (RunConfig(tp=2),)
    assert "not measured (two ranks did not start)" in chain.ensure(tp, threads=1)
    assert chain.ensure(tp, threads=1) is None  # remembered until the next calibration
    # a stall of a second a call, or a mean below the link's own back-to-back median of one message: not cached
    for wild in ({0.0: 1.0}, {0.0: 1e-4, 2e-3: 2e-3}):
        monkeypatch.setattr(chain, "measure", lambda wild=wild: dict(wild))
        save(_cal())
        assert "chained all-reduce" in chain.ensure(tp, threads=1)
        assert load_cached("cpu", 1).link_chain_seconds == {}


def test_a_cache_edited_to_a_wild_chain_is_refused_where_calibrations_are_read():
    assert not problems(_cal(link_chain_seconds={"0": 1.9e-3, "0.002": 1.8e-3}))
    for wild in ({"0": float("nan")}, {"-1": 2e-3}, {"x": 2e-3}, {"0": 0.5}):
        assert link_chain_problems(wild, 3e-4)
        assert any("chained all-reduce" in p for p in problems(_cal(link_chain_seconds=wild)))


@pytest.mark.host
@pytest.mark.slow
def test_two_real_ranks_give_a_plausible_chain():
    got = chain.measure(gaps=(0.0, 1e-3), chains=2, launches=1)
    assert set(got) == {0.0, 1e-3} and not link_chain_problems({f"{g:g}": s for g, s in got.items()}, 0.0), got
