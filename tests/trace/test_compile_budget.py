"""--ac budget:F (torch._functorch.config.activation_memory_budget) in the compiled trace and the formula: the
trace (inductor's own compile, no kernel built) saves what inductor's partition step (its joint-graph passes, the
min-cut partitioner) saves when torch.compile runs it under
``torch._functorch.config.patch(activation_memory_budget=F)`` directly (the built-in GPT's block, real tensors);
the formula's per-layer bytes against that partition.  No C++ built: partitions and a kernel-less lowering only
(seconds each)."""
from __future__ import annotations

import functools

import pytest
import torch

from batchlab.config import RunConfig, preset
from batchlab.formula import compiled
from batchlab.models import build_workload
from batchlab.trace import estimate as trace
from batchlab.trace.compiled import PARTITIONS

B, S, H = 2, 32, 128
CFG = dict(model=preset("tiny", layers=1, dropout=0.0), seq=S, micro_batch=B, compile="blocks")


def _saved(partitions) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each tensor the first forward graph saves for backward (its outputs past the user's)."""
    fw, n_outputs = partitions[0]
    out = next(x for x in fw.graph.nodes if x.op == "output")
    vals = [a.meta["val"] for a in out.args[0][n_outputs:] if isinstance(a, torch.fx.Node)]
    return sorted(((tuple(v.shape), v.dtype) for v in vals if isinstance(v, torch.Tensor)), key=str)


def _activation_bytes(saved) -> int:
    """Bytes of the saved tensors with a batch dimension first (B or B·S rows); parameters have none."""
    return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in saved if shape and shape[0] in (B, B * S))


def _traced(budget: float):
    found: list = []
    PARTITIONS.append(found)
    try:
        t = trace(RunConfig(**CFG, ac=f"budget:{budget}"))
    finally:
        PARTITIONS.remove(found)
    return t, _saved(found)


@functools.lru_cache(maxsize=None)  # one partition per budget for the file
def _torch_partition(budget: float):
    """torch.compile of one block with AOTAutograd and inductor's partition step (its joint-graph passes and the
    min-cut partitioner, as inductor's compile calls them), the knob set with torch._functorch.config.patch: what
    it saves."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.compile_fx import partition_fn as inductor_partition
    from torch._inductor.decomposition import select_decomp_table

    found: list = []

    def partition(joint, inputs, **kwargs):
        # inductor's own partition step: its joint-graph passes, then the min-cut partitioner (compiler="inductor")
        fw, bw = inductor_partition(joint, inputs, **kwargs)
        found.append((fw, kwargs["num_fwd_outputs"]))
        return fw, bw

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, _: make_boxed_func(g),
                                     bw_compiler=lambda g, _: make_boxed_func(g), partition_fn=partition,
                                     decompositions=select_decomp_table())

    torch._dynamo.reset()
    torch.manual_seed(0)
    block = build_workload(RunConfig(**CFG)).blocks[0]
    x = torch.randn(B, S, H, requires_grad=True)
    with torch._functorch.config.patch(activation_memory_budget=budget):
        torch.compile(block, backend=backend)(x).sum().backward()
    torch._dynamo.reset()
    return _saved(found)


@pytest.mark.slow  # two traces and two partitions (seconds each on a loaded host)
def test_the_trace_saves_what_torchs_partitioner_saves_under_the_knob_and_less_for_a_smaller_budget():
    low, high = _traced(0.3), _traced(0.6)
    for budget, (_, saved) in ((0.3, low), (0.6, high)):
        assert saved == _torch_partition(budget)
    assert _activation_bytes(low[1]) < _activation_bytes(high[1])
    assert low[0].memory.activations_bytes < high[0].memory.activations_bytes
    assert any("min-cut partition" in n for n in low[0].notes)


def test_the_formula_is_the_knobs_line_from_the_block_input_to_the_default_partition():
    """At 0 the partition saves the block's input alone (hand count: B·S·H fp32); between, the knapsack's set stays
    under the line the formula draws; at 1 the formula is AC none's compiled terms."""
    at = {b: compiled.kept_per_layer(RunConfig(**CFG, ac=f"budget:{b}"))[0][0] for b in (0, 0.3, 0.6, 1)}
    assert at[0] == B * S * H * 4 == _activation_bytes(_torch_partition(0.0))
    for b in (0.3, 0.6):
        assert _activation_bytes(_torch_partition(b)) <= at[b]
    assert at[1] == compiled.kept_per_layer(RunConfig(**CFG, ac="none"))[0][0]
    assert "knapsack" in compiled.source(RunConfig(**CFG, ac="budget:0.5"))


def test_the_whole_model_compiled_under_a_budget_has_no_block_terms():
    cfg = RunConfig(**CFG, ac="budget:0.5").replace(compile="model")
    assert not compiled.applies(cfg) and "budget:0.5" in compiled.missing_note(cfg)


@pytest.mark.parametrize("text", ["budget:1.5", "budget:-0.1", "budget:x", "budget"])
def test_a_budget_outside_0_to_1_is_refused(text):
    from batchlab.config import ConfigError

    with pytest.raises(ConfigError) as e:
        RunConfig(**CFG, ac=text)
    assert e.value.field == "ac" and "budget" in str(e.value)
