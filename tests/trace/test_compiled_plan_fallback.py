"""estimate --trace --compile where inductor cannot plan: the partition-only trace answers, and its note says why
(a lowering that fails; a CUDA config is tests/cli/test_compile_flag.py's); a model whose own code does not compile
is refused once, not compiled again by the fallback."""
from __future__ import annotations

import pytest

from batchlab.config import ConfigError, RunConfig, preset
from batchlab.trace import estimate as trace
from batchlab.trace import inductor_plan

BROKEN = '''
import torch
import torch.nn as nn


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, tokens):
        return self.out(self.emb(tokens) @ torch.ones(3, 3))  # 8 features against 3 rows


def broken():
    return Broken(), "tokens:16"
'''


def test_a_failing_lowering_falls_back_to_the_partition_and_says_why(monkeypatch):
    def failing(gm, example_inputs):
        raise NotImplementedError("no lowering for this op")

    monkeypatch.setattr(inductor_plan, "inductor", failing)
    cfg = RunConfig(model=preset("tiny", layers=1), seq=16, micro_batch=2, compile="blocks", ac="full")
    traced = trace(cfg)
    note = traced.notes[0]
    assert "min-cut partition" in note and "not inductor's own plan" in note and "no lowering for this op" in note
    # the partition's count of what the forward saves under full AC: the block's input, b x s x h fp32, and more
    assert traced.memory.activations_bytes >= 2 * 16 * 128 * 4


def test_a_model_whose_code_does_not_compile_is_traced_once_and_refused(tmp_path, monkeypatch):
    import batchlab.trace.run as traced_update

    (tmp_path / "broken_model.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    attempts = []
    real = traced_update.estimate
    monkeypatch.setattr(traced_update, "estimate", lambda *a, **k: attempts.append(a) or real(*a, **k))
    with pytest.raises(ConfigError) as e:
        trace(RunConfig(model_source="broken_model:broken", seq=8, micro_batch=2, compile="model"))
    assert e.value.field == "compile" and "did not compile for the trace" in str(e.value)
    assert len(attempts) == 1  # the partition-only backend would compile the same code to the same error


def test_the_partition_only_graphs_record_their_own_call_once_per_run_forward_and_backward():
    """The fallback's graphs run uncompiled (trace/compiled.py ``_graph_run``) but are still one compiled graph
    each: by hand, one forward run and one backward run of x -> sum(2x), one own call each, no data, no op."""
    import torch

    from batchlab.config.phase import GRAPH_CALL, Launch, Phase
    from batchlab.trace.compiled import partition_only
    from batchlab.trace.ops import OpRecorder

    x = torch.randn(8, requires_grad=True)
    double = partition_only(torch.fx.symbolic_trace(lambda x: ((x * 2).sum(),)), [x])  # as dynamo would hand it
    double(x)[0].backward()  # the backward compiled outside the record
    rec = OpRecorder()
    with rec:
        rec.mark("forward")
        (loss,) = double(x)
        rec.mark("backward")
        loss.backward()
    rec.close()
    graph = {op.phase: (op.name, op.count, op.bytes, op.flops) for op in rec.result() if op.launch is Launch.GRAPH}
    assert graph == {Phase.FORWARD: (GRAPH_CALL, 1, 0, 0), Phase.BACKWARD: (GRAPH_CALL, 1, 0, 0)}
