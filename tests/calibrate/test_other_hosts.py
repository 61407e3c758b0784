"""The commands a user runs first, under other hosts' calibrations (tests/hosts.py): sound ones price with their
rates, degenerate ones are caught (one line, measured again) and nothing crashes.  The whole suite runs under one
profile with ``pytest --host-profile NAME``."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchlab.calibrate import ensure, load_all, save
from batchlab.cli import app
from batchlab.formula.calibration import check

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hosts  # noqa: E402

# the CPU commands of the README's tours and the ones a new user tries first; each reads this CPU's calibration
COMMANDS = [
    ["estimate"],
    ["estimate", "--vary", "micro_batch=1,2,4", "--json"],
    ["explain", "--micro-batch", "1", "--accum", "8"],
    ["fit", "--global-batch", "8", "--no-verify"],
    # the first run of a Hugging Face model's code: the calibration and its own dispatch, measured
    ["measure", "--model", "hf:gpt2", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32",
     "--micro-batch", "2", "--accum", "2", "--precision", "fp32", "--steps", "2", "--warmup", "1"],
]


@pytest.fixture(scope="module")
def base():
    # a real calibration of this CPU at the suite's one thread: the run's own, which measure and compare make in
    # its cache; measured here only where no test before made it, and then left there for the tests after
    return ensure("cpu", threads=1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("profile", sorted(hosts.PROFILES))
def test_first_commands_under_another_hosts_calibration(profile, base, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("BATCHLAB_NOTEBOOK", str(tmp_path / "lab.sqlite"))
    monkeypatch.chdir(tmp_path)
    seeded = hosts.PROFILES[profile](base)
    save(seeded)
    assert bool(check(seeded)) == (profile in hosts.DEGENERATE)
    runner = CliRunner()
    for args in COMMANDS:
        r = runner.invoke(app, args)
        text = " ".join(r.output.split())
        assert r.exit_code == 0 and "Traceback" not in r.output, (args, r.output[-3000:], r.exception)
        if profile in hosts.DEGENERATE and args == COMMANDS[0]:
            assert "warning: ignored the cached calibration" in text
        assert "update time" in text or args[0] in ("explain", "fit")
    cal = load_all()["cpu"]
    assert check(cal) == []  # a degenerate cache has been measured again by `measure`; a sound one kept
    assert (cal.matmul_flops_fp32 == seeded.matmul_flops_fp32) == (profile not in hosts.DEGENERATE)
    r = runner.invoke(app, ["estimate", "--json"])
    import json

    t = json.loads(r.output)["time"]
    assert math.isfinite(t["update_seconds"]) and 0 < t["update_seconds"] < 60  # the tiny model: milliseconds
