"""--optimizer-in-backward against real updates: torchtune's per-parameter step in the post-accumulate-grad hook
(measure/inbackward.py) trains the same weights as one plain AdamW step, frees every gradient, and its measured
peak is what the trace and the formula say; the techniques that cannot run are refused in one line."""
from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from batchlab.cli import app
from batchlab.config import RunConfig, preset
from batchlab.formula import estimate

SHAPE = ["--seq", "16", "--micro-batch", "2"]


def test_the_fused_step_trains_the_weights_plain_adamw_trains_and_frees_every_gradient():
    from batchlab.measure.harness import Trainer

    cfg = RunConfig(model=preset("tiny", dropout=0.0), seq=16, micro_batch=2)  # no RNG drawn between the two
    plain = Trainer(cfg, "cpu", clip_norm=None)  # torchtune refuses clipping with optimizer_in_bwd
    fused = Trainer(cfg.replace(optimizer_in_backward=True), "cpu")
    for _ in range(2):  # the second update steps existing state
        plain.update()
        fused.update()
    assert all(p.grad is None for p in fused.raw_model.parameters())
    for (name, a), b in zip(plain.raw_model.named_parameters(), fused.raw_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_measured_peak_is_the_traces_and_near_the_formulas():
    """A live CPU update (the live-storage tracker, in this process): the peak moves from the optimizer step into
    backward and drops; the trace (the same hooks on fake tensors) gives it to the byte, the formula within 2%."""
    from batchlab import trace
    from batchlab.measure.harness import Trainer
    from batchlab.measure.memory import track_update

    cfg = RunConfig(model=preset("tiny"), seq=16, micro_batch=2)
    fused_cfg = cfg.replace(optimizer_in_backward=True)
    on = track_update(Trainer(fused_cfg, "cpu"))
    plain, fused = estimate(cfg).memory, estimate(fused_cfg).memory
    assert plain.peak_phase == "optimizer" and on.peak_phase == fused.peak_phase == "backward"
    assert trace.estimate(fused_cfg).memory.peak_bytes == on.peak_bytes
    assert fused.peak_tensor_bytes == pytest.approx(on.peak_bytes, rel=0.02)
    assert on.peak_bytes < plain.peak_tensor_bytes  # no gradient set at the step


@pytest.mark.parametrize("args, field", [
    (["--accum", "2", "--optimizer-in-backward"], "optimizer_in_backward"),
    (["--dp", "2", "--optimizer-in-backward"], "optimizer_in_backward"),
    (["--offload-activations"], "offload_activations"),  # device cpu: nothing to offload to
    (["--offload-activations", "--device", "a100-80gb", "--trace"], "offload_activations"),  # formula only
])
def test_refusals_are_one_line_exit_2(args, field):
    r = CliRunner().invoke(app, ["estimate", *SHAPE, *args])
    assert r.exit_code == 2, r.output
    assert field in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_measure_refuses_offloading_on_a_gpu_device_too():
    """No saved-tensor hooks move activations in the harness: a measurement would silently keep them."""
    r = CliRunner().invoke(app, ["measure", *SHAPE, "--device", "a100-80gb", "--offload-activations"])
    assert r.exit_code == 2, r.output
    assert "offload_activations" in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_a_global_batch_without_a_micro_batch_is_one_micro_batch_per_rank_when_the_step_runs_in_backward():
    # accum 1 is the only accumulation the fused step allows: 16 sequences are one micro-batch of 16
    r = CliRunner().invoke(app, ["estimate", "--global-batch", "16", "--optimizer-in-backward", "--json"])
    assert r.exit_code == 0, r.output
    import json

    c = json.loads(r.stdout)["config"]
    assert (c["micro_batch"], c["accum"]) == (16, 1)
    r = CliRunner().invoke(app, ["estimate", "--global-batch", "16", "--micro-batch", "8", "--optimizer-in-backward"])
    assert r.exit_code == 2 and "optimizer_in_backward" in r.output  # a micro-batch typed that needs accumulation is still refused
