"""The warm worker (batchlab.host.warm): isolated CPU measurements forked from one pre-imported process.

Who imported torch (and transformers) is counted by a ``sitecustomize`` on the children's PYTHONPATH: an import
hook that writes the pid of every process in which ``import torch`` (``import transformers``) runs.  Each fork writes its pid and parent pid from the
model factory it measures."""
from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from batchlab.config import RunConfig
from batchlab.host import warm
from batchlab.measure import MeasureOptions, Outcome
from batchlab.run import measure

linux = pytest.mark.skipif(not (warm.ENABLED and Path("/proc/self/stat").exists()), reason="fork + /proc")
OPTS = MeasureOptions(warmup=1, steps=2, isolate=True)

SITECUSTOMIZE = '''
import os, sys
class _Count:
    def find_spec(self, name, path=None, target=None):
        if name in ("torch", "transformers"):
            with open(os.environ["BL_TORCH_IMPORTS" if name == "torch" else "BL_HF_IMPORTS"], "a") as f:
                f.write(f"{os.getpid()}\\n")
        return None
sys.meta_path.insert(0, _Count())
'''
FACTORY = '''
import os, torch.nn as nn
from batchlab.models import synthetic_tokens

def small(cfg):
    with open(os.environ["BL_FORKS"], "a") as f:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split()[0]
        f.write(f"{os.getpid()} {os.getppid()} {test}\\n")
    return nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64)), synthetic_tokens(64, cfg.data)
'''


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """(config, torch-importing pids, (pid, ppid) of each measuring process), read after the runs; one
    environment for the module's tests, so that they share a pre-imported process as batchlab's runs do."""
    tmp = tmp_path_factory.mktemp("warm")
    name = f"bl_warm_{uuid.uuid4().hex[:8]}"
    (tmp / f"{name}.py").write_text(FACTORY)
    (tmp / "sitecustomize.py").write_text(SITECUSTOMIZE)
    imports, forks = tmp / "imports.txt", tmp / "forks.txt"

    def read(path):
        rows = [line.split() for line in path.read_text().split("\n") if line] if path.exists() else []
        return [(*map(int, r[:2]), *r[2:]) for r in rows]

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(tmp))
        mp.setenv("BL_TORCH_IMPORTS", str(imports))
        mp.setenv("BL_FORKS", str(forks))
        mp.setenv("BL_HF_IMPORTS", str(tmp / "hf_imports.txt"))
        # a pre-imported process of the module's own, started with the counting sitecustomize: one an earlier
        # test started would serve this PYTHONPATH too (it only adds entries)
        warm._close()
        yield RunConfig(model_source=f"{name}:small", seq=16, micro_batch=2), lambda: read(imports), lambda: read(forks)


@pytest.mark.slow
@linux
def test_two_runs_import_torch_once_and_fork_twice_and_measure_what_a_fresh_worker_does(counted, monkeypatch):
    cfg, imports, forks = counted
    a, b = measure(cfg, OPTS), measure(cfg, OPTS)
    server = warm.server_pid()
    assert a.ok and b.ok and a.environment["worker"] == b.environment["worker"] == warm.FORKED
    assert imports() == [(server,)]  # torch imported in the pre-imported process only, not in the forks
    (pa, ppa, _), (pb, ppb, _) = forks()
    assert ppa == ppb == server and pa != pb and server not in (pa, pb)
    monkeypatch.setattr(warm, "ENABLED", False)  # the reference: today's fresh process
    fresh = measure(cfg, OPTS)
    assert fresh.environment["worker"] == warm.FRESH
    [(pid,)], (fresh_pid, fresh_ppid, _) = imports()[1:], forks()[2]
    assert pid == fresh_pid and fresh_ppid == os.getpid()  # it imported torch itself, as a child of this one
    for m in (a, b):  # same code, same seed: the same tensors, to the byte
        assert m.memory.peak_bytes == fresh.memory.peak_bytes and m.memory.breakdown == fresh.memory.breakdown


@pytest.mark.slow
@linux
def test_a_hugging_face_models_libraries_are_imported_once_by_the_pre_imported_process(counted, tmp_path):
    """transformers (host/preload.py) imported by the pre-imported process on the first request for a
    Hugging Face model, not by its forks, which measure what the same update measures in this process."""
    from batchlab.measure.runner import HF_LIBRARIES as HF
    from hf_shapes import config_dir, hf_cfg

    pytest.importorskip("transformers")
    hf = hf_cfg(config_dir(tmp_path, "llama"), seq=16, micro_batch=2)
    a, b = measure(hf, OPTS), measure(hf, OPTS)
    server = warm.server_pid()
    assert a.ok and b.ok and a.environment["worker"] == b.environment["worker"] == warm.FORKED
    logged = Path(os.environ["BL_HF_IMPORTS"]).read_text().split()
    assert logged == [str(server)] and not warm._not_preloaded.intersection(HF)
    here = measure(hf, MeasureOptions(warmup=1, steps=2))  # the same update in this process
    for m in (a, b):
        assert m.memory.peak_bytes == here.memory.peak_bytes and m.memory.breakdown == here.memory.breakdown


def test_a_fork_is_refused_where_a_fresh_process_would_import_the_libraries_differently(tmp_path, monkeypatch):
    """Once imported, a request whose import-time variables differ, or whose PYTHONPATH adds another copy of a
    package they brought, is refused (the runner starts a fresh process); nothing is imported for the first."""
    import sys

    from batchlab.host.preload import Loaded

    own = {"HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": "/c", "OTHER": "x"}
    libs = Loaded()
    assert libs.refusal(own, {}, []) is None  # nothing imported yet: any fork sees what a fresh process would
    name = f"bl_lib_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    libs.load([name], own, {**own, "XDG_CACHE_HOME": "/elsewhere"})
    assert name not in sys.modules and libs.packages == set()  # not imported under other import-time variables
    libs.load([name], own, {**own, "OTHER": "y"})
    assert sys.modules.pop(name) and libs.packages == {name}
    libs.packages = {"transformers", "tokenizers"}
    assert libs.refusal(own, {**own, "OTHER": "y"}, [str(tmp_path)]) is None  # read later: the fork's own
    assert "HF_" in libs.refusal(own, {**own, "HF_HUB_OFFLINE": "0"}, [])
    assert "HF_" in libs.refusal(own, {"HF_HUB_OFFLINE": "1"}, [])  # XDG_CACHE_HOME unset: HF_HOME differs
    (tmp_path / "tokenizers").mkdir()
    (tmp_path / "tokenizers" / "__init__.py").write_text("")
    assert libs.refusal(own, own, [str(tmp_path)]) == "the run's PYTHONPATH has its own tokenizers"


@pytest.mark.slow
@linux
def test_a_killed_pre_imported_process_is_started_again(counted):
    cfg, imports, forks = counted
    assert measure(cfg, OPTS).ok
    first, before = warm.server_pid(), len(imports())
    os.kill(first, signal.SIGKILL)
    end = time.monotonic() + 10
    while warm.server_pid() is not None and time.monotonic() < end:  # gone (one that dies as a run starts: fresh)
        time.sleep(0.05)
    m = measure(cfg, OPTS)
    second = warm.server_pid()
    assert m.ok and m.environment["worker"] == warm.FORKED and second not in (None, first)
    assert imports()[before:] == [(second,)]  # the one new import: the process started again
    (_, ppa, test_a), (_, ppb, test_b) = forks()[-2:]
    assert (ppa, ppb) == (first, second)
    # a pre-imported process started for the previous test (pytest's variable aside, the same environment)
    # serves this one, and its fork runs in this run's environment, as a fresh worker would
    assert test_a == test_b == "test_a_killed_pre_imported_process_is_started_again"


@pytest.mark.slow
@linux
def test_a_folder_added_to_the_path_and_other_variables_are_the_forks_own(counted, tmp_path, monkeypatch):
    """A run whose PYTHONPATH adds a folder (a factory written after the pre-imported process started) and whose
    other variables differ (not read at start-up) is forked from the same process: the fork imports from that
    folder and sees its run's variables.  (Which variables start another: the next test.)"""
    cfg, imports, forks = counted
    assert measure(cfg, OPTS).ok
    server, before = warm.server_pid(), len(imports())
    name = f"bl_added_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    m = measure(cfg.replace(model_source=f"{name}:small"), OPTS)
    assert m.ok and m.environment["worker"] == warm.FORKED and warm.server_pid() == server
    assert len(imports()) == before
    _, ppid, test = forks()[-1]
    assert ppid == server and test == "test_a_folder_added_to_the_path_and_other_variables_are_the_forks_own"


class _FakeServer:
    started: list[dict] = []

    def __init__(self, env):
        if env.get("FAIL"):
            raise OSError("would not start")
        self.env, self.up = env, True
        self.started.append(env)

    def alive(self):
        return self.up

    def close(self):
        self.up = False


def test_one_pre_imported_process_per_environment_and_none_where_it_cannot_start(monkeypatch):
    monkeypatch.setattr(warm, "_Server", _FakeServer)
    monkeypatch.setattr(warm, "_server", None)
    monkeypatch.setattr(warm, "_failed_env", None)
    monkeypatch.setattr(warm, "ENABLED", True)
    _FakeServer.started = []
    one = warm.pre_imported({"PYTHONPATH": "a"})
    assert warm.pre_imported({"PYTHONPATH": "a"}) is one  # the same environment: the same process
    two = warm.pre_imported({"PYTHONPATH": "b"})  # a test changed PYTHONPATH: a new one, the old one ended
    assert two is not one and not one.up and two.up
    # an entry added, or a variable read only after start-up: the same process; one read at start-up: a new one
    assert warm.pre_imported({"PYTHONPATH": os.pathsep.join(["c", "b"]), "HOME": "/h", "RANK": "1"}) is two
    for startup in ({"OMP_NUM_THREADS": "2"}, {"MALLOC_TOP_PAD_": "1"}, {"TORCH_LOGS": "x"}, {"PYTHONHASHSEED": "0"}):
        assert warm.pre_imported({"PYTHONPATH": "b", **startup}) is not two and not two.up, startup
        two = warm.pre_imported({"PYTHONPATH": "b"})
    assert len(_FakeServer.started) == 2 + 2 * 4
    two.up = False  # it died: started again
    three = warm.pre_imported({"PYTHONPATH": "b"})
    assert three is not two and three.up and len(_FakeServer.started) == 11
    assert warm.pre_imported({"FAIL": "1"}) is None and not three.up  # cannot start: the caller goes fresh
    assert warm.pre_imported({"FAIL": "1"}) is None and len(_FakeServer.started) == 11  # and is not tried again
    monkeypatch.setattr(warm, "ENABLED", False)  # no fork on this platform (macOS/Windows spawn)
    assert warm.pre_imported({"PYTHONPATH": "a"}) is None


def test_a_gpu_measurement_is_never_forked(monkeypatch):
    """CUDA is initialised by the measurement: a fresh process, never a fork (the device read without torch)."""
    from batchlab.measure import runner

    started = []

    class Started(Exception):
        pass

    def fake_popen(cmd, **kw):
        started.append(cmd)
        raise Started

    def no_fork(env):
        raise AssertionError("a GPU measurement asked for the pre-imported process")

    monkeypatch.setattr(runner.subprocess, "Popen", fake_popen)
    monkeypatch.setattr(warm, "pre_imported", no_fork)
    gpu = [(RunConfig(device="h100"), OPTS), (RunConfig(), MeasureOptions(isolate=True, torch_device="cuda:1"))]
    for cfg, opts in gpu:
        with pytest.raises(Started):
            runner.run_isolated(cfg, opts)
    assert len(started) == 2 and all(c[-2:-1] == ["batchlab.measure.worker"] for c in started)
    asked = []
    monkeypatch.setattr(warm, "pre_imported", asked.append)  # the reference: a CPU one does ask (None: fresh)
    with pytest.raises(Started):
        runner.run_isolated(RunConfig(device="h100"), MeasureOptions(isolate=True, torch_device="cpu"))
    assert len(asked) == 1 and len(started) == 3
