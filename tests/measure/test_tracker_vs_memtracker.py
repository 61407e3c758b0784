"""batchlab's live-storage tracker (what `measure` and `estimate --trace` read) against PyTorch's MemTracker and the
CPU allocator's own events, on the same steady-state update (tests/memory_refs.py).  A few families here, one
of them outside every grid batchlab names; all of them, with checkpointing and autocast variants, in
benchmarks/tracker_vs_memtracker.py (docs/accuracy/tracker.md)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchlab.config import RunConfig
from batchlab.measure.harness import Trainer
from batchlab.measure.memory import tracker_for
from hf_shapes import config_dir, hf_cfg, rel
from memory_refs import read_trace, read_update

pytest.importorskip("transformers")
NOT_IN = dict(num_hidden_layers=None, hidden_size=None, num_attention_heads=None, intermediate_size=None,
              max_position_embeddings=None)
# CodeGen (rotary tables in a non-persistent buffer, fp32 rotary path) and GPT-BigCode (multi-query attention):
# families no grid of batchlab's names
CODEGEN = dict(NOT_IN, n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_positions=256)
BIGCODE = dict(NOT_IN, n_layer=2, n_embd=64, n_head=4, n_positions=256)


@pytest.fixture
def vision(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))  # tests/vision_models.py


def _check(r, regions: int = 0) -> None:
    """``regions``: checkpointed regions, each holding a copy of the CPU RNG state (5,056 B) that no op returns
    (torch.utils.checkpoint's preserve_rng_state): the allocator sees them, neither tracker does; nor a kernel's
    own scratch, freed before it returns, whose size the CPU's vector unit decides (``r.scratch``, read from the
    same profile): the allocator's peak may sit above the trackers' by one such transient at most."""
    # to the byte once AdamW's 0-dim step counters, which MemTracker counts and batchlab leaves out, are set aside
    assert r.batchlab == r.memtracker - r.steps, r
    assert rel(r.batchlab, r.memtracker) <= 0.005
    rng = regions * torch.get_rng_state().nbytes
    # the allocator's reading holds the 0-dim step counters too (``steps``): batchlab leaves them out
    assert 0 <= r.allocator - r.batchlab <= r.scratch + r.steps + rng, r


@pytest.mark.parametrize("model_type, fields, extra", [
    ("codegen", CODEGEN, {}),
    ("gpt_bigcode", BIGCODE, dict(ac="full")),
    # seq 64 >= the window: explicit mask, repeated k/v; selective checkpointing's cache under autocast
    ("mistral", dict(num_key_value_heads=2, sliding_window=32), dict(precision="bf16-mixed", ac="selective")),
])
def test_measured_peak_equals_memtracker_on_hf_families(tmp_path, model_type, fields, extra):
    torch.manual_seed(0)
    cfg = hf_cfg(config_dir(tmp_path, model_type, **fields), **extra)
    _check(read_update(Trainer(cfg, "cpu")), regions=0 if str(cfg.ac) == "none" else cfg.model.layers + 1)


def test_codegen_with_transformers_default_kv_cache_keeps_less_and_both_trackers_see_it(tmp_path):
    """The family's default config trains with use_cache=True (batchlab builds with False): the DynamicCache's
    copies of k and v let the fused qkv output go, so the update keeps less; the trackers still agree."""
    reads = []
    for use_cache in (False, True):
        torch.manual_seed(0)
        trainer = Trainer(hf_cfg(config_dir(tmp_path, "codegen", **CODEGEN)), "cpu")
        trainer.raw_model.config.use_cache = use_cache
        reads.append(read_update(trainer))
        _check(reads[-1])
    assert reads[1].batchlab < reads[0].batchlab


def test_measured_peak_equals_memtracker_on_a_vit_whose_peak_is_in_the_optimizer_step(vision):
    """The peak falls inside AdamW's step: a step counter that ``step += 1`` returned from an op was counted from
    then on (108 B here before), so the tracker's peak depended on where in the loop over parameters it fell."""
    torch.manual_seed(0)
    r = read_update(Trainer(RunConfig(model_source="vision_models:vit", seq=3072, micro_batch=2, ac="full"), "cpu"))
    assert r.phase == "optimizer"
    _check(r)  # the checkpointed regions and their saved RNG states are gone by the step


def test_trace_peak_equals_memtracker_on_fake_tensors(tmp_path):
    r = read_trace(hf_cfg(config_dir(tmp_path, "codegen", **CODEGEN)))
    assert r.batchlab == r.memtracker - r.steps, r


def test_an_update_leaves_the_tracker_where_it_started():
    """Steady state: what is live after an update (grads set to None) is what was live before: parameters and
    AdamW's moments; the step counters the update increments stay uncounted."""
    trainer = Trainer(RunConfig(seq=16, micro_batch=2))
    trainer.update()
    tracker = tracker_for(trainer)
    with tracker:
        trainer.update(listener=tracker)
    assert tracker.live_bytes == tracker.snapshot().baseline_bytes
    tracker.release()
