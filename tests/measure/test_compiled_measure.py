"""measure --compile without inductor's code generation (backend "eager" or "aot_eager" through
``using_backend``): the compile line apart from the medians, recompilations counted and flagged, graph breaks,
a failed compile recorded by its cause, no C++ compiler a one-line config error.  Inductor itself, against the
trace, is tests/trace/test_compiled_trace.py."""
from __future__ import annotations

import pytest
import torch

from batchlab.config import ConfigError, RunConfig, preset
from batchlab.measure import MeasureOptions, Outcome
from batchlab.measure.harness import Trainer
from batchlab.models.compiled import CompileWatch, check_inductor, using_backend
from batchlab.run import measure as run

SMALL = dict(model=preset("tiny", layers=1), seq=16, micro_batch=1)


def test_a_recompilation_is_counted_by_the_watch():
    """A Python scalar that changes between calls is a guard failure: each new value compiles again."""
    torch._dynamo.reset()

    def f(x, scale):
        return x * scale

    compiled = torch.compile(f, backend="eager")
    with CompileWatch() as watch:
        x = torch.ones(3)
        compiled(x, 2)
        compiled(x, 2)  # the same guard: no compile
        assert watch.compiles == 1
        compiled(x, 3)  # a changed constant: recompiled
        compiled(x, 4)
    assert watch.compiles >= 2  # (dynamo may make the scalar dynamic after the first change: one more graph)
    assert watch.seconds > 0


def _compiled(cfg, opts):
    with using_backend("aot_eager"):
        return run(cfg, opts)


def test_the_compile_line_is_apart_and_the_medians_hold_only_timed_updates():
    m = _compiled(RunConfig(**SMALL, compile="blocks"), MeasureOptions(warmup=1, steps=3))
    assert m.ok, m.outcome_detail
    c = m.environment["compile"]
    # warm-up raised to 2 untimed updates (compile, then a possible recompile); the timed samples are --steps
    assert m.time.warmup == 2 and len(m.time.samples) == 3
    assert c["mode"] == "blocks" and c["backend"] == "aot_eager" and c["compilations"] >= 1
    assert c["compile_seconds"] > 0 and c["first_update_seconds"] >= 0
    assert c["first_update_wall_seconds"] >= c["compile_seconds"]
    # nothing compiled in the timed updates, so no sample holds compile time: each is below the compile itself
    assert c["recompilations_timed"] == 0 and max(m.time.samples) < c["compile_seconds"]
    assert c["graph_breaks"] == 0
    assert not any("recompiled" in w for w in m.warnings)
    from batchlab.measure.result import compile_text

    assert "excluded from the medians" in compile_text(m.environment)
    # the memory is the allocator's reading: the compiled code's buffers never pass the tracker
    assert m.memory.provenance == "allocator" and "profile_memory" in m.memory.method


def test_a_recompilation_in_the_timed_updates_is_flagged(monkeypatch):
    """The dropout probability is a constant in the compiled graph: changing it in the 5th update (the 2nd timed
    one, after 2 warm-up and the memory update) makes dynamo compile the blocks again."""
    plain, calls = Trainer.update, []

    def update(self, *a, **k):
        calls.append(1)
        if len(calls) == 5:
            for mod in self.raw_model.modules():
                if isinstance(mod, torch.nn.Dropout):
                    mod.p = 0.25
        return plain(self, *a, **k)

    monkeypatch.setattr(Trainer, "update", update)
    m = _compiled(RunConfig(**SMALL, compile="model"), MeasureOptions(warmup=2, steps=3))
    assert m.ok, m.outcome_detail
    assert m.environment["compile"]["recompilations_timed"] >= 1
    assert any("recompiled" in w and "timed updates" in w for w in m.warnings)


def test_a_failing_compile_is_a_failed_measurement_named_by_its_cause():
    def broken(gm, example_inputs):
        raise RuntimeError("this backend cannot lower the graph")

    with using_backend(broken):
        m = run(RunConfig(**SMALL, compile="blocks"), MeasureOptions(warmup=1, steps=2))
    assert m.outcome is Outcome.FAILED
    assert "torch.compile failed" in m.outcome_detail and "cannot lower the graph" in m.outcome_detail
    assert "RuntimeError" in m.outcome_detail


def test_no_cpp_compiler_is_one_config_error():
    # inductor's own patch (pytest's monkeypatch deletes the config key on undo: later compiles then fail)
    with torch._inductor.config.patch({"cpp.cxx": ("batchlab-no-such-c++",)}):
        with pytest.raises(ConfigError) as e:
            check_inductor(torch.device("cpu"))
        assert e.value.field == "compile" and "C++ compiler" in str(e.value)
        with pytest.raises(ConfigError):  # before any update runs
            run(RunConfig(**SMALL, compile="blocks"), MeasureOptions(warmup=1, steps=1))
    assert torch._inductor.config.cpp.cxx != ("batchlab-no-such-c++",)


def test_what_a_compiled_cpu_run_cannot_give_is_refused():
    with pytest.raises(ConfigError, match="memory_budget"):
        _compiled(RunConfig(**SMALL, compile="blocks", memory_budget=2**30), MeasureOptions(warmup=1, steps=1))
    with pytest.raises(ConfigError, match="compile"):
        _compiled(RunConfig(**SMALL, compile="blocks", dp=2), MeasureOptions(warmup=1, steps=1))


def test_recompilations_after_the_first_two_updates_are_a_warning_not_a_crash():
    """The warm-up's own recompilations (the memory update, the rest of the warm-up) are said, from the count the
    record keeps; a stub watch stands in for dynamo's callbacks (no compiling here)."""
    from types import SimpleNamespace

    from batchlab.measure import session

    class Watch(SimpleNamespace):
        def graph_breaks(self):
            return {}

        def stop(self):
            pass

    watch = Watch(mode="blocks", backend="inductor", seconds=3.0, compiles=4)
    m = SimpleNamespace(environment={"compile": {"first_update_wall_seconds": 5.0}}, warnings=[])
    session._compiled_warmup(m, watch, settled=2, first_own=2.0)
    watch.compiles = 4  # nothing more while timing
    session._compiled_timed(m, watch)
    assert m.environment["compile"]["recompilations_timed"] == 0
    assert m.warnings == ["torch.compile recompiled 2 time(s) after the first two updates (in the memory update "
                          "or the rest of the warm-up)"]
