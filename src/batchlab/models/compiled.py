"""torch.compile applied to what a config names (the whole model, or each block after AC wrapping, as torchtitan
does), and what compiling did: seconds, compilations, graph breaks.

The backend is inductor unless a caller says otherwise (``using_backend``): the trace runs the same wrapping
with a backend that only partitions (trace/compiled.py), since generated code cannot run on fake tensors.
"""
from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, field

import torch

from batchlab.config import CompileMode, ConfigError

# (backend, the list each CompileWatch started is appended to)
_BACKEND: contextvars.ContextVar = contextvars.ContextVar("batchlab_compile_backend", default=("inductor", None))
REASONS_KEPT = 3  # graph-break reasons reported (the count covers all)


@contextlib.contextmanager
def using_backend(backend):
    """Within: ``apply_compile`` compiles with ``backend`` (a name or a callable) instead of inductor; yields the
    list that receives the CompileWatch of each model compiled meanwhile."""
    watches: list[CompileWatch] = []
    token = _BACKEND.set((backend, watches))
    try:
        yield watches
    finally:
        _BACKEND.reset(token)
        for w in watches:
            w.stop()


def backend_name(backend) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)


def check_inductor(device: torch.device) -> None:
    """Inductor on CPU writes C++ and builds it: no compiler, one clear error before anything is built."""
    if device.type != "cpu":
        return
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - InvalidCxxCompiler, or a torch without the builder
        import torch._inductor.config as inductor_config

        tried = [c for c in inductor_config.cpp.cxx if c] if isinstance(inductor_config.cpp.cxx, (list, tuple)) \
            else [inductor_config.cpp.cxx]
        raise ConfigError("compile", f"inductor needs a C++ compiler on CPU and found none ({type(e).__name__}; "
                                     f"tried {', '.join(map(str, tried))}): install g++ or set CXX, or measure "
                                     "with --compile none") from None


def budgeted(backend, budget: float | None):
    """``backend`` compiling each frame under ``torch._functorch.config.activation_memory_budget = budget``
    (ACPolicy budget:F): AOTAutograd partitions the joint graph while the backend compiles the frame, so the knob
    set around that call is the one the partitioner reads, recompilations included."""
    if budget is None:
        return backend
    # "inductor": what torch.compile(backend="inductor") itself builds at the default mode
    inner = torch._TorchCompileInductorWrapper(None, None, None) if backend == "inductor" else backend

    def compile_with_budget(gm, example_inputs, **kwargs):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return inner(gm, example_inputs, **kwargs)

    compile_with_budget.__name__ = backend_name(backend)
    compile_with_budget.compiler_name = getattr(inner, "compiler_name", backend_name(backend))
    return compile_with_budget


def apply_compile(workload, mode: CompileMode, device: torch.device, world: int = 1,
                  budget: float | None = None) -> "CompileWatch | None":
    """Compile ``workload``'s model (``model``) or each of its blocks (``blocks``) in place, after AC wrapping (a
    block's Checkpointed wrapper is what gets compiled, so the checkpoint is traced with it), with the partitioner's
    memory budget where one is given (``budgeted``); returns the started CompileWatch (``.backend`` names the
    backend), None for ``none``.  Dynamo's caches are reset first (one compiled model per process: a test process
    builds many)."""
    if mode is CompileMode.NONE:
        return None
    if world > 1:
        raise ConfigError("compile", "a compiled run is measured and traced in one process for now (DP = 1); "
                                     "compiled DDP/FSDP runs are future work")
    if mode is CompileMode.BLOCKS and workload.blocks is None:
        raise ConfigError("compile", "blocks compiles each repeated block, and this model names none (a factory "
                                     "without .blocks): use --compile model")
    backend, watches = _BACKEND.get()
    if backend == "inductor":
        from torch._subclasses.fake_tensor import FakeTensor

        if any(isinstance(p, FakeTensor) for p in workload.model.parameters()):
            raise ConfigError("compile", "inductor generates code, which fake tensors cannot run: a trace compiles "
                                         "through batchlab.trace.estimate (inductor with no kernel built, "
                                         "trace/inductor_plan.py)")
        check_inductor(device)
    torch._dynamo.reset()  # (it also clears dynamo's compile callbacks: the watch starts after it)
    targets = list(workload.blocks) if mode is CompileMode.BLOCKS else [workload.model]
    compiler = budgeted(backend, budget)
    for module in targets:
        module.compile(backend=compiler)  # in place: names, parameters and the module tree unchanged
    watch = CompileWatch(backend=backend_name(backend), mode=mode.value).start()
    if watches is not None:
        watches.append(watch)
    return watch


def failure_text(exc: BaseException) -> str:
    """A compile failure by its cause (dynamo wraps the backend's own error: 'backend=... raised:')."""
    inner = getattr(exc, "inner_exception", None)
    if inner is not None and isinstance(exc, torch._dynamo.exc.BackendCompilerFailed):
        exc = inner
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


@dataclass
class CompileWatch:
    """Counts compilations (dynamo frames and lazily compiled backwards) and their wall-clock seconds through
    dynamo's compile callbacks, and graph breaks through its counters, from ``start()`` to ``stop()``."""

    backend: str = ""
    mode: str = ""
    compiles: int = 0
    seconds: float = 0.0
    _started: float | None = None
    _breaks0: dict = field(default_factory=dict)

    def _begin(self, args) -> None:
        self._started = time.perf_counter()

    def _end(self, args) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self.compiles += 1
            self._started = None

    def start(self) -> "CompileWatch":
        from torch._dynamo.callback import callback_handler

        self._breaks0 = dict(torch._dynamo.utils.counters["graph_break"])
        callback_handler.register_start_callback(self._begin)
        callback_handler.register_end_callback(self._end)
        return self

    def stop(self) -> None:
        from torch._dynamo.callback import callback_handler

        for remove, cb in ((callback_handler.remove_start_callback, self._begin),
                           (callback_handler.remove_end_callback, self._end)):
            with contextlib.suppress(ValueError):
                remove(cb)

    def __enter__(self) -> "CompileWatch":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def graph_breaks(self) -> dict[str, int]:
        """Graph breaks since ``start()``: reason -> count."""
        now = torch._dynamo.utils.counters["graph_break"]
        return {str(k): v - self._breaks0.get(k, 0) for k, v in now.items() if v > self._breaks0.get(k, 0)}


def break_summary(breaks: dict[str, int]) -> tuple[int, list[str]]:
    """(graph breaks in all, the first reasons, one line each)."""
    reasons = [(r.strip().splitlines() or [""])[0][:200] for r in list(breaks)[:REASONS_KEPT]]
    return sum(breaks.values()), reasons
