"""Display units: one formatter per kind of figure, numbers >= 1 in the unit chosen, words for amounts."""
import json

import pytest
from typer.testing import CliRunner

from batchlab.cli import app
from batchlab.util.units import fmt_amount, fmt_bytes, fmt_count, fmt_percent, fmt_value, plural


def run(*args):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.mark.parametrize("x, text", [(2.02e18, "2.02 EFLOP"), (3.1e21, "3.1 ZFLOP"), (4e24, "4e+24 FLOP"),
                                     (6.08e9, "6.08 GFLOP"), (12, "12 FLOP")])
def test_flop_counts_keep_a_prefix_up_to_zetta_then_scientific(x, text):
    assert fmt_count(x, "FLOP") == text


@pytest.mark.parametrize("x, unit, text", [(2.54e9, "B/s", "2.54 GB/s"), (209e6, "B/s", "209 MB/s"),
                                           (3.94e15, "FLOP", "3.94 PFLOP"), (499e6, "B", "499 MB"),
                                           (float("inf"), "B/s", "-"), (None, "FLOP", "-")])
def test_one_si_formatter_for_counts_rates_and_decimal_bytes(x, unit, text):
    # hand-written expected strings; the time model's line once had a second formatter that stopped at tera
    # (3.94e15 FLOP read "3.94e+03 TFLOP"): test_a_placeholder_rate... guards that line itself (no "e+")
    assert fmt_count(x, unit) == text


def test_a_placeholder_rate_is_never_shown_as_a_quantity():
    """A GPU's nominal time model prices element-wise work at the card's HBM bandwidth (H100 SXM datasheet:
    3.35 TB/s), never at a stand-in; a latency-bound loopback fit has no bandwidth (a 1e15 B/s stand-in): said,
    not printed."""
    from batchlab.config import RunConfig
    from batchlab.formula import estimate
    from batchlab.formula.opcost import UNRESOLVED, link_text

    line = next(a for a in estimate(RunConfig(device="h100", precision="bf16-mixed")).assumptions
                if a.startswith("time model:"))
    assert "moved by memory-bound ops at 3.35 TB/s" in line
    assert "e+" not in line
    assert link_text(UNRESOLVED) == "no bandwidth resolved (latency-bound)" and link_text(5e8) == "500 MB/s"


def test_bytes_pick_the_unit_that_keeps_the_number_at_least_one():
    assert fmt_bytes(0.0391 * 2**30) == "40.04 MiB"
    assert fmt_bytes(2**30) == "1.00 GiB" and fmt_bytes(512) == "512 B"


def test_amounts_in_words_plurals_and_percentages():
    assert fmt_amount(1e12, "tokens") == "1 trillion tokens"
    assert fmt_amount(2.5e9, "tokens") == "2.5 billion tokens"
    assert plural(1, "thread") == "1 thread" and plural(2, "thread") == "2 threads"
    assert fmt_percent(0.4215) == "42.1%" and fmt_value(0.5, "fraction") == "50.0%"


def test_estimate_cost_names_its_currency_and_the_budget_in_words():
    r = run("estimate", "--tokens", "1e12", "--price", "2")
    assert "time to 1 trillion tokens" in r.stdout and "USD" in r.stdout and "1 devices" not in r.stdout
    r = run("estimate", "--tokens", "1e9", "--price", "2", "--currency", "EUR", "--json")
    d = json.loads(r.stdout)["time"]
    assert d["cost_currency"] == "EUR" and d["cost_to_tokens"] > 0


def test_mfu_hfu_are_percentages_in_the_table_and_fractions_in_the_json():
    d = json.loads(run("estimate", "--ac", "full", "--json").stdout)
    f, mem = d["flops"], d["memory"]
    assert 0 < f["mfu"] < f["hfu"] < 1
    # both over the same time and peak: their ratio is the FLOP ratio (recompute counted in HFU only)
    assert f["hfu"] / f["mfu"] == pytest.approx(f["hardware_flops_per_update"] / f["model_flops_per_update"])
    # the time model runs kernels at its FLOP ceiling, plus overheads: HFU cannot exceed ceiling / peak
    from batchlab.config import RunConfig

    peak = RunConfig(ac="full").device_spec.peak_flops(RunConfig().precision)
    assert f["hfu"] <= d["time"]["flops_ceiling"] / peak
    out = run("estimate", "--ac", "full").stdout
    assert f"{f['mfu']:.1%}" in out and f"{f['hfu']:.1%}" in out


def test_custom_device_without_fp32_rate_says_it_assumed_one():
    r = run("estimate", "--device", "custom:mem=1GiB,tflops=1")
    assert r.exit_code == 0 and "fp32_tflops" in r.stderr and "125 GFLOP/s" in r.stderr
    r = run("estimate", "--device", "custom:mem=1GiB,tflops=1,fp32_tflops=0.5")
    assert "warning" not in r.stderr
    r = run("estimate", "--device", "custom:mem=1GiB,tflops=1", "--precision", "bf16-mixed")
    assert "warning" not in r.stderr  # the fp32 rate is not used


def test_fit_capacity_lines_pick_a_readable_unit():
    from batchlab.advise import Goal
    from batchlab.advise.plan import assumptions
    from batchlab.config import RunConfig

    goal = Goal(RunConfig(memory_budget=40 * 2**20))
    text = " ".join(assumptions(goal, ()))
    assert "of 40.00 MiB per rank" in text and "0.0391 GiB" not in text


def test_the_json_cost_pays_for_every_device_of_the_layout():
    """dp x tp x pp devices are rented, not dp: price x devices x hours, by hand from the JSON's own time."""
    d = json.loads(run("estimate", "--tokens", "1e9", "--price", "3", "--dp", "2", "--tp", "2", "--json").stdout)
    t = d["time"]
    assert t["cost_to_tokens"] == pytest.approx(3 * 4 * t["time_to_tokens_seconds"] / 3600)
