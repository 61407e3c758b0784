"""--offload-activations by hand: torchtune's OffloadActivations keeps on the device only the last 5 offloaded
tensors in forward (max_fwd_stash_size) and the tensors of the autograd node in use and the one before in
backward; under full checkpointing each layer saves one tensor, its input (s x b x h)."""
from __future__ import annotations

from batchlab.config import RunConfig, preset
from batchlab.formula import estimate


def test_full_checkpointing_keeps_five_layer_inputs_in_forward_and_two_in_backward():
    s, b, h, layers = 128, 8, 128, 12
    cfg = RunConfig(model=preset("tiny", layers=layers, dropout=0.0), seq=s, micro_batch=b, ac="full",
                    precision="bf16", device="a100-80gb")
    plain, off = estimate(cfg).memory, estimate(cfg.replace(offload_activations=True)).memory
    layer_input = 2 * s * b * h  # bf16
    assert plain.activations_per_layer_bytes == (layer_input,) * layers  # what full checkpointing keeps
    assert plain.phase_peaks["forward"] - off.phase_peaks["forward"] == (layers - 5) * layer_input
    # backward, as it starts and at the top layer: two layer inputs back instead of all of them
    for at in (0, 1):
        assert plain.backward_walk[at] - off.backward_walk[at] == (layers - 2) * layer_input
    # at the bottom layer only its own input was left anyway: the backward high point is unchanged
    assert off.phase_peaks["backward"] == plain.phase_peaks["backward"]


def test_a_model_shallower_than_the_stash_saves_nothing_in_forward():
    cfg = RunConfig(model=preset("tiny", layers=4, dropout=0.0), seq=64, micro_batch=4, ac="full",
                    precision="bf16", device="a100-80gb")
    plain, off = estimate(cfg).memory, estimate(cfg.replace(offload_activations=True)).memory
    assert off.phase_peaks["forward"] == plain.phase_peaks["forward"]


def test_the_estimate_shows_the_copy_time_and_the_link_it_assumed():
    """The copies' exposed time is on screen with its link: Hopper's PCIe Gen5 x16, 32 GT/s x 16 lanes x 128/130
    = 63.0 GB/s per direction (PCI-SIG), named as assumed; an FP8 run's sources line names the FP8 peak's source."""
    from typer.testing import CliRunner

    from batchlab.cli import app

    out = CliRunner().invoke(app, ["estimate", "--model", "gpt2", "--device", "h100-sxm", "--precision",
                                   "bf16-mixed", "--seq", "1024", "--micro-batch", "16", "--offload-activations",
                                   "--fp8", "tensorwise"], env={"COLUMNS": "250"}).output
    assert "activation offload copies, not hidden (PCIe Gen5 x16 assumed for the hopper architecture, 63.0 GB/s" in out
    assert "FP8 GEMMs 1.98 PFLOP/s klockwood-h100" in out
