"""benchmarks/published_compiled.py: a run whose source omits an input the prediction needs is a bound, checked as
one and kept out of the means; such a run must say which way it bounds."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())


def _run(run_id: str, tokens_per_s: float, **extra) -> dict:
    return {"id": run_id, "cli": "--model tiny --seq 64 --micro-batch 2 --device a100-80gb", "source": "s",
            "quote": "q", "gpu": "a100-sxm4-80gb", "gpu_count": 1, "optimizer": "adamw", "compile": "none",
            "measured": {"tokens_per_s_per_gpu": tokens_per_s}, **extra}


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import published_compiled

    return published_compiled


def test_a_bound_is_checked_as_one_and_left_out_of_the_means(script):
    point = script.evaluate(_run("point", 1.0))
    predicted = point.tps_predicted
    point = script.evaluate(_run("point", predicted / 1.1))  # 10% fast by construction
    bound = script.evaluate(_run("bound", predicted / 3, not_typed=["the batch's length"], bound="upper"))
    text = script.document([point, bound])
    assert "| all runs | no runs | no runs | 10.0% over 1 runs |" in text
    assert "| bound | predicted >= measured |" in text and "| yes |" in text
    assert "- bound: the batch's length" in text


def test_a_run_with_an_omitted_input_must_say_which_way_it_bounds(script):
    with pytest.raises(SystemExit, match="bound = one of upper, lower"):
        script.bound_of(_run("r", 1.0, not_typed=["x"], bound="sideways"))
    assert script.bound_of(_run("r", 1.0)) is None
