"""DeepSpeed ZeRO-3's gathered parameters, replayed over the module trace (formula/deepspeed_gather.py), against
hand traces of the coordinator's rules (deepspeed/runtime/zero/partitioned_param_coordinator.py: fetch_sub_module's
prefetch, __params_to_release), and the ``--deepspeed`` settings as Hugging Face's integration fills ``auto``."""
from __future__ import annotations

import pytest

from batchlab.config import ConfigError, ModelSpec, RunConfig
from batchlab.config.deepspeed import DeepSpeedSettings
from batchlab.formula.deepspeed_gather import gathered

# one GELU layer, untied, no biases: embedding 16 x 4 = 64, q k v o 16 each, fc1 fc2 32 each, LM head 64 elements;
# three RMSNorm weights of 4 (never partitioned: 12 elements gathered all along, counted in every figure)
M = ModelSpec(name="t", layers=1, hidden=4, heads=1, ffn=8, vocab=16, max_positions=8, mlp="gelu", position="rope",
              norm="rmsnorm", bias=False, tied_embeddings=False)


def _ds(**kw) -> DeepSpeedSettings:
    return DeepSpeedSettings(**{"stage3_param_persistence_threshold": 0, **kw})


def test_without_prefetch_the_reuse_distance_alone_keeps_the_lm_head_across_the_loss():
    # distance 0: every module is freed at its end; at the loss nothing is gathered, backward one module at a time
    g = gathered(M, 1, False, _ds(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0))
    assert (g.at_loss, g.backward) == (12, 12 + 64)
    # distance 100: the head's backward is the next use (0 elements away): kept; fc2's is 64 + 64 = 128 away: freed
    g = gathered(M, 1, False, _ds(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=100))
    assert (g.at_loss, g.backward) == (12 + 64, 12 + 64)


def test_prefetch_runs_ahead_to_the_live_limit_and_keeps_what_its_scan_passed():
    # bucket 40, no live limit to speak of: embed prefetches q k v (48 >= 40), q prefetches o fc1, k fc2 head,
    # v's scan passes head fc2 fc1 o v (all gathered: marked, so kept until those uses) and fetches k q embed:
    # everything is gathered (256); the head's mark (its backward use) is the very next step, so it is freed after
    # its forward (192 at the loss) and fetched again for backward (256)
    g = gathered(M, 1, False, _ds(stage3_prefetch_bucket_size=40, stage3_max_live_parameters=1000,
                                  stage3_max_reuse_distance=0))
    assert (g.at_loss, g.backward) == (12 + 192, 12 + 256)
    # live limit 100: the scans stop at min(100 - gathered, 40); at the loss fc1 and fc2 (64, prefetched by the
    # head for backward); in backward fc2's step prefetches o v k (48) and fc1's q and the embedding (80): 160
    g = gathered(M, 1, False, _ds(stage3_prefetch_bucket_size=40, stage3_max_live_parameters=100,
                                  stage3_max_reuse_distance=0))
    assert (g.at_loss, g.backward) == (12 + 64, 12 + 160)


def test_persistent_parameters_are_gathered_all_along():
    # threshold 20: q k v o (16 each) are never partitioned (ds_persist)
    g = gathered(M, 1, False, _ds(stage3_param_persistence_threshold=20, stage3_prefetch_bucket_size=0,
                                  stage3_max_reuse_distance=0))
    assert g.persistent == 12 + 64 and (g.at_loss, g.backward) == (12 + 64, 12 + 128)


def test_auto_is_filled_as_the_hf_trainer_fills_it():
    # transformers/integrations/deepspeed.py trainer_config_finalize: h^2, 0.9 h^2, 10 h for hidden 4096
    ds = DeepSpeedSettings.parse("hf-auto,stage3_max_live_parameters=2e8").resolved(4096)
    assert ds.reduce_bucket_size == 16_777_216 and ds.stage3_prefetch_bucket_size == 15_099_494
    assert ds.stage3_param_persistence_threshold == 40_960 and ds.stage3_max_live_parameters == 200_000_000
    assert ds.sub_group_size == 1_000_000_000  # untouched: DeepSpeed's default


@pytest.mark.parametrize("text", ["sub_group_size=auto", "reduce_bucket_size=-3", "bucket=5", "hf_auto"])
def test_bad_settings_name_the_field(text):
    with pytest.raises(ConfigError, match="deepspeed"):
        DeepSpeedSettings.parse(text)


def test_settings_need_a_deepspeed_engine():
    with pytest.raises(ConfigError, match="deepspeed"):
        RunConfig(model=M, seq=8, dp=2, zero=3, deepspeed="hf-auto")
    assert str(RunConfig(model=M, seq=8, dp=2, sharding="deepspeed-zero3", deepspeed="hf-auto").deepspeed) == (
        "reduce_bucket_size=auto,stage3_prefetch_bucket_size=auto,stage3_param_persistence_threshold=auto")


def test_overlap_comm_double_buffers_the_reduce_bucket_at_stages_1_and_2_only():
    # ms-swift's zero2.json: reduce_bucket_size 2e8 with overlap_comm (stage_1_and_2.py backward: buf_0, and buf_1
    # under overlap_comm): 2 x 2e8 x 2 bytes; stage 3 allocates its one ipg buffer whatever overlap_comm says
    from batchlab.formula.deepspeed import resident_buffers
    from batchlab.formula.ranks import share

    for sharding, copies in (("deepspeed-zero2", 2), ("deepspeed-zero3", 1)):
        cfg = RunConfig(model=M, seq=8, dp=2, sharding=sharding, precision="bf16-mixed",
                        deepspeed="reduce_bucket_size=2e8,overlap_comm=true")
        assert resident_buffers(cfg, share(cfg, 0)) == {"deepspeed reduce bucket": copies * 2 * 10**8 * 2}


def test_the_printed_ds_config_carries_the_typed_sizes():
    from batchlab.advise.snippets import deepspeed as ds_config

    cfg = RunConfig(model=M, seq=8, dp=2, sharding="deepspeed-zero2", deepspeed="hf-auto,overlap_comm=true")
    assert ds_config(cfg)["zero_optimization"] == {
        "stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "overlap_comm": True}


def test_only_the_layers_a_plan_recomputes_fetch_their_weights_again_before_their_backward():
    # every:2 over two layers recomputes layer 0 alone (ACPolicy every:K: layers 0, K, 2K, ...)
    from dataclasses import replace

    from batchlab.formula.deepspeed_gather import trace

    two = replace(M, layers=2)
    order = trace(two, 2, (True, False))
    backward = order[order.index("head", 1):]
    assert sum(n.startswith("0.") for n in backward) == 2 * sum(n.startswith("1.") for n in backward)
    assert trace(two, 2, True).count("1.q") == 3 and trace(two, 2, (True, False)).count("1.q") == 2
    cfg = RunConfig(model=two, seq=8, dp=2, sharding="deepspeed-zero3", ac="every:2")
    assert [m.spec.recomputes for m in cfg.ac.layer_modes(2)] == [True, False]
