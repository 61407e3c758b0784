"""A card whose peak its source gives only as a range (torchtitan's H100 96GB at 500 W, 'between SXM and NVL'):
the estimate prices both ends, the report and --json say so, and the published pages count a measured rate inside
the range as no error."""
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchlab.config import RunConfig, preset
from batchlab.config.devices import device
from batchlab.formula import estimate

CFG = dict(model=preset("llama-3-8b"), seq=4096, micro_batch=1, accum=2, precision="bf16", ac="full")


def test_the_low_end_prices_matmuls_at_the_low_peak_and_nothing_else_moves():
    high = estimate(RunConfig(device="h100-96gb", **CFG))
    low = high.low_peak_time
    assert low is not None and device("h100-96gb").peak_low == "h100-96gb-low"
    # the matmul class's seconds scale by the peaks' ratio (989 / 835 TF: torchtitan's SXM and NVL figures) ...
    ratio = low.ops.by_class["matmul"] / high.time.ops.by_class["matmul"]
    assert ratio == pytest.approx(989 / 835, rel=0.01)  # large GEMMs: compute-bound, so at the peaks' ratio
    # ... and memory-bound work (same HBM) does not, so the update slows by less than the peaks' ratio
    assert 1 < high.time.tokens_per_second / low.tokens_per_second < 989 / 835
    assert estimate(RunConfig(device="h100-sxm", **CFG)).low_peak_time is None  # a known peak: no range


def test_estimate_shows_the_range_and_json_carries_it():
    from batchlab.cli import app

    args = ["estimate", "--model", "llama-3-8b", "--seq", "4096", "--micro-batch", "1", "--device", "h100-96gb",
            "--precision", "bf16"]
    out = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert out.exit_code == 0 and "low end of the card's peak range (835 TFLOP/s, h100-96gb-low)" in out.output
    d = json.loads(CliRunner().invoke(app, [*args, "--json"]).output)
    assert d["time_at_low_peak"]["device"] == "h100-96gb-low"
    assert d["time_at_low_peak"]["tokens_per_second"] < d["time"]["tokens_per_second"]


def test_a_published_rate_inside_the_range_is_no_error():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from published import range_error

    assert range_error(110.0, 90.0, 100.0) == 0.0
    assert range_error(110.0, 90.0, 120.0) == pytest.approx(-10 / 120)  # above the range: from its high end
    assert range_error(110.0, 90.0, 80.0) == pytest.approx(10 / 80)  # below it: from its low end
    assert range_error(110.0, None, 100.0) == pytest.approx(0.1)  # a known peak: a point
