"""Model sources for measuring (Hugging Face configs, user factories) and subprocess isolation."""
from __future__ import annotations

import json
import sys
import uuid

import pytest
import torch

from batchlab.cli.common import _config_from_flags
from batchlab.config import ConfigError, RunConfig, preset
from batchlab.measure import MeasureOptions, Outcome
from batchlab.run import measure as run
from batchlab.measure.harness import Trainer

FAST = MeasureOptions(warmup=1, steps=1)

FACTORY_SOURCE = '''
import os, signal
import torch, torch.nn as nn
from batchlab.models import synthetic_tokens

class Small(nn.Module):
    def __init__(self, action=None):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 64)
        self.action = action

    def forward(self, tokens):
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
        if self.action == "huge":
            torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the CPU allocator refuses
        h = self.emb(tokens)
        for b in self.blocks:
            h = torch.relu(b(h))
        return self.head(h)

def ok(cfg):
    return Small(), synthetic_tokens(64, cfg.data)

def kill(cfg):
    return Small("kill"), synthetic_tokens(64, cfg.data)

def huge(cfg):
    return Small("huge"), synthetic_tokens(64, cfg.data)

def not_a_model(cfg):
    return "a string", synthetic_tokens(64, cfg.data)

def float_targets(cfg):
    return Small(), lambda gen, b, s, device: (torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s))

def just_a_model(cfg):
    return Small()

NOT_CALLABLE = 3


class Jittery(Small):
    """Every other forward sleeps 50 ms: update times alternate, IQR/median is far above 10%."""

    def forward(self, tokens):
        import time
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls % 2:
            time.sleep(0.05)
        return super().forward(tokens)

def jittery(cfg):
    return Jittery(), synthetic_tokens(64, cfg.data)
'''


@pytest.fixture(scope="module")
def factory_module(tmp_path_factory):
    """The factories' module, on sys.path for the whole file: the isolated runs below then all have one
    environment and share one pre-imported process, as one batchlab process's runs do (~3.5 s each otherwise)."""
    tmp = tmp_path_factory.mktemp("factories")
    name = f"bl_factory_{uuid.uuid4().hex[:8]}"
    (tmp / f"{name}.py").write_text(FACTORY_SOURCE)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(tmp))
        yield name


def factory_cfg(module: str, fn: str, **kw) -> RunConfig:
    return RunConfig(model_source=f"{module}:{fn}", seq=16, micro_batch=2, **kw)


# ------------------------------------------------------------------------------------------ factories

def test_factory_ok_with_activation_checkpointing(factory_module):
    m = run(factory_cfg(factory_module, "ok", ac="full"), FAST)
    assert m.outcome is Outcome.OK
    assert m.environment["ac_wrapped_layers"] == [0, 1]  # model.blocks picked up
    assert m.memory.peak_bytes > 0 and len(m.time.samples) == 1


@pytest.mark.parametrize("fn, words", [
    ("not_a_model", "not a torch.nn.Module"),
    ("float_targets", "integer targets"),
    ("just_a_model", "expected (model, make_batch)"),
    ("NOT_CALLABLE", "not a callable"),
    ("missing", "has no attribute 'missing'"),
])
def test_factory_errors_are_config_errors_on_model(factory_module, fn, words):
    with pytest.raises(ConfigError) as e:
        run(factory_cfg(factory_module, fn), FAST)
    assert e.value.field == "model" and words in str(e.value)


def test_noisy_timing_is_flagged(factory_module):
    m = run(factory_cfg(factory_module, "jittery"), MeasureOptions(warmup=1, steps=4, memory=False))
    assert m.time.spread > 0.10
    assert any("noisy" in w for w in m.warnings)


def test_factory_module_that_does_not_import():
    with pytest.raises(ConfigError) as e:
        run(factory_cfg("no_such_module_xyz", "factory"), FAST)
    assert e.value.field == "model" and "cannot import" in str(e.value)


def test_real_cpu_oom_in_forward_is_recorded(factory_module):
    m = run(factory_cfg(factory_module, "huge"), FAST)
    assert m.outcome is Outcome.OOM
    assert m.oom_phase == "forward"
    assert "host allocator" in m.outcome_detail and "warmup 1/1" in m.outcome_detail


# ------------------------------------------------------------------------------------------ isolation

def test_isolated_sigkill_becomes_a_failed_outcome(factory_module):
    m = run(factory_cfg(factory_module, "kill"), MeasureOptions(warmup=1, steps=1, isolate=True))
    assert m.outcome is Outcome.FAILED
    assert "SIGKILL" in m.outcome_detail and "OOM killer" in m.outcome_detail
    assert "warmup 1/1" in m.outcome_detail  # where it died, from the worker's progress lines
    assert m.environment["exit_status"] < 0
    assert m.config["model_source"].endswith(":kill")  # the caller is alive and has the record


def test_isolated_timeout_becomes_a_failed_outcome(factory_module):
    # 100,000 updates: far past 0.3 s even for a worker forked from the pre-imported process (no imports to wait on)
    m = run(RunConfig(seq=16, micro_batch=2), MeasureOptions(isolate=True, timeout_s=0.3, steps=100_000))
    assert m.outcome is Outcome.FAILED and "timed out after 0.3 s" in m.outcome_detail


@pytest.mark.slow
def test_isolated_run_matches_in_process_memory_and_reraises_config_errors(factory_module):
    cfg = RunConfig(model=preset("tiny", layers=2), seq=16, micro_batch=2)
    labels = []
    isolated = run(cfg, MeasureOptions(warmup=1, steps=2, isolate=True, timeline=True),
                   progress=lambda d, t, lab: labels.append(lab))
    here = run(cfg, MeasureOptions(warmup=1, steps=2))
    assert isolated.outcome is Outcome.OK and isolated.environment["isolated"] is True
    assert isolated.memory.peak_bytes == here.memory.peak_bytes  # same code, same seed: same tensors
    assert len(isolated.time.samples) == 2
    # progress from the worker; the memory update records the timeline too (no update of its own)
    assert "memory" in labels and "timeline" not in labels and "timed 2/2" in labels
    # the timeline was recorded in the worker and came back in its JSON: the same steady-state peak
    assert isolated.timeline.provenance == "allocator" and here.timeline is None
    assert max(isolated.timeline.totals) == isolated.timeline.peak_bytes == here.memory.peak_bytes
    with pytest.raises(ConfigError) as e:
        run(cfg.replace(memory_budget=1024), MeasureOptions(isolate=True))
    assert e.value.field == "memory_budget"


# ------------------------------------------------------------------------------------------ Hugging Face

def _hf_cfg(model_arg: str, **kw) -> RunConfig:
    # the flags' config without the calculator's layer profile: these tests measure, they predict nothing
    return _config_from_flags(model=model_arg, seq=16, micro_batch=2, **kw)


def test_hf_gpt2_tiny_measures_ok():
    pytest.importorskip("transformers")
    cfg = _hf_cfg("hf:gpt2", layers=2, hidden=64, heads=4, vocab=512)
    m = run(cfg, FAST)
    assert m.outcome is Outcome.OK, m.outcome_detail
    assert "GPT2LMHeadModel" in m.environment["model"]
    # GPT-2's parameter count by hand for the shape asked for (biases everywhere, 4h MLP, tied head)
    h, v, p, L = 64, 512, cfg.model.max_positions, 2
    layer = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)
    assert m.environment["parameters"] == v * h + p * h + L * layer + 2 * h


def test_hf_llama_tiny_measures_ok_and_checkpointing_is_bitwise_equal():
    pytest.importorskip("transformers")
    cfg = _hf_cfg("hf:llama-2-7b", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=512,
                  dropout=0.1, attention="eager")
    m = run(cfg, FAST)
    assert m.outcome is Outcome.OK, m.outcome_detail
    assert "LlamaForCausalLM" in m.environment["model"]

    def grads(c):
        tr = Trainer(c)
        tr.model.train()
        tokens, targets = tr.batches()[0]
        loss = tr.workload.loss_sum(tr.model, tokens, targets)
        loss.backward()
        return tr.wrapped_layers, {n.replace(".block.", "."): p.grad for n, p in tr.raw_model.named_parameters()}

    _, plain = grads(cfg)
    wrapped, full = grads(cfg.replace(ac="full"))
    assert wrapped == [0, 1]  # the model's decoder-layer ModuleList is what gets checkpointed
    assert plain.keys() == full.keys()
    assert all(torch.equal(plain[k], full[k]) for k in plain)


def test_hf_config_json_from_disk(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                                "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96,
                                "vocab_size": 256, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}))
    cfg = _hf_cfg(f"hf:{path}")
    tr = Trainer(cfg)
    hf = tr.raw_model.config
    assert (hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size, hf.vocab_size) == (2, 64, 96, 256)
    assert hf.rms_norm_eps == 1e-6  # fields the ModelSpec does not carry come from the file
    assert run(cfg, FAST).outcome is Outcome.OK


def test_hf_without_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ConfigError) as e:
        run(_hf_cfg("hf:gpt2", layers=1, hidden=32, heads=2, vocab=128), FAST)
    assert e.value.field == "model" and "pip install" in str(e.value)
