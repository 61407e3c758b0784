"""Factories whose code fake tensors once broke: modules deep-copied at build (nn.Transformer's layers) and
tensors cached at the first forward (Lightning's demo Transformer, an encoder-decoder), traced against a real
update of the same factory; what the traced code warns stays off the terminal."""
from __future__ import annotations

import json
import warnings

import pytest
import torch.nn as nn
import torch.nn.functional as F
from typer.testing import CliRunner

from batchlab.cli import app
from batchlab.config import RunConfig, preset
from batchlab.measure.harness import Trainer
from batchlab.measure.memory import track_update
from batchlab.models import synthetic_tokens
from batchlab.trace import estimate

VOCAB = 256


def lightning_demo(cfg):  # found as "test_lazy_factory:lightning_demo" (pytest puts this folder on sys.path)
    demos = pytest.importorskip("lightning.pytorch.demos")
    model = demos.Transformer(vocab_size=VOCAB, ninp=64, nhead=2, nhid=128, nlayers=2, dropout=0.1)

    def loss_sum(model, tokens, targets):  # as its LightningTransformer: the targets feed the decoder
        return F.nll_loss(model(tokens, targets), targets.reshape(-1), reduction="sum")

    return model, synthetic_tokens(VOCAB, cfg.data), loss_sum


class _Warns(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, tokens):
        x = F.softmax(self.embed(tokens))  # torch warns: implicit dimension choice
        warnings.warn("the model's own warning")
        return self.head(x)


def warning_factory(cfg):
    return _Warns(), synthetic_tokens(VOCAB, cfg.data)


def demo_cfg(**kw) -> RunConfig:
    return RunConfig(model=preset("tiny"), model_source="test_lazy_factory:lightning_demo", seq=64, micro_batch=4,
                     **kw)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_lightning_demo_transformer_traces_within_2pct_of_a_real_update(precision):
    cfg = demo_cfg(precision=precision)
    traced = estimate(cfg).memory
    real = track_update(Trainer(cfg, "cpu"))
    assert abs(traced.peak_bytes - real.peak_bytes) <= 0.02 * real.peak_bytes
    assert abs(traced.activations_bytes - real.activations_bytes) <= 0.02 * real.activations_bytes


def test_the_causal_mask_assumption_is_said_where_it_was_made():
    notes = estimate(demo_cfg()).notes
    assert any("causal" in n for n in notes)
    tiny = RunConfig(model=preset("tiny", layers=1), model_source="test_lazy_factory:warning_factory", seq=16)
    assert not any("causal" in n for n in estimate(tiny).notes)


def test_warnings_of_the_traced_code_stay_off_the_terminal_and_are_summarised():
    runner = CliRunner()
    args = ["estimate", "--trace", "--model", "test_lazy_factory:warning_factory", "--seq", "16"]
    r = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "Warning" not in r.stderr and "softmax" not in r.stderr
    assert "2 distinct warning(s) from the traced code kept off the terminal" in r.stdout and "--verbose lists them" in r.stdout
    verbose = runner.invoke(app, [*args, "--verbose"], env={"COLUMNS": "200"})
    assert "the model's own warning" in verbose.stdout and "Implicit dimension choice for softmax" in verbose.stdout
    out = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert len(out["warnings"]) == 2


class _Logs(_Warns):
    def forward(self, tokens):
        from transformers.utils import logging

        logging.get_logger("transformers.probe").warning("a notice transformers logs")
        return self.head(self.embed(tokens))


def logging_factory(cfg):
    return _Logs(), synthetic_tokens(VOCAB, cfg.data)


def test_transformers_log_lines_during_a_trace_are_kept_with_the_warnings(capfd):
    pytest.importorskip("transformers")
    cfg = RunConfig(model=preset("tiny", layers=1), model_source="test_lazy_factory:logging_factory", seq=16)
    traced = estimate(cfg)
    assert "a notice transformers logs" not in capfd.readouterr().err
    assert traced.warnings == ["transformers: a notice transformers logs"]
