"""The PyTorch script `fit` prints for tensor and pipeline parallelism builds the mesh and schedule and runs as
printed: one torchrun launch (2 ranks, gloo, CPU) runs TP2 with sequence parallelism (under a per-layer
checkpointing plan) and PP2 interleaved (2 stages per rank, 4 layers), and their losses equal the single-process
script's of the same config without TP and PP (same seed, same stand-in: an independent reference, run first in
rank 0 as `python train.py`).  The wider grid (GPipe, 1F1B, TP2xDP2, PP2xDP2, FSDP2xTP2, TP2xPP2) is
benchmarks/script_layouts.py's, on docs/accuracy/script-layouts.md."""
from __future__ import annotations

import ast
import math

import pytest

from batchlab.advise import load_config_toml
from batchlab.advise.torch_script import training_script
from batchlab.config import ACPolicy, RunConfig, preset
from script_run import run_scripts, sharpened

PLAN = "plan:full,selective-op,megatron-selective,none"


def config(ac: str = "none", **kw) -> RunConfig:
    return RunConfig(model=preset("tiny", layers=4, attention="sdpa"), seq=16, micro_batch=2, accum=2,
                     ac=ACPolicy.parse(ac), **kw)


def reference(cfg: RunConfig) -> RunConfig:
    return cfg.replace(tp=1, sequence_parallel=False, pp=1, pp_schedule="1f1b", pp_virtual=1)


LAUNCHED = {"tp2_sp": config(tp=2, sequence_parallel=True, ac=PLAN),
            "pp2_interleaved": config(pp=2, pp_schedule="interleaved-1f1b", pp_virtual=2)}


@pytest.mark.slow
@pytest.mark.distributed
def test_tp_and_pp_scripts_run_under_torchrun_with_the_single_process_loss(tmp_path):
    """Both scripts and references sharpened alike (SGD at lr 0.5, 8 decimals): update 2's loss then checks the
    size of every gradient update 1 stepped with, not only its sign."""
    run = run_scripts(tmp_path, 2, {n: sharpened(training_script(c)) for n, c in LAUNCHED.items()},
                      references={f"{n}_ref": sharpened(training_script(reference(c))) for n, c in LAUNCHED.items()})
    assert run.ok, run.log[-4000:]
    for name in LAUNCHED:
        got, want = run.losses.get(name), run.losses.get(f"{name}_ref")
        assert got and want and len(got) == len(want) == 2, (name, run.losses, run.log[-2000:])
        assert all(math.isfinite(x) for x in got)
        # update 2's loss is computed with the weights update 1's step made: gradients and step compared too;
        # fp32, the same sums in another order (TP's partial matmuls all-reduced)
        assert got == pytest.approx(want, rel=1e-5), name
        assert abs(got[1] - got[0]) > 1e-3  # the step moved the loss


def test_the_script_names_the_mesh_the_plan_and_the_schedule():
    tp = training_script(config(tp=2, dp=2, zero=3))
    assert 'mesh = init_device_mesh(device.type, (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))' in tp
    assert "TP, PP, VIRTUAL = 2, 1, 1" in tp and "parallelize_module(block, mesh[\"tp\"], PLAN)" in tp
    assert 'fully_shard(block, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=True)' in tp
    assert "SequenceParallel" not in tp and "dist.all_reduce" not in tp
    # DeepSpeed's ZeRO-3 printed as its PyTorch counterpart, as without TP and PP
    assert 'fully_shard(block, mesh=mesh["dp"]' in training_script(config(tp=2, dp=2, sharding="deepspeed-zero3"))
    assert "if dist.get_world_size() != DP * TP * PP:" in tp
    assert "--nproc-per-node 4 train.py" in tp
    sp = training_script(config(tp=2, sequence_parallel=True))
    assert '"norm1": SequenceParallel()' in sp and "RowwiseParallel(output_layouts=Shard(1))" in sp
    for schedule, virtual, call in (("gpipe", 1, "ScheduleGPipe(pipe[0]"), ("1f1b", 1, "Schedule1F1B(pipe[0]"),
                                    ("interleaved-1f1b", 2, "ScheduleInterleaved1F1B(pipe")):
        text = training_script(config(pp=2, pp_schedule=schedule, pp_virtual=virtual, dp=2))
        assert f"{call}, n_microbatches=ACCUM" in text, schedule
        assert f"TP, PP, VIRTUAL = 1, 2, {virtual}" in text
        assert 'dist.all_reduce(g, group=mesh["dp"].get_group())' in text  # DP at ZeRO-0: one all-reduce
        assert "--nproc-per-node 4 train.py" in text


def test_tp_and_pp_leave_the_global_batch_line_alone():
    """global batch = micro-batch x accum x DP (tensor and pipeline ranks hold slices of one replica)."""
    text = training_script(config(tp=2, pp=2, dp=2))
    assert text.startswith("# global batch = micro-batch x accum x DP = 2 x 2 x 2 = 8 sequences")
    assert "world = DP x TP x PP = 2 x 2 x 2 = 8 ranks" in text.splitlines()[0]
    assert "--nproc-per-node 8 train.py" in text


def test_stand_in_heads_are_a_multiple_of_tp():
    """Each tensor-parallel rank computes whole heads: tp 3 gets 12 heads (width 192), tp 2 the default 4."""
    three = RunConfig(model=preset("tiny", layers=4, hidden=192, heads=6, attention="sdpa"), seq=16, micro_batch=2, accum=2, tp=3)
    assert "model = StandIn(layers=4, heads=12)" in training_script(three)
    assert "model = StandIn(layers=4, heads=4)" in training_script(config(tp=2))
    assert "model = StandIn(layers=4, heads=4)" in training_script(config())


def test_checkpointing_is_activation_checkpointing_not_the_training_checkpoint():
    text = training_script(config(pp=2, ac="full"))
    assert "Activation checkpointing (recompute in backward): not the training checkpoint saved to disk." in text
    # blocks wrapped before the pipeline cut: the stages take the wrapped blocks
    assert text.index("model.layers[i] = Checkpointed(") < text.index("stages = [Stage(model, i, STAGES)")


def test_fp16_loss_scaling_over_tp_or_pp_is_said_not_printed():
    text = training_script(config(tp=2, precision="fp16-mixed"))
    assert "no PyTorch script" in text and "--precision bf16-mixed" in text
    ast.parse(text)


def test_every_layout_prints_valid_python():
    for kw in (dict(tp=2), dict(tp=2, sequence_parallel=True), dict(pp=2), dict(pp=2, pp_schedule="gpipe"),
               dict(pp=2, pp_schedule="interleaved-1f1b", pp_virtual=2), dict(tp=2, pp=2, dp=2, zero=2)):
        for zero, precision, ac in ((0, "fp32", "every:2"), (1, "bf16-mixed", "selective-attn"),
                                    (3, "bf16-fsdp", PLAN), (3, "bf16", "selective-op")):
            ast.parse(training_script(config(ac=ac, precision=precision, **{**dict(dp=2, zero=zero), **kw})))


def test_fit_prints_the_tp_pp_script(tmp_path):
    """`fit --tp 2 --pp 2` searches micro-batches the 1F1B schedule takes (accum >= pp) and prints the script."""
    import json

    from typer.testing import CliRunner

    from batchlab.cli import app

    r = CliRunner().invoke(app, ["fit", "--model", "llama-2-7b", "--seq", "4096", "--global-batch", "64", "--dp", "2",
                                 "--tp", "2", "--pp", "2", "--device", "h100-sxm", "--precision", "bf16-mixed",
                                 "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    (tmp_path / "fit.toml").write_text(d["snippets"]["batchlab_toml"])
    final = load_config_toml(tmp_path / "fit.toml")
    script = d["snippets"]["pytorch"]
    assert final.accum >= 2 and (final.tp, final.pp, final.dp) == (2, 2, 2)
    assert "Schedule1F1B(pipe[0], n_microbatches=ACCUM" in script and "--nproc-per-node 8 train.py" in script
    assert f"MICRO_BATCH, ACCUM, DP, SEQ = {final.micro_batch}, {final.accum}, 2, 4096" in script
    assert script == training_script(final)
