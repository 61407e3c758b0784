"""--tp-overlap async: what the GEMMs hide of a sequence-parallel layer's collectives, against a hand computation for
one layer shape (Wang et al. 2023's decomposition: a ring of t-1 transfers beside t GEMM chunks, one chunk with
nothing beside it, so a pair exposes max(0, T_comm - (t-1)/t x T_gemm)); the flag's validation."""
from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from batchlab.cli import app
from batchlab.config import RunConfig
from batchlab.formula.opcost import OpCosts
from batchlab.formula.overlap import pp_exposed_seconds, tp_hidden_seconds
from batchlab.formula.pipeline import Link

# one layer of the built-in GPT (h 128, ffn 512, fused qkv, biases), fp32, b·s = 4 x 64 = 256 tokens, tp 2
ONE = dict(seq=64, micro_batch=4, accum=1, tp=2, sequence_parallel=True, tp_overlap="async", device="h100-sxm")
FLAT = OpCosts(matmul={"fp32": ((1.0, 1e12), (1e15, 1e12))}, memory=((1.0, 1e30),), strided_bytes_per_s=1e30,
               element_seconds={}, dispatch={})  # every GEMM at 1 TFLOP/s, nothing else costs
LINK = Link(1e10, 0.0, "hand")  # 10 GB/s, no per-message cost


def _cfg(**kw) -> RunConfig:
    return RunConfig(**{**ONE, "model": dataclasses.replace(RunConfig().model, layers=1), **kw})


def test_one_layer_exposes_what_its_gemm_chunks_cannot_hide():
    # per rank (1/2 of each GEMM) at 1e12 FLOP/s, forward: qkv 2·256·128·384/2 = 12.582912 us, proj 4.194304 us,
    # fc1 and fc2 16.777216 us; backward twice each.  All-gather / reduce-scatter of 131,072 B over 2 ranks at
    # 10 GB/s: 1/2 x 13.1072 = 6.5536 us; the column inputs' gradient all-reduce 13.1072 us.  Exposed per pair,
    # max(0, comm - 1/2 x gemm):
    #   forward  qkv  AG 6.5536 - 6.291456 = 0.262144;  proj RS 6.5536 - 2.097152 = 4.456448;  fc1 AG, fc2 RS 0
    #   backward proj AG 6.5536 - 4.194304 = 2.359296;  fc2 AG 0;  under Megatron's layer (Transformer Engine
    #   overlaps its column-input gradient reduction) qkv AR 13.1072 - 12.582912 = 0.524288, fc1 AR 0; under DTensor
    #   both all-reduces stay whole (torch's async TP decomposes only all-gathers and reduce-scatters)
    comm = 4 * 6.5536 + 2 * 6.5536 + 2 * 13.1072
    exposed = 0.262144 + 4.456448 + 2.359296
    megatron = _cfg(model=dataclasses.replace(RunConfig().model, layers=1, impl="megatron"))
    assert tp_hidden_seconds(megatron, (0,), LINK, FLAT) == pytest.approx((comm - exposed - 0.524288) * 1e-6)
    assert tp_hidden_seconds(_cfg(), (0,), LINK, FLAT) == pytest.approx((comm - exposed - 2 * 13.1072) * 1e-6)
    # a fully recomputed layer runs its forward pairs again: 6.291456 + 2.097152 + 6.5536 + 6.5536 more hidden
    assert tp_hidden_seconds(_cfg(ac="full"), (0,), LINK, FLAT) == pytest.approx(
        (comm - exposed - 2 * 13.1072 + 21.495808) * 1e-6)


def test_nothing_is_hidden_without_the_overlap_or_off_cuda():
    assert tp_hidden_seconds(_cfg(tp_overlap="none"), (0,), LINK, FLAT) == 0.0
    assert tp_hidden_seconds(_cfg(device="cpu"), (0,), LINK, FLAT) == 0.0  # async TP needs CUDA


def test_pipeline_sends_hide_behind_a_chunk_forward_where_the_schedule_overlaps():
    inter = RunConfig(seq=64, micro_batch=4, accum=4, pp=2, pp_schedule="interleaved-1f1b", pp_virtual=2,
                      device="h100-sxm")
    # 3 sends of 20 us beside chunk forwards of 15 us: 5 us of each shows; the receives were posted early
    assert pp_exposed_seconds(inter, 3, 20e-6, 7e-6, 15e-6) == pytest.approx(15e-6)
    one = dataclasses.replace(inter, pp_schedule="1f1b", pp_virtual=1)  # torch's 1F1B waits before computing
    assert pp_exposed_seconds(one, 3, 20e-6, 7e-6, 15e-6) == pytest.approx(67e-6)
    cpu = dataclasses.replace(inter, device="cpu")  # gloo copies on the cores the ranks compute on
    assert pp_exposed_seconds(cpu, 3, 20e-6, 7e-6, 15e-6) == pytest.approx(67e-6)


@pytest.mark.parametrize("argv, words", [
    (["--tp", "2"], "needs --tp > 1 --sequence-parallel"),
    (["--tp", "2", "--sequence-parallel", "--tp-overlap", "userbuffers"], "not one of: none, async"),
])
def test_bad_tp_overlap_is_one_line_and_exit_2(argv, words):
    r = CliRunner().invoke(app, ["estimate", "--seq", "64", "--device", "h100-sxm", *argv,
                                 *([] if "--tp-overlap" in argv else ["--tp-overlap", "async"])])
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: tp_overlap:"), r.output
    assert words in lines[0]


def test_the_layout_says_it_and_json_carries_it():
    lay = _cfg().parallel
    assert "its collectives overlapped with the GEMMs" in lay.text()
    assert lay.to_dict()["tp_overlap"] == "async"


def test_fit_asks_the_overlap_of_every_layout_it_searches():
    from batchlab.advise.plan import Goal, layouts
    from batchlab.config import ConfigError

    base = RunConfig(seq=64, micro_batch=1, accum=8, device="h100-sxm")
    got = layouts(Goal(base, world=4, sequence_parallel=True, tp_overlap="async"))
    assert got and all(c.tp > 1 and c.parallel.tp_overlap.value == "async" for c in got)
    with pytest.raises(ConfigError, match="tp_overlap"):
        Goal(base, world=4, tp_overlap="async")  # no sequence parallelism to overlap


def test_a_config_file_takes_it_flat_or_in_its_parallel_table(tmp_path):
    from batchlab.config.load import load_config_toml

    flat = tmp_path / "flat.toml"
    flat.write_text('[config]\nseq = 64\ndevice = "h100-sxm"\ntp = 2\nsequence_parallel = true\ntp_overlap = "async"\n')
    table = tmp_path / "table.toml"
    table.write_text('[config]\nseq = 64\ndevice = "h100-sxm"\n[config.parallel]\ntp = 2\nsequence_parallel = true\n'
                     'tp_overlap = "async"\n')
    assert load_config_toml(flat).parallel.tp_overlap.value == "async"
    assert load_config_toml(table).parallel.to_dict()["tp_overlap"] == "async"
