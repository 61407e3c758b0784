"""Uncontrolled factors: what competed for the CPU during the run, sampled, not only what lived through it."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from batchlab.host.load import LoadSampler, Proc, Usage, cpu_times, tree_cpu_seconds, uncontrolled


def test_usage_counts_processes_born_and_gone_during_the_run_and_not_our_own_tree():
    me = os.getpid()
    start = 100.0  # run start, seconds since boot
    samples = [
        {1: Proc("old", 0, 10.0, 1.0), 50: Proc("ours", me, 0.0, 99.0)},  # at start
        {1: Proc("old", 0, 10.5, 1.0), 2: Proc("short", 0, 0.8, 100.4), 50: Proc("ours", me, 3.0, 99.0),
         51: Proc("grandchild", 50, 2.0, 100.2)},
        {1: Proc("old", 0, 11.0, 1.0), 3: Proc("late", 0, 0.3, 101.0)},  # "short" has gone
    ]
    u = Usage(start, me)
    for s in samples:
        u.add(s)
    used = u.others()
    # by hand: old 11.0 - 10.0; short its whole 0.8 s (born after the start); late 0.3; ours and below excluded
    assert used == {1: ("old", 1.0), 2: ("short", 0.8), 3: ("late", 0.3)}


def test_a_competitor_that_starts_and_ends_during_the_run_is_counted():
    w = LoadSampler(interval=0.1, mine=-1).start()  # mine=-1: our own child counts as a competitor here
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.0: pass"])
    busy.wait()
    time.sleep(0.2)
    f = uncontrolled(w, {}, None)
    names = [p["name"] for p in f["busy_processes"]["top"]]
    assert f["busy_processes"]["count"] >= 1 and any(n.startswith("python") for n in names), f
    assert f["busy_processes"]["samples"] >= 5
    # the busy loop is this process's waited-for child, so the machine-wide figure leaves it out
    assert f["other_cpu"]["cores"] is not None and f["other_cpu"]["cores"] >= 0
    assert w.stop() is w.stop()  # idempotent


def test_our_own_busy_child_is_not_a_competitor():
    w = LoadSampler(interval=0.1).start()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 0.6: pass"])
    child.wait()
    f = uncontrolled(w, {}, None)
    assert child.pid not in {p["pid"] for p in f["busy_processes"]["top"]}
    assert os.getpid() not in {p["pid"] for p in f["busy_processes"]["top"]}


def test_polled_watch_samples_only_when_polled_and_runs_no_thread():
    import threading

    before = set(threading.enumerate())  # another test's watch may still be winding down in this process
    w = LoadSampler(interval=0.1, mine=-1, thread=False, max_share=0.5).start()
    assert not {t for t in threading.enumerate() if t.name == "batchlab-factors"} - before
    w.poll()  # right after start: the spacing has not passed
    assert w.samples == 1
    t0 = time.monotonic()
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.0: pass"])
    while busy.poll() is None:  # the caller's "between updates"
        w.poll()
        time.sleep(0.02)
    elapsed = time.monotonic() - t0
    f = uncontrolled(w, {}, None)
    # >= 1 s of polling at >= 0.1 s spacing: about elapsed / 0.1 samples plus start and stop (not one per poll,
    # every 0.02 s), and the competitor is seen
    assert 4 <= f["busy_processes"]["samples"] <= elapsed / 0.1 + 3
    assert any(p["name"].startswith("python") for p in f["busy_processes"]["top"]), f
    assert "between updates" in f["busy_processes"]["rule"] and f["busy_processes"]["sample_seconds"] > 0


def test_polled_sampling_is_spaced_by_its_own_cost(monkeypatch):
    from batchlab.host import load as factors

    def slow_sample():  # a sample that takes at least 10 ms (a machine with many processes)
        time.sleep(0.01)
        return {}
    monkeypatch.setattr(factors, "cpu_times", slow_sample)
    w = LoadSampler(interval=0.0, thread=False, max_share=0.1).start()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.5:
        w.poll()
    polled = w.samples - 1  # the first is start()'s
    # each >= 10 ms sample is followed by >= 10 ms / 0.1 = 100 ms without one: at most 5 in 0.5 s (by hand)
    assert 2 <= polled <= 5, polled
    assert w.sample_seconds >= 0.01 * polled


# a child that forks a grandchild, which burns CPU and exits, and waits for it, then stays alive: as the
# pre-imported process (host/warm.py) forks the measuring processes and reaps them, alive till batchlab exits
REAPER = """
import os, sys, time
print("ready", flush=True)
sys.stdin.readline()
pid = os.fork()
if pid == 0:
    while time.process_time() < 0.5:
        pass
    print(round(time.process_time(), 3), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print("reaped", flush=True)
sys.stdin.read()
"""


def test_our_tree_counts_what_a_live_child_reaped_from_its_own_children():
    me = os.getpid()
    child = subprocess.Popen([sys.executable, "-c", REAPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        tree0, t0 = tree_cpu_seconds(me, cpu_times()), os.times()
        child.stdin.write("go\n")
        child.stdin.flush()
        burned = float(child.stdout.readline())  # the grandchild's own CPU time, by its own clock
        assert child.stdout.readline().strip() == "reaped"
        tree1, t1 = tree_cpu_seconds(me, cpu_times()), os.times()
    finally:
        child.stdin.close()
        child.wait()
    # the reference the sampler used before: this process's waited-for children, which miss it entirely
    assert t1.children_user + t1.children_system - t0.children_user - t0.children_system < 0.1 * burned
    assert tree1 - tree0 == pytest.approx(burned, abs=0.15)  # + this process's and the child's own few ms
