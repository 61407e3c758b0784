"""Each command asks the layer profile, before it computes anything, for every precision and layer policy its
derived configs read (formula/memory.py: AC none reads the whole layer's terms, full the checkpointed block's,
every:K both), so none of its rows falls back to the builtin terms.  Nothing is traced here: the tracer is
replaced by one that notes what it was asked; the real tracing and merging: tests/trace/test_layer_profile.py."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from batchlab.cli import app
from hf_shapes import config_dir

pytest.importorskip("transformers")


@pytest.fixture
def asked(monkeypatch):
    from batchlab.trace import profile as tracing

    out = []

    def with_profile(cfg, policies=None):  # profiles nothing: a later call asks again, so asks are summed
        out.append((str(cfg.precision), frozenset(policies)))
        return cfg

    monkeypatch.setattr(tracing, "with_profile", with_profile)
    return out


@pytest.mark.parametrize("args, wanted", [
    # fit searches every AC policy; its advice after an OOM also proposes bf16 autocast at the given --ac
    (["fit", "--global-batch", "8", "--after-oom"], {"fp32": {"full", "checkpointed", "selective"},
                                                     "bf16-mixed": {"full"}}),
    (["fit", "--global-batch", "8", "--ac", "selective", "--no-verify"], {"fp32": {"selective"}}),  # held
    (["compare", "--change", "ac=none:every:2", "--formula-only", "--predict", "none"],
     {"fp32": {"full", "checkpointed"}}),
    (["explain"], {"fp32": {"full", "checkpointed"}}),  # "turning it on (full)"
    (["estimate"], {"fp32": {"full"}}),
    (["estimate", "--trace", "--ac", "full"], {"fp32": {"checkpointed"}}),  # the formula beside the trace
    (["estimate", "--vary", "precision=fp32,bf16"], {"fp32": {"full"}, "bf16": {"full"}}),
    (["estimate", "--vary", "ac=selective,selective-op"], {"fp32": {"full", "selective"}}),  # -op: not profiled
    (["estimate", "--ac", "selective-op", "--vary", "ac=selective-op,none"], {"fp32": {"full"}}),
])
def test_a_command_asks_for_every_policy_and_precision_it_evaluates(tmp_path, asked, args, wanted):
    model = ["--model", f"hf:{config_dir(tmp_path, 'llama')}", "--seq", "64"]
    r = CliRunner().invoke(app, [*args, *model, "--notebook", str(tmp_path / "nb.sqlite")]
                           if args[0] == "compare" else [*args, *model])
    assert r.exit_code in (0, 1), r.output  # fit: 1 when nothing fits
    got: dict[str, set[str]] = {}
    for precision, policies in asked:
        got.setdefault(precision, set()).update(policies)
    assert got == wanted


@pytest.mark.parametrize("args, field", [
    (["compare", "--change", "micro_batch=2"], "change"),  # A:B expected
    (["compare", "--change", "micro_batch=1:2", "--change", "seq=64:128"], "change"),  # confounded
    (["estimate", "--vary", "micro_batch"], "vary"),
    (["estimate", "--trace", "--vary", "micro_batch=1,2"], "trace"),
    (["fit", "--global-batch", "8", "--global-tokens", "100"], "global_tokens"),
    (["measure", "--timeline", "peak.txt"], "timeline"),
])
def test_a_mistyped_option_fails_before_the_model_is_profiled(tmp_path, asked, args, field):
    """A model with no cached profile (first use: seconds of tracing): the command's own options are checked
    first, so the one-line error comes at once and nothing is traced."""
    model = ["--model", f"hf:{config_dir(tmp_path, 'llama')}", "--seq", "64"]
    r = CliRunner().invoke(app, [*args, *model, "--predict", "none", "--notebook", str(tmp_path / "nb.sqlite")]
                           if args[0] == "compare" else [*args, *model])
    assert r.exit_code == 2 and f"{field}:" in r.output, r.output
    assert asked == []


def test_the_advice_after_an_oom_covers_its_halved_sequence_below_the_sliding_window(tmp_path, monkeypatch):
    """Halving seq 48 of a window-32 model crosses into the other code path (an explicit mask below the window):
    its terms are another regime's, asked for before the advice is computed."""
    from batchlab.trace import profile as tracing

    regimes = []

    def with_profile(cfg, policies=None):
        regimes.append((cfg.seq >= cfg.model.sliding_window, cfg.seq))
        return cfg

    monkeypatch.setattr(tracing, "with_profile", with_profile)
    model = ["--model", f"hf:{config_dir(tmp_path, 'mistral', num_key_value_heads=2, sliding_window=32)}"]
    r = CliRunner().invoke(app, ["fit", "--global-batch", "8", "--after-oom", "--seq", "48", *model])
    assert r.exit_code in (0, 1), r.output
    assert {w for w, _ in regimes} == {True, False} and (False, 24) in regimes
