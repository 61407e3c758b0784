"""The steady allocator regime (batchlab.host.regime): batchlab's own measuring processes keep freed memory (no page
faults per update after warmup); the user's process is never changed; other allocators degrade to a warning."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import batchlab
from batchlab.host import regime
from batchlab.config import RunConfig, preset
from batchlab.measure import MeasureOptions
from batchlab.measure.runner import child_env
from batchlab.run import measure

glibc = pytest.mark.skipif(regime.allocator() != "glibc", reason="the regime is glibc's")
# the built-in GPT at a shape whose activations glibc maps and unmaps each update by default (median ~2,000
# faults per update after 3 warm-up updates measured here; 0, with a rare growth of the heap, in the regime)
SHAPE = dict(seq=128, micro_batch=8)
FAULTS = """
import resource, torch
torch.set_num_threads(1)
from batchlab.config import RunConfig, preset
from batchlab.measure.harness import Trainer
t = Trainer(RunConfig(model=preset("tiny"), model_source="builtin").replace(seq=128, micro_batch=8), "cpu")
t.update(); t.update(); t.update()
faults = []
for _ in range(3):  # ~2,000 each: a median of 3 is as far above the bound as one of 5
    f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.update()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)
print(sorted(faults)[1])  # median, as the session reports it
"""


@pytest.mark.host
@pytest.mark.slow
@glibc
def test_isolated_worker_runs_in_the_regime_and_faults_no_pages_after_warmup(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = RunConfig(model=preset("tiny"), model_source="builtin").replace(**SHAPE)
    # the heap reaches its high-water mark within ~3 updates (first touches until then; now and then a few
    # updates later: 1 run in 6 had a median of 512 over 5 timed updates, 0 of 10 over 9)
    m = measure(cfg, MeasureOptions(warmup=3, steps=9, memory=False, isolate=True))
    assert m.ok, m.outcome_detail
    assert m.environment["allocator"].startswith("allocator: glibc, freed memory kept")
    # median: 2-3 in 50 runs as two concurrent loops, with the heap's top touched after warmup (regime.pretouch);
    # before it, 190-520 in ~3% of such runs (the heap's high-water mark creeping up as its free lists
    # fragmented, ~1,000 pages at a time); ~2,000 without the regime (next test)
    assert m.environment["page_faults_per_update"] < 50


@pytest.mark.host
@pytest.mark.slow
@glibc
def test_without_the_regime_the_same_updates_fault_pages_in():
    """The reference for the test above: a process started with the caller's environment minus the regime."""
    env = {k: v for k, v in child_env().items() if k not in regime.STEADY_ENV}
    env["OMP_NUM_THREADS"] = "1"
    plain = float(subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True,
                                 check=True).stdout)
    assert plain > 300


def test_child_env_carries_the_regime_and_keeps_values_the_caller_set(monkeypatch):
    for k in regime.STEADY_ENV:
        monkeypatch.delenv(k, raising=False)
    assert all(child_env()[k] == v for k, v in regime.STEADY_ENV.items())
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1")
    env = child_env()
    assert env["MALLOC_TRIM_THRESHOLD_"] == "1"  # the caller's choice, reported as not the steady regime
    assert not regime.in_effect(env) and "defaults" in regime.describe(env) or regime.allocator() != "glibc"


def test_observe_leaves_the_users_process_as_it_is():
    import mmap

    before = {k: os.environ.get(k) for k in regime.STEADY_ENV}
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pages = 2048  # touched afresh in every update: an anonymous mapping faults each 4 KiB page in once
    with batchlab.observe(model, opt, warmup=1, memory=False) as obs:
        for _ in range(3):
            with obs.update():
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
                with mmap.mmap(-1, pages * mmap.PAGESIZE) as fresh:
                    fresh[::mmap.PAGESIZE] = b"x" * pages
    assert {k: os.environ.get(k) for k in regime.STEADY_ENV} == before
    env = obs.measurement.environment
    assert env["allocator"] == regime.describe()  # this process's own regime, stated
    assert pages <= env["page_faults_per_update"] < 4 * pages  # the user's own faults, counted per update


def test_other_allocators_degrade_to_a_warning(monkeypatch):
    from batchlab.calibrate import run as cal_run

    monkeypatch.setattr(regime, "allocator", lambda: "jemalloc")
    assert not regime.in_effect(regime.steady_env({}))
    assert "jemalloc" in regime.describe() and "does not apply" in regime.describe()
    assert "jemalloc" in regime.warning()
    called = []
    monkeypatch.setattr(cal_run, "measure_here", lambda *a: called.append(a) or "here")
    assert cal_run.measure("cpu", seconds=1.0) == "here"  # no child: the regime cannot be set anyway
    assert called
    m = measure(RunConfig(seq=16, micro_batch=1), MeasureOptions(warmup=1, steps=1, memory=False))
    assert any("jemalloc" in w for w in m.warnings), m.warnings  # the measurement says so beside its figures


@glibc
def test_calibration_outside_the_regime_runs_in_a_child_in_it(monkeypatch):
    from batchlab.calibrate import run as cal_run

    monkeypatch.setattr(regime, "started_with", lambda: {})  # as a process started without the variables
    seen = []
    monkeypatch.setattr(cal_run, "_in_child", lambda args: seen.append(args) or "child")
    assert cal_run.measure("cpu", seconds=1.0, threads=1) == "child"
    assert seen[0]["threads"] == 1


@glibc
def test_a_variable_set_after_start_does_not_count():
    """glibc read the environment when the process started: putting the variables into os.environ later
    changes nothing for this process (they reach only the processes it starts)."""
    env = {k: v for k, v in os.environ.items() if k not in regime.STEADY_ENV}
    code = ("import os; from batchlab.host import regime; os.environ.update(regime.STEADY_ENV); "
            "print(regime.in_effect(), regime.in_effect(dict(os.environ)))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


# a fresh 16 MiB block past the heap's high-water mark, as glibc's fragmenting free lists make one now and then
GROW = """
import ctypes, resource, sys
from batchlab.host import regime
touched = regime.pretouch() if sys.argv[1] == "1" else 0
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
n = 16 * 2**20
f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ctypes.memset(libc.malloc(n), 1, n)
print(touched, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)
"""


@pytest.mark.host
@glibc
@pytest.mark.parametrize("in_regime", [True, False])
def test_pretouch_leaves_heap_growth_nothing_to_fault_in_and_touches_only_a_process_in_the_regime(in_regime):
    env = {k: v for k, v in child_env().items() if in_regime or k not in regime.STEADY_ENV}

    def run(pretouch: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", GROW, pretouch], env=env, capture_output=True, text=True,
                             check=True).stdout.split()
        return int(out[0]), int(out[1])

    pages = 16 * 2**20 // 4096
    touched, faults = run("1")
    if in_regime:  # the top pad (256 MiB) was unused in a process this young: all of it touched, then kept
        assert touched >= 16 * 2**20 and faults < pages // 20
        assert run("0") == (0, pytest.approx(pages, rel=0.1))  # the reference: each page faulted in once
    else:  # glibc defaults (the user's process): nothing touched; the block is a fresh mapping faulted in
        assert touched == 0 and faults == pytest.approx(pages, rel=0.1)


@pytest.mark.parametrize("value", ["1", "abc"])
def test_a_script_whose_own_malloc_values_keep_the_regime_out_starts_once_and_says_so(value):
    """A benchmark script restarts itself into the regime; where the user's own MALLOC_* (kept, never overridden)
    keep it out, a restart cannot help: it runs once, saying so, instead of starting again and again."""
    code = ("import os, sys\n"
            "n = int(os.environ.get('STARTS', '0'))\n"
            "os.environ['STARTS'] = str(n + 1)\n"
            "assert n < 3, 'restarted again and again'\n"
            "from batchlab.host import regime\n"
            "print(n, regime.restart_in_regime())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {"MALLOC_TRIM_THRESHOLD_": value}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("0 measured without the steady allocator regime")
