"""estimate --trace --compile against measure --compile (inductor, real tensors, the CPU allocator's events): the
built-in GPT tiny, one layer, fp32.  The trace runs AOTAutograd's min-cut partition without code generation on
fake tensors, pointwise chains inductor fuses left uncounted; the measurement runs inductor's C++ kernels.  Two inductor compiles (about a minute each on a
loaded 2-core host; the run shares one inductor cache, tests/conftest.py)."""
from __future__ import annotations

import pytest

from batchlab.config import RunConfig, preset
from batchlab.measure import MeasureOptions
from batchlab.run import measure as run
from batchlab.trace import estimate as trace

pytestmark = pytest.mark.slow
# backward holds the peak here (activations ~45% of it): seq 64 x micro-batch 4
CFG = dict(model=preset("tiny", layers=1), seq=64, micro_batch=4, compile="blocks")


def _both(ac: str):
    cfg = RunConfig(**CFG, ac=ac)
    measured = run(cfg, MeasureOptions(warmup=2, steps=2))
    assert measured.ok, measured.outcome_detail
    return trace(cfg), measured


def test_ac_none_traced_peak_and_activations_match_inductor():
    traced, m = _both("none")
    assert m.memory.provenance == "allocator" and m.environment["compile"]["backend"] == "inductor"
    assert traced.memory.peak_phase == m.memory.peak_phase == "backward"
    assert traced.memory.peak_bytes == pytest.approx(m.memory.peak_bytes, rel=0.03)
    # what the compiled forward saves for backward: the partition's saved tensors
    assert traced.memory.activations_bytes == pytest.approx(m.memory.activations_bytes, rel=0.01)
    assert any("min-cut partition" in n for n in traced.notes)
    # the compile line apart: the timed samples are --steps, compiling happened in the untimed updates only
    c = m.environment["compile"]
    assert len(m.time.samples) == 2 and c["compilations"] >= 1 and c["recompilations_timed"] == 0
    assert c["compile_seconds"] > max(m.time.samples)


def test_ac_full_saved_activations_exact_and_the_recomputed_block_an_upper_bound():
    """Full AC: the forward saves each block's input only, the same bytes in the trace's partition as in inductor's.
    The peak is in the backward of the recomputed block, whose nodes the trace counts unfused (inductor fuses part
    of them): above the measurement, by about a fifth here."""
    traced, m = _both("full")
    assert traced.memory.activations_bytes == pytest.approx(m.memory.activations_bytes, rel=0.001)
    assert traced.memory.peak_phase == m.memory.peak_phase == "backward"
    assert m.memory.peak_bytes <= traced.memory.peak_bytes <= 1.25 * m.memory.peak_bytes
    assert traced.memory.activations_bytes < 0.5 * trace(RunConfig(**CFG, ac="none")).memory.activations_bytes


def test_a_chain_inductor_fuses_is_one_kernel_that_moves_its_inputs_and_output_once():
    """By hand: out = 2 sum(relu(x @ w) * g) with x 16x8, w 8x32, g 16x32 fp32.  relu and the product fuse into the
    sum's loop (neither is written); the kernel reads the matmul's output and g (512 elements each) and writes one
    number: (512 + 512 + 1) x 4 bytes.  The matmul is an extern call with its own bytes."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from batchlab.config.phase import Launch
    from batchlab.trace.compiled import launches

    gm = make_fx(lambda x, w, g: (torch.mm(x, w).relu() * g).sum() * 2)(torch.randn(16, 8), torch.randn(8, 32),
                                                                           torch.randn(16, 32))
    by_name = {n.name: issued for n, issued in launches(gm).items()}
    assert by_name["relu"] == (Launch.FUSED, 0) and by_name["mul"] == (Launch.FUSED, 0)
    assert by_name["sum_1"] == (Launch.COMPILED, (512 + 512 + 1) * 4)
    assert by_name["mm"] == (Launch.COMPILED, None)
