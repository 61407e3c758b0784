"""How much of gloo's link is the ranks' own CPU work (calibrate/shared_link.py): measured once, the first time a
layout whose local ranks outnumber the cores is met, and cached with the CPU's calibration."""
from __future__ import annotations

import dataclasses

import pytest

from batchlab.calibrate import load_cached, save, shared_link
from batchlab.calibrate import run as run_mod
from batchlab.config import RunConfig

from hosts import stub_calibration

pytestmark = pytest.mark.usefixtures("private_cache")  # its stub calibrations stay its own


def test_a_layout_whose_ranks_outnumber_the_cores_gets_the_links_cpu_part_measured_once(monkeypatch):
    measured = []
    monkeypatch.setattr(shared_link, "measure", lambda: measured.append(1) or {"message": 2e-4, "byte": 4e-10,
                                                                               "message_wall": 7e-4, "byte_wall": 1e-9})
    save(dataclasses.replace(stub_calibration(), loopback_bytes_per_s=1e9, loopback_latency_s=7e-4, cores=2))
    assert shared_link.ensure((RunConfig(dp=2),), threads=1) is None  # 2 ranks on 2 cores: a core each
    assert "200 us a message" in shared_link.ensure((RunConfig(dp=2, tp=2),), threads=1)  # 4 ranks on 2 cores
    assert shared_link.ensure((RunConfig(dp=2, tp=2),), threads=1) is None  # cached: measured once
    assert measured == [1]
    assert load_cached("cpu", 1).link_cpu_seconds == {"message": 2e-4, "byte": 4e-10}


def test_a_failed_or_implausible_measurement_is_remembered_and_never_priced(monkeypatch):
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("two ranks did not start")

    monkeypatch.setattr(shared_link, "measure", broken)
    save(dataclasses.replace(stub_calibration(), loopback_bytes_per_s=1e9, loopback_latency_s=7e-4, cores=2))
    four = (RunConfig(dp=2, tp=2),)
    assert "not measured (two ranks did not start)" in shared_link.ensure(four, threads=1)
    assert shared_link.ensure(four, threads=1) is None and calls == [1]  # remembered until the next calibration
    # a CPU part a thousand times the link's own per-message cost, or negative, is not cached
    for wild in ({"message": 0.7, "byte": 4e-10}, {"message": 2e-4, "byte": -5.0}):
        monkeypatch.setattr(shared_link, "measure", lambda wild=wild: dict(wild, message_wall=7e-4, byte_wall=1e-9))
        save(dataclasses.replace(stub_calibration(), loopback_bytes_per_s=1e9, loopback_latency_s=7e-4, cores=2))
        assert "link CPU part per" in shared_link.ensure(four, threads=1)
        assert load_cached("cpu", 1).link_cpu_seconds == {}
    # a cache edited to such a figure is refused where calibrations are read (formula/plausible.py)
    from batchlab.formula.plausible import problems

    cal = dataclasses.replace(stub_calibration(), loopback_bytes_per_s=1e9, loopback_latency_s=7e-4, cores=2,
                              link_cpu_seconds={"message": 0.7, "byte": 4e-10})
    assert any("link CPU part per message" in p for p in problems(cal))
    assert not problems(dataclasses.replace(cal, link_cpu_seconds={"message": 2e-4, "byte": 4e-10}))


def test_unknown_cores_want_no_measurement():
    # formula/timing.py's sharing stretches nothing where the calibration did not record its cores
    assert not shared_link.wanted((RunConfig(dp=2),), cores=0, threads=1)
    assert shared_link.wanted((RunConfig(dp=2, tp=2),), cores=2, threads=1)


def test_auto_asks_for_the_links_cpu_part(monkeypatch):
    seen = []
    monkeypatch.setattr(run_mod, "ensure", lambda device, threads=None, scope=(): (None, False))
    monkeypatch.setattr(run_mod.dtensor, "ensure", lambda cfgs, threads=None: None)
    monkeypatch.setattr(shared_link, "ensure", lambda cfgs, threads=None: seen.append(cfgs) or "measured")
    assert run_mod.auto("cpu", threads=1, cfgs=(RunConfig(dp=4),)) == "measured"
    assert seen == [(RunConfig(dp=4),)]


@pytest.mark.host
@pytest.mark.slow
def test_the_links_cpu_part_is_a_part_of_its_wall_clock():
    # two real ranks: the CPU seconds of a message and of a byte are positive and no more than their wall-clock
    # (the ranks' CPU work happens inside the all-reduce they time)
    got = shared_link.measure(samples=10)
    # (measure clamps a two-size difference that overshoots at 0; gloo's threads may run beside the main one on
    # another core, so the process's CPU time may pass the wall-clock by up to a thread's worth)
    assert 0 <= got["message"] <= got["message_wall"] * 2, got
    assert 0 <= got["byte"] <= got["byte_wall"] * 2, got
