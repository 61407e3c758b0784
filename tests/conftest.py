"""Suite-wide settings: one torch thread per process.

The suite runs on 2-core machines, often beside other work; with one intra-op thread per process the
in-process tests and the subprocesses they start (isolated runs, DDP ranks) do not oversubscribe the cores.
Semantics do not depend on the thread count; timing assertions are ratios measured within one run.
"""
import os
import sys

from batchlab.host.regime import STEADY_ENV

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by every subprocess a test starts
# Compiled modules cached in the checkout's (ignored) __pycache__ folders: with PYTHONDONTWRITEBYTECODE=1 (set
# on these machines) every process of the run -- the two pytest-xdist workers collecting 59 test modules, and
# each CLI, rank or worker process a test starts -- compiled every batchlab and test module again (~3 s of CPU
# per worker's collection, ~0.3 s per process here)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
os.environ.setdefault("MKL_NUM_THREADS", "1")
# pytest-xdist's workers (started after this) run in batchlab's allocator regime, as its measuring processes do,
# so a calibration in a test needs no child process of its own; tests of the regime build their environments
for _k, _v in STEADY_ENV.items():
    os.environ.setdefault(_k, _v)


def pytest_addoption(parser):
    parser.addoption("--host-profile", default=os.environ.get("BATCHLAB_TEST_HOST_PROFILE"),
                     help="run the suite under another host's calibration (tests/hosts.py: wide-server, old-laptop, "
                          "cheap-dispatch, poisoned, zeros): seeded into the run's calibration cache")


def pytest_configure(config):
    # a calibration cache or notebook on this machine must not change what the tests see; one fresh home for
    # the run, made by the controlling process before pytest-xdist starts its workers (they inherit the
    # environment), so a layer profile or calibration made by one worker serves the others
    if "BATCHLAB_TEST_HOME" not in os.environ:
        import tempfile

        os.environ["BATCHLAB_TEST_HOME"] = tempfile.mkdtemp(prefix="batchlab-tests-")
        config._batchlab_home = os.environ["BATCHLAB_TEST_HOME"]  # made here: removed at unconfigure
    home = os.environ["BATCHLAB_TEST_HOME"]
    os.environ["XDG_CACHE_HOME"] = os.path.join(home, "cache")
    os.environ["XDG_DATA_HOME"] = os.path.join(home, "data")
    # one inductor cache for the run (its workers and the processes they start): a graph compiled once is not
    # compiled again by the next test or process that builds it
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(home, "inductor"))
    profile = config.getoption("--host-profile", default=None)
    if profile and not hasattr(config, "workerinput"):  # once, before the workers start: they share the home
        sys.path.insert(0, os.path.dirname(__file__))
        import hosts

        if profile not in hosts.PROFILES:
            raise pytest.UsageError(f"--host-profile: one of {', '.join(hosts.PROFILES)}, got {profile!r}")
        hosts.seed(profile)
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        return  # pytest-xdist's controller runs no test: torch (~2 s of CPU) stays out of it
    try:
        import torch
    except ImportError:  # the calculator's tests run without torch
        return
    torch.set_num_threads(1)


def pytest_unconfigure(config):
    # the run's home (calibrations, profiles, notebooks: a few MB) is removed by the process that made it; a
    # home given in the environment is the caller's to keep
    home = getattr(config, "_batchlab_home", None)
    if home is not None:
        import shutil

        shutil.rmtree(home, ignore_errors=True)


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _short_calibration():
    """measure and compare calibrate the CPU once per cache (the suite's is fresh): keep that one to a 1 s
    budget in one round (merging rounds is tested by hand in calibrate/test_calibrate.py).  Session-wide, so module
    fixtures (shared launches) get it too."""
    try:
        import batchlab.calibrate.run as cal
    except ImportError:
        yield
        return
    original = cal.measure
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cal, "measure", lambda *a, **k: original(*a, **{**k, "seconds": min(k.get("seconds", 1.0), 1.0),
                                                                  "rounds": k.get("rounds") or 1}))
        yield


@pytest.fixture(autouse=True, scope="session")
def _cli_built_once():
    """typer rebuilds the whole click command tree (every command's typed parameters) on each
    ``CliRunner().invoke(app, ...)`` and ``app()``: ~25 ms, over a thousand times in the suite.  Built once per
    Typer app instead; a click command is reusable (the installed ``batchlab`` builds it once per process, and
    click's own CliRunner runs one command object many times)."""
    try:
        import typer.main
        import typer.testing
    except ImportError:
        yield
        return
    real, built = typer.main.get_command, {}

    def get_command(typer_instance):
        # a command module imported later (batchlab.cli.load_commands) registers more commands: a new tree
        key = (id(typer_instance), len(typer_instance.registered_commands), len(typer_instance.registered_groups))
        if key not in built:  # the app is kept beside its command: its id is not reused while cached
            built[key] = (typer_instance, real(typer_instance))
        return built[key][1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(typer.main, "get_command", get_command)
        mp.setattr(typer.testing, "_get_command", get_command)
        yield


@pytest.fixture(scope="session")
def real_calibration():
    """``real_calibration() -> Calibration``: a fresh copy of one real CPU calibration at one thread (matmuls of
    128 and 256 cubed, one short round) measured once for the run: calibrate/test_calibrate.py and test_checks.py
    assert different things about it, and each measuring its own would time the same matmuls twice.  The first
    worker to ask measures it under a lock in the run's home; the other reads it.  The file is named for the run
    (pytest-xdist's id, which its workers share, or one of this session's own without xdist): a home the caller
    supplies outlives the run, and a later run must measure its own, not read this one's."""
    import fcntl
    import pickle
    import uuid
    from pathlib import Path

    from batchlab.calibrate import measure

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or uuid.uuid4().hex  # a session fixture: one per process
    path = Path(os.environ["BATCHLAB_TEST_HOME"]) / f"real-calibration-{run}.pickle"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not path.exists():
            cal = measure("cpu", seconds=1.0, shapes=((128, 128, 128), (256, 256, 256)), threads=1, rounds=1)
            path.write_bytes(pickle.dumps(cal))
        data = path.read_bytes()
    return lambda: pickle.loads(data)  # a copy per module: a test may change the one it is given


SHADOWS = ("statistics", "json", "random", "typing_extensions")  # stdlib / dependency names a project may shadow


@pytest.fixture(scope="session")
def plant_shadows():
    """``plant(folder) -> marker``: modules named like the stdlib's in ``folder``, each of which, if it ever runs,
    appends its name to ``marker`` and exits: a process started in ``folder`` must not import them."""
    def plant(folder):
        marker = folder / "MARKER"
        for name in SHADOWS:
            (folder / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\n"
                                               "raise SystemExit('a module from the working directory ran')\n")
        return marker

    return plant


def _freeze():
    """Collect, then move every surviving object out of the garbage collector's reach (refcounting still frees
    them): a pytest-xdist worker holds ~0.6 M long-lived objects (torch, transformers, lightning, the test
    modules), which each full collection scanned: 8-14 s of CPU per worker in a run here, 1.5 s once frozen."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(session, config, items):
    """The files with the most ``slow`` tests first, then by their number of tests (pytest-xdist's own order, which
    --no-loadscope-reorder in pyproject.toml hands over to this): pytest-xdist gives each worker whole files in
    this order, so a file of a few long tests (inductor's compiles, torchrun launches) no longer starts last and
    leaves one core idle while it runs.  Within a file the order is kept."""
    slow, count, first = {}, {}, {}
    for i, item in enumerate(items):
        f = item.nodeid.split("::")[0]
        first.setdefault(f, i)
        count[f] = count.get(f, 0) + 1
        slow[f] = slow.get(f, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: (lambda f: (-slow[f], -count[f], first[f]))(item.nodeid.split("::")[0]))


def pytest_collection_finish(session):
    _freeze()  # the imports and the collection


_module: list = [None]


def pytest_runtest_setup(item):
    if item.module is not _module[0]:  # what the previous modules imported and cached stays for the run too
        _module[0] = item.module
        _freeze()


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A calibration cache of the test's own, for tests that save stub calibrations (tests/hosts.py
    ``stub_calibration``): on the run's shared home a stub would price another test's plan, in this worker or in
    the other, with made-up rates."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "private-cache"))


@pytest.fixture
def uncalibrated(tmp_path, monkeypatch):
    """An empty calibration cache: the built-in rates price every op.  For tests whose assertion names which
    plan or preset wins -- a close race that a CPU calibration measured by another test on the run's shared home
    (its rates differ machine to machine) may decide the other way."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    from batchlab.cache.calibrations import load_all

    assert load_all() == {}
