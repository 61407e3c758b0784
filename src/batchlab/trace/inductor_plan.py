"""Inductor's own memory plan, run without its kernels: the compiled trace (trace/compiled.py) compiles with
inductor itself (its post-grad passes, lowering, scheduler, fusion and the wrapper's buffer planning) and loads
the generated wrapper with every kernel a no-op, so no C++ is built; the wrapper then runs on fake tensors under
the live-storage tracker.

What the tracker counts is then what inductor's wrapper allocates: its ``empty_strided`` buffers, the outputs of
the ops it leaves to ATen (matmuls into planned buffers, fallbacks), a dead buffer reused in place
(``buf5 = buf3; del buf3  # reuse``: one storage), each ``del`` at the point inductor frees, the saved tensors
released as the backward goes (``args.clear()``).  Fused regions, recomputed ones included, write only what
inductor realises.  Lowering is for the device the fake tensors are on: CPU here.

For time, each kernel call is one launch moving its buffers once, and the per-element arithmetic its loops do
beyond moving them is read off the graph inductor lowered (``in_kernels``): each transcendental op and each random
draw (``prims.inductor_random``: dropout's numbers, made inside the kernel) with its output's elements, priced at
its op's calibrated per-element rate.
"""
from __future__ import annotations

import contextlib
import types

from batchlab.formula.opcost import OpClass, op_class

FILE = "<batchlab: inductor's wrapper, kernels not built>"
# watchers told as each wrapper call starts (``start(args)``) and ends (``end()``): the compiled backward's working
# set is derived by following one call (trace/compiled_working.py)
CALLS: list = []


class _NoKernels:
    """Stands in for inductor's AsyncCompile while a wrapper loads: every kernel it would build computes nothing
    (the trace runs on fake tensors and its buffers are already allocated) but is recorded, once per call, as one
    compiled kernel moving its arguments' bytes (trace/ops.py ``inductor_kernel``): a fused chain reads its
    inputs and writes its outputs once."""

    def __getattr__(self, name):
        def build(*args, **kwargs):
            return _ran
        return build

    def wait(self, scope) -> None:
        pass


def _ran(*args, **kwargs) -> None:
    from batchlab.trace.ops import inductor_kernel

    inductor_kernel([a for a in (*args, *kwargs.values()) if _is_tensor(a)])


def _is_tensor(a) -> bool:
    import torch

    return isinstance(a, torch.Tensor)


def _alloc(device: str):
    import torch

    # through the dispatcher (the wrapper's C++ allocator bypasses it): fake mode makes it fake, the tracker counts it
    return lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype, device=device)


def _load(graph, wrapper_code):
    """GraphLowering._compile_to_module_lines without writing, building or caching anything: the wrapper's
    source executed into a fresh module with kernels stubbed and allocations made through the dispatcher."""
    import torch._inductor.async_compile as async_compile

    mod = types.ModuleType("batchlab_inductor_plan")
    mod.__file__ = FILE
    built = async_compile.AsyncCompile
    async_compile.AsyncCompile = _NoKernels
    try:
        exec(compile(wrapper_code.value, FILE, "exec"), mod.__dict__)  # noqa: S102 - inductor's own generated code
    finally:
        async_compile.AsyncCompile = built
    for device in ("cpu", "cuda", "xpu", "mtia"):
        setattr(mod, f"empty_strided_{device}", _alloc(device))
    # a view, as the wrapper's C++ helper makes it, but dispatched (fake tensors have no data pointer)
    mod.reinterpret_tensor = lambda t, size, stride, offset: t.as_strided(size, stride, offset)
    for k, v in {**graph.constants, **graph.torchbind_constants,
                 **getattr(graph, "opaque_value_type_classes", {})}.items():  # the attributes inductor's loader sets
        setattr(mod, k, v)
    mod.call = _arithmetic_counted(_real_inputs_allowed(mod.call), in_kernels(graph.graph))
    return mod


# what a generated kernel spends per element beyond moving its buffers: transcendental functions (SLEEF's
# vectorised exp, tanh, erf as ATen's kernels call them) and the RNG drawn inside the kernel (calibrate/compiled_rng.py)
ARITHMETIC = frozenset({OpClass.ACTIVATION, OpClass.ACTIVATION_GRAD, OpClass.RANDOM})


def in_kernels(graph) -> tuple[tuple[str, int, bool], ...]:
    """(op name, elements, 16-bit) of each node of a graph inductor lowers whose per-element arithmetic its
    kernels compute (``ARITHMETIC``; not one it leaves to ATen, whose call the trace records as it runs)."""
    import torch
    from torch._inductor.lowering import fallbacks

    out = []
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target in fallbacks:
            continue
        name = target.overloadpacket.__name__
        val = node.meta.get("val")
        if op_class(name) in ARITHMETIC and isinstance(val, torch.Tensor):
            out.append((name, int(val.numel()), val.dtype in (torch.bfloat16, torch.float16)))
    return tuple(out) + _bool_outputs(graph, fallbacks)


def _bool_outputs(graph, fallbacks) -> tuple[tuple[str, int, bool], ...]:
    """A bool tensor a CPU graph returns (a forward's dropout mask kept for backward), stored by a generated C++
    kernel from its vector mask at a per-element cost of its own (calibrate/compiled_rng.py ``MASK``)."""
    import torch
    from torch.utils._pytree import tree_leaves

    from batchlab.formula.fusion import MASK

    out = []
    for node in graph.nodes:
        if node.op != "output":
            continue
        for arg in tree_leaves(node.args):
            val = getattr(arg, "meta", {}).get("val")
            if (getattr(arg, "op", "") == "call_function" and arg.target not in fallbacks
                    and isinstance(val, torch.Tensor) and val.dtype is torch.bool and val.device.type == "cpu"):
                out.append((MASK, int(val.numel()), False))
    return tuple(out)


def _arithmetic_counted(call, arithmetic):
    """``call`` recording its kernels' per-element arithmetic once per run (trace/ops.py ``fused_arithmetic``)."""
    from batchlab.trace.ops import fused_arithmetic

    def run(args):
        for name, elements, low in arithmetic:
            fused_arithmetic(name, elements, low)
        return call(args)

    return run


def _real_inputs_allowed(call):
    """A checkpoint's preserved RNG state is the real generator state (rng_prims' fake rule returns
    torch.get_rng_state()), which the recompute in the backward reads: the trace's fake mode takes it."""
    from torch._subclasses.fake_tensor import FakeTensor

    def run(args):
        # no reference to an input kept here: the wrapper frees its inputs as it goes (args.clear(), del)
        mode = next((a.fake_mode for a in args if isinstance(a, FakeTensor)), None)
        if mode is not None:
            mode.allow_non_fake_inputs = True
        for w in CALLS:
            w.start(args)
        try:
            return call(args)
        finally:
            for w in CALLS:
                w.end()

    return run


@contextlib.contextmanager
def kernels_not_built(on_partition=None):
    """Within: inductor compiles as usual up to its wrapper's source, which loads with no-op kernels (``_load``).
    Its graph caches are off, so nothing compiled here is stored or served to a real compile later (backward
    graphs compile lazily, at the first backward: keep the whole traced update inside).  ``on_partition(fw, bw,
    kwargs)`` sees each partition inductor's min-cut partitioner makes (after inductor's joint-graph passes)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.config as inductor_config
    from torch._inductor.graph import GraphLowering

    partitioner = compile_fx.min_cut_rematerialization_partition

    def partition(joint, joint_inputs, **kwargs):
        fw, bw = partitioner(joint, joint_inputs, **kwargs)
        if on_partition is not None:
            on_partition(fw, bw, kwargs)
        return fw, bw

    # one thread: no kernel is built, so no compile workers are started
    with inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False, compile_threads=1), \
            functorch_config.patch(enable_autograd_cache=False):
        real = GraphLowering._compile_to_module_lines
        GraphLowering._compile_to_module_lines = _load
        compile_fx.min_cut_rematerialization_partition = partition
        try:
            yield
        finally:
            GraphLowering._compile_to_module_lines = real
            compile_fx.min_cut_rematerialization_partition = partitioner


def inductor(gm, example_inputs):
    """A torch.compile backend: inductor itself (use inside ``kernels_not_built``)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)
