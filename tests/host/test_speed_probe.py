"""The host speed probe (host/speed.py) and what compare does with it (experiment.compare.side_speeds,
experiment.diagnosis.time_model_absolute)."""
from __future__ import annotations

import pytest
import torch

from batchlab.experiment.diagnosis import time_model_absolute
from batchlab.host.speed import BUNDLE, SpeedProbe, host_speed


def test_the_probe_allocates_nothing_once_built():
    # a measuring process reads it between timed updates: new allocations would move the heap they reuse
    probe = SpeedProbe()
    with torch.profiler.profile(profile_memory=True) as prof:
        seconds = probe.read(2)
    assert seconds > 0
    assert [e.name for e in prof.events() if e.cpu_memory_usage] == []


def test_host_speed_is_the_median_read_over_the_reference():
    assert host_speed([4e-3, 9e-3, 6e-3], 5e-3) == pytest.approx(1.2)  # median 6 ms over 5 ms: 20% slower
    assert host_speed([], 5e-3) is None and host_speed([4e-3], 0.0) is None


def test_absolute_times_are_set_beside_the_measured_at_the_probed_speed():
    # the formula 200 / 100 ms; measured 300 / 100 ms: A 33% short at the calibration's speed, flagged
    plain = time_model_absolute((0.2, 0.1), (0.3, 0.1))
    assert plain.flagged and "(-33%, +0%) at the calibration's speed" in plain.found
    # the probe took 1.5x its calibration time before A's updates: at that speed A is 300 ms, exact
    probed = time_model_absolute((0.2, 0.1), (0.3, 0.1), {"a": 1.5, "b": 1.0})
    assert not probed.flagged and "A 300.0 ms, B 100.0 ms (+0%, +0%)" in probed.found
    # the probe bounds how far the host moved: B exact at the calibration's speed and 30% short at the probed one
    # is no miss; A 33% short at the calibration's speed and 40% short at a probe that says the host ran faster is
    assert not time_model_absolute((0.2, 0.1), (0.3, 0.1), {"a": 1.5, "b": 0.7}).flagged
    assert time_model_absolute((0.2, 0.1), (0.3, 0.1), {"a": 0.9, "b": 1.0}).flagged
    # 300 ms measured between 200 (calibration) and 400 (a probe at x2): -33% and +33% at the ends, no miss
    wide = time_model_absolute((0.2, 0.1), (0.3, 0.1), {"a": 2.0, "b": 1.0})
    assert not wide.flagged and "moved by more than the check's own 25%" in wide.found  # a pass that says little
    assert "moved by more" not in time_model_absolute((0.2, 0.1), (0.2, 0.1), {"a": 1.1, "b": 0.9}).found


def test_compare_reads_the_speed_of_each_side_over_a_current_calibration(monkeypatch):
    import batchlab.cache.calibrations as record
    from batchlab.experiment import compare
    from batchlab.experiment.protocol import Rounds
    from batchlab.measure.result import MeasuredTime, Measurement, Outcome

    def side(*reads):
        return Measurement(config={}, global_batch=1, outcome=Outcome.OK, time=MeasuredTime(samples=[0.1] * len(reads),
                                                                        probe_seconds=list(reads)))
    rounds = Rounds(a=[side(5e-3, 6e-3), side(7e-3)], b=[side(4e-3, 4e-3), None])

    class Cal:
        probe_seconds, probe = 5e-3, BUNDLE
    monkeypatch.setattr(record, "load_cached", lambda device, threads=None: Cal() if device == "cpu" else None)
    speed = compare.side_speeds(rounds, 1)
    assert (speed["a"], speed["b"]) == (pytest.approx(1.2), pytest.approx(0.8)) and speed["reference_seconds"] == 5e-3
    Cal.probe = "another bundle"  # a reference timed on another bundle says nothing about this one
    assert compare.side_speeds(rounds, 1) == {}
