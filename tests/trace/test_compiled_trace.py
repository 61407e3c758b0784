"""estimate --trace --compile against measure --compile (inductor, real tensors, the CPU allocator's events): the
built-in GPT tiny, one layer, fp32.  The trace compiles with inductor too but builds no kernel: its generated
wrapper runs on fake tensors under the live-storage tracker; the measurement runs inductor's C++ kernels.  Two
inductor compiles with C++ (about a minute each on a loaded 2-core host; the run shares one inductor cache,
tests/conftest.py), two traces (each traced once for the file)."""
from __future__ import annotations

import pytest
import torch

from batchlab.config import RunConfig, preset
from batchlab.config.phase import Launch
from batchlab.formula.opcost import OpClass
from batchlab.measure import MeasureOptions
from batchlab.run import measure as run
from batchlab.trace import estimate as trace
from batchlab.trace.inductor_plan import inductor, kernels_not_built
from batchlab.trace.ops import OpRecorder

pytestmark = pytest.mark.slow
# backward holds the peak here (activations ~45% of it): seq 64 x micro-batch 4
CFG = dict(model=preset("tiny", layers=1), seq=64, micro_batch=4, compile="blocks")


_TRACES: dict = {}


def _trace(ac: str):
    if ac not in _TRACES:
        _TRACES[ac] = trace(RunConfig(**CFG, ac=ac))
    return _TRACES[ac]


def _both(ac: str):
    measured = run(RunConfig(**CFG, ac=ac), MeasureOptions(warmup=2, steps=2))
    assert measured.ok, measured.outcome_detail
    return _trace(ac), measured


def test_ac_none_traced_peak_and_activations_match_inductor():
    traced, m = _both("none")
    assert m.memory.provenance == "allocator" and m.environment["compile"]["backend"] == "inductor"
    assert traced.memory.peak_phase == m.memory.peak_phase == "backward"
    assert traced.memory.peak_bytes == pytest.approx(m.memory.peak_bytes, rel=0.03)
    # what the compiled forward saves for backward: the partition's saved tensors
    assert traced.memory.activations_bytes == pytest.approx(m.memory.activations_bytes, rel=0.01)
    assert any("min-cut partition" in n and "inductor's own compile" in n for n in traced.notes)
    # the compile line apart: the timed samples are --steps, compiling happened in the untimed updates only
    c = m.environment["compile"]
    assert len(m.time.samples) == 2 and c["compilations"] >= 1 and c["recompilations_timed"] == 0
    assert c["compile_seconds"] > max(m.time.samples)


def test_ac_full_traced_peak_is_inductors_own_plan():
    """Full AC: the forward saves each block's input only, the same bytes in the trace as in inductor's run.  The
    peak is in the backward of the recomputed block, which inductor fuses and plans (buffers reused in place,
    freed early); the trace runs that plan, so it lands on the measured peak (counting the recomputed nodes
    unfused, as the partition-only fallback does, put it about a fifth above)."""
    traced, m = _both("full")
    assert traced.memory.activations_bytes == pytest.approx(m.memory.activations_bytes, rel=0.001)
    assert traced.memory.peak_phase == m.memory.peak_phase == "backward"
    assert traced.memory.peak_bytes == pytest.approx(m.memory.peak_bytes, rel=0.03)
    assert traced.memory.activations_bytes < 0.5 * _trace("none").memory.activations_bytes


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

# the time side of inductor's plan: each kernel its generated wrapper calls is one compiled launch moving its
# buffers once (trace/inductor_plan.py); in this file, whose traces have already loaded inductor
def test_a_fused_pointwise_chain_is_one_kernel_reading_its_input_and_writing_its_output_once():
    def chain(x):
        return torch.relu(x * 2 + 1) - 3  # four pointwise ops: inductor fuses them into one kernel

    x = torch.randn(1000)
    rec = OpRecorder()
    with kernels_not_built(), torch.no_grad():
        compiled = inductor(torch.fx.symbolic_trace(chain), [x])  # the wrapper loads with its kernels stubbed
        with rec:
            compiled(x)
    kernels = [op for op in rec.result() if op.name == "inductor_kernel"]
    assert len(kernels) == 1 and kernels[0].count == 1 and kernels[0].launch is Launch.COMPILED
    assert kernels[0].bytes == 2 * 1000 * 4  # 1,000 fp32 read, 1,000 written; no intermediate buffer
    assert not [op for op in rec.result() if op.name in ("mul", "add", "relu", "sub")]  # none ran eagerly
    # one run of one graph: its own call once, no data (calibrate/calls.py prices it)
    graph = [op for op in rec.result() if op.launch is Launch.GRAPH]
    assert [(op.name, op.count, op.bytes) for op in graph] == [("compiled_graph", 1, 0)]


def test_a_compiled_dropout_draws_one_number_per_element_inside_the_kernel_and_is_priced_per_element():
    """Inductor lowers dropout's mask to prims.inductor_random, drawn inside the fused kernel (its C++ calls
    normalized_rand_cpu once per element), and exp to at::vec's exp in the same kernel: the trace records each
    as per-element arithmetic of its 800 elements with no launch and no bytes of its own; the kernel still moves
    the input and output once (800 fp32 each) and its seed."""
    import torch.nn.functional as F

    def drop(x):
        return F.dropout(x, 0.1, training=True).exp()

    x = torch.randn(8, 100)
    rec = OpRecorder()
    with kernels_not_built(), torch.no_grad():
        compiled = inductor(torch.fx.symbolic_trace(drop), [x])
        with rec:
            compiled(x)
    # inside the kernel: per-element work (the wrapper's allocations are free helpers too, of the view class)
    inside = {op.name: op for op in rec.result() if op.launch is Launch.FUSED and op.cost_class is not OpClass.VIEW}
    assert set(inside) == {"inductor_random", "inductor_exp"}  # exp as at::vec computes it inside the loop
    assert all(op.elements == 800 and op.bytes == 0 and op.count == 1 for op in inside.values())
    kernels = [op for op in rec.result() if op.name == "inductor_kernel"]
    assert len(kernels) == 1 and kernels[0].bytes == 2 * 800 * 4 + 8  # one int64 seed
    assert not [op for op in rec.result() if op.name in ("bernoulli_", "native_dropout", "exp")
                and op.launch is Launch.EAGER]


def test_a_mask_the_graph_returns_is_stored_as_bool_inside_the_kernel_and_priced_per_element():
    """A forward keeping a dropout-like mask for backward returns it as a bool buffer that its fused kernel stores
    (formula/fusion.py MASK): the trace records that store per element, 800 of them; a graph returning only the
    masked values stores no mask."""
    def kept(x):
        mask = torch.rand_like(x) > 0.1
        return x * mask, mask

    def dropped(x):
        return x * (torch.rand_like(x) > 0.1)

    x = torch.randn(8, 100)
    stored = {}
    for fn in (kept, dropped):
        rec = OpRecorder()
        with kernels_not_built(), torch.no_grad():
            compiled = inductor(torch.fx.symbolic_trace(fn), [x])
            with rec:
                compiled(x)
        stored[fn.__name__] = [(op.elements, op.bytes, op.launch) for op in rec.result()
                               if op.name == "inductor_mask_store"]
    assert stored == {"kept": [(800, 0, Launch.FUSED)], "dropped": []}


def _fused(fn, *args) -> list:
    """(name, elements) of the per-element work the trace records inside the kernels inductor plans for ``fn``."""
    rec = OpRecorder()
    with kernels_not_built(), torch.no_grad():
        compiled = inductor(torch.fx.symbolic_trace(fn), list(args))
        with rec:
            compiled(*args)
    return sorted((op.name, op.elements) for op in rec.result()
                  if op.launch is Launch.FUSED and op.cost_class is not OpClass.VIEW)


def test_a_bool_mask_a_kernel_reads_is_widened_per_element_and_one_made_from_indices_is_not():
    """A causal softmax as a GPT block's attention does it, 8 rows of 100 x 100 scores.  With the mask a graph
    input (what a backward gets when the forward saved it, AC none), inductor's kernel reads it back as bool in
    both of the softmax's passes over each row (max, then exp), since it inlines the where into each: 2 x 80,000
    bools widened into vector masks (its generated C++: ``VecMask<float,1>::from(in_ptr0 + ...)`` in two loops).
    With the mask made in the graph from ones_like().triu() and not returned (the forward and recompute under full
    AC), the loops compute it from their indices and read no bool.  The exp of x - max(x) is the softmax's."""
    scores = torch.randn(8, 100, 100)

    def given(x, m):
        return torch.softmax(x.masked_fill(m, float("-inf")), -1)

    def made(x):
        m = torch.ones_like(x[0], dtype=torch.bool).triu(1)  # from x: traced, not a constant of the graph
        return torch.softmax(x.masked_fill(m, float("-inf")), -1)

    mask = torch.ones(100, 100, dtype=torch.bool).triu(1)
    assert _fused(given, scores, mask) == [("inductor_mask_load", 2 * 80_000), ("inductor_softmax", 80_000)]
    assert _fused(made, scores) == [("inductor_softmax", 80_000)]


def test_a_mask_as_large_as_its_loop_is_read_at_the_random_rate_and_a_broadcast_one_at_the_structured():
    """A dropout's kept mask (one draw per element, read back by the backward's multiply) is as large as the loop
    that reads it: its bool widening follows no runs (calibrate/compiled_rng.py times it on a drawn mask); a mask
    broadcast over the loop (a causal one, 100 x 100 over 8 rows of scores) is structure."""
    x, drawn = torch.randn(8, 100), torch.rand(8, 100) > 0.1

    def dropout_backward(g, m):
        return g * m * (1 / 0.9)

    assert _fused(dropout_backward, x, drawn) == [("inductor_mask_load_random", 800)]
    scores, causal = torch.randn(8, 100, 100), torch.ones(100, 100, dtype=torch.bool).triu(1)
    assert _fused(lambda s, m: s.masked_fill(m, 0.0) * 2.0, scores, causal) == [("inductor_mask_load", 80_000)]


def test_the_wrappers_allocations_and_views_are_recorded_without_a_dispatch():
    """Inductor's wrapper allocates its buffers and reinterprets them with C++ helpers (``empty_strided_cpu``,
    ``reinterpret_tensor``), no dispatcher call: the trace records them (fake mode and the tracker need them) as
    free; the ATen calls the wrapper does make (its extern matmuls) are no-grad calls, a compiled graph's."""
    rec = OpRecorder()
    with kernels_not_built(), torch.no_grad():
        compiled = inductor(torch.fx.symbolic_trace(lambda x, w: torch.relu(x @ w) * 2), [torch.randn(8, 4),
                                                                                            torch.randn(4, 6)])
        with rec:
            compiled(torch.randn(8, 4), torch.randn(4, 6))
    ops = rec.result()
    assert [op.launch for op in ops if op.name == "empty_strided"] == [Launch.FUSED]
    assert [op.launch for op in ops if op.name == "mm"] == [Launch.COMPILED]
