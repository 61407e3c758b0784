"""`batchlab estimate --trace [--tree] [--json]`: the trace beside the formula, through the command line."""
from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from batchlab.cli import app, main

SMALL = ["--layers", "2", "--seq", "32", "--micro-batch", "2"]


def invoke(*args: str):
    return CliRunner().invoke(app, ["estimate", *args], catch_exceptions=False)


def test_trace_json_has_trace_figures_and_formula_errors():
    result = invoke("--trace", "--json", "--ac", "full", *SMALL)
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    assert d["provenance"] == "trace" and d["global_batch"] == 2
    assert d["memory"]["provenance"] == "trace" and d["flops"]["recompute"] > 0
    rows = {r["figure"]: r for r in d["comparison"]}
    peak = rows["peak tensor bytes"]
    assert peak["trace"] == d["memory"]["peak_bytes"]
    assert peak["formula_error"] == (peak["formula"] - peak["trace"]) / peak["trace"]
    assert d["tree"] is None  # only with --tree


def test_tree_groups_identical_layers_and_says_how_figures_were_obtained():
    result = invoke("--tree", *SMALL)  # --tree implies --trace
    assert result.exit_code == 0, result.output
    out = result.output
    assert "global batch = micro-batch x accum x DP = 2 x 1 x 1 = 2" in out
    assert "(trace)" in out and "kept for backward" in out
    assert "0-1 (x2, each)" in out  # two identical blocks shown once


def test_trace_refusal_is_one_line_exit_2(monkeypatch, capsys):
    # (the trace now runs ZeRO; a --sharding name it does not know is the refusal tested)
    monkeypatch.setattr(sys, "argv", ["batchlab", "estimate", "--trace", "--dp", "2", "--sharding", "zero9", *SMALL])
    with pytest.raises(SystemExit) as exit_:
        main()  # the console script: ConfigError becomes one line and exit 2
    assert exit_.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: sharding:")
