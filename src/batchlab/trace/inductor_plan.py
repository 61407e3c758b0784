"""Inductor's own memory plan, run without its kernels: the compiled trace (trace/compiled.py) compiles with
inductor itself (its post-grad passes, lowering, scheduler, fusion and the wrapper's buffer planning) and loads
the generated wrapper with every kernel a no-op, so no C++ is built; the wrapper then runs on fake tensors under
the live-storage tracker.

What the tracker counts is then what inductor's wrapper allocates: its ``empty_strided`` buffers, the outputs of
the ops it leaves to ATen (matmuls into planned buffers, fallbacks), a dead buffer reused in place
(``buf5 = buf3; del buf3  # reuse``: one storage), each ``del`` at the point inductor frees, the saved tensors
released as the backward goes (``args.clear()``).  Fused regions, recomputed ones included, write only what
inductor realises.  Lowering is for the device the fake tensors are on: CPU here.

For time, each kernel call is one launch moving its buffers once (the ATen calls the wrapper makes, its extern
matmuls, are no-grad calls; its allocations and ``reinterpret_tensor`` views are C++ helpers with no dispatch
of their own), and the per-element arithmetic its loops do
beyond moving them is read off the graph inductor lowered (``in_kernels``): each transcendental op and each random
draw (``prims.inductor_random``: dropout's numbers, made inside the kernel) with its output's elements, priced at
the rate that op runs at inside a generated kernel (at::vec's function, not ATen's kernel of the op; a softmax's
passes over a row as one), and each element a kernel reads of a realised bool tensor (a mask the forward saved
for backward, read back in either graph), which it widens into a vector mask element by element: a mask a graph
makes from indices and does not save (a causal mask under full AC) is computed inside the loop instead, for
nothing (calibrate/compiled_rng.py times each rate).
"""
from __future__ import annotations

import contextlib
import types

from batchlab.formula.inkernel import in_kernel
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


def _helper(fn):
    """``fn`` standing in for one of the wrapper's C++ helpers (its allocator, ``reinterpret_tensor``): dispatched
    here so fake mode and the tracker see it, recorded without a dispatch's cost (the real helper has none)."""
    from batchlab.config.phase import Launch
    from batchlab.trace.ops import kernel

    def run(*args):
        with kernel(Launch.FUSED, 0):
            return fn(*args)

    return run


def _alloc(device: str):
    import torch

    # through the dispatcher (the wrapper's C++ allocator bypasses it): fake mode makes it fake, the tracker counts it
    return _helper(lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype, device=device))


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
    mod.reinterpret_tensor = _helper(lambda t, size, stride, offset: t.as_strided(size, stride, offset))
    for k, v in {**graph.constants, **graph.torchbind_constants,
                 **getattr(graph, "opaque_value_type_classes", {})}.items():  # the attributes inductor's loader sets
        setattr(mod, k, v)
    mod.call = _arithmetic_counted(_real_inputs_allowed(mod.call), in_kernels(graph.graph))
    return mod


# what a generated kernel spends per element beyond moving its buffers: transcendental functions (at::vec's
# vectorised exp, tanh, erf inside the loop) and the RNG drawn inside the kernel (calibrate/compiled_rng.py)
ARITHMETIC = frozenset({OpClass.ACTIVATION, OpClass.ACTIVATION_GRAD, OpClass.RANDOM})


def _lowered(node, fallbacks) -> bool:
    """``node`` is an aten op inductor generates code for (not one it leaves to ATen)."""
    import torch

    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and node.target not in fallbacks


def in_kernels(graph) -> tuple[tuple[str, int, bool], ...]:
    """(op name, elements, 16-bit) of each node of a graph inductor lowers whose per-element arithmetic its
    kernels compute (``ARITHMETIC``, named as inside a kernel: ``inductor_tanh``; an ``exp`` of ``x - amax(x)``
    as the softmax it is; not one it leaves to ATen, whose call the trace records as it runs), and the bool
    reads of ``_mask_loads``."""
    import torch
    from torch._inductor.lowering import fallbacks

    out = []
    for node in graph.nodes:
        if not _lowered(node, fallbacks):
            continue
        name = node.target.overloadpacket.__name__
        val = node.meta.get("val")
        if op_class(name) in ARITHMETIC and isinstance(val, torch.Tensor):
            own = name if op_class(name) is OpClass.RANDOM else in_kernel("softmax" if _softmax(node) else name)
            out.append((own, int(val.numel()), val.dtype in (torch.bfloat16, torch.float16)))
    return tuple(out) + _bool_outputs(graph, fallbacks) + _mask_loads(graph, fallbacks)


def _softmax(node) -> bool:
    """``node`` is the ``exp(x - amax(x))`` of a decomposed softmax (or log-softmax)."""
    import torch

    aten = torch.ops.aten
    sub = node.args[0] if node.target is aten.exp.default and node.args else None
    if getattr(sub, "target", None) is not aten.sub.Tensor or len(sub.args) < 2:
        return False
    return getattr(sub.args[1], "target", None) in (aten.amax.default, aten.max.dim)


def _mask_loads(graph, fallbacks) -> tuple[tuple[str, int, bool], ...]:
    """Each realised CPU bool tensor (a graph input, or an output: a mask kept for backward) that a generated
    kernel reads: per lowered consumer, its elements times the loops it is inlined into (its own users: a
    softmax's max and exp passes each recompute a ``where`` that feeds both), one bool widened into a vector mask
    each (formula/fusion.py ``MASK_LOAD``).  A mask the graph computes and does not realise is made from indices
    inside the loop and is not counted; nor is one a graph stores and uses over its own shape (the consumer fuses
    with the store and takes the value from it): only a broadcast use runs in a loop of its own, reading it back.
    A mask as large as the loop reading it holds one value per element (a dropout's draw kept for backward), whose
    widening no branch predictor follows (``MASK_LOAD_RANDOM``); a smaller one broadcast over the loop is structure
    (a causal mask: runs along each row, ``MASK_LOAD``)."""
    import torch
    from torch.utils._pytree import tree_leaves

    from batchlab.formula.inkernel import MASK_LOAD, MASK_LOAD_RANDOM

    outputs = {a for n in graph.nodes if n.op == "output" for a in tree_leaves(n.args)}
    out = []
    for node in graph.nodes:
        val = node.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.dtype is torch.bool and val.device.type == "cpu"
                and (node.op == "placeholder" or node in outputs)):
            continue
        for user in node.users:
            used = user.meta.get("val")
            if _lowered(user, fallbacks) and isinstance(used, torch.Tensor) and used.dtype is not torch.bool \
                    and (node.op == "placeholder" or used.numel() > val.numel()):
                # as many elements as the loop reading it: a value per element (a dropout's draw), no runs
                own = MASK_LOAD_RANDOM if val.numel() >= used.numel() else MASK_LOAD
                out.append((own, int(used.numel()) * max(1, len(user.users)), False))
    return tuple(out)


def _bool_outputs(graph, fallbacks) -> tuple[tuple[str, int, bool], ...]:
    """A bool tensor a CPU graph returns (a forward's dropout mask kept for backward), stored by a generated C++
    kernel from its vector mask at a per-element cost of its own (calibrate/compiled_rng.py ``MASK``)."""
    import torch
    from torch.utils._pytree import tree_leaves

    from batchlab.formula.inkernel import MASK_STORE as MASK

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

    from batchlab.config.phase import Launch
    from batchlab.trace.ops import graph_call, kernel

    def run(args):
        # no reference to an input kept here: the wrapper frees its inputs as it goes (args.clear(), del)
        mode = next((a.fake_mode for a in args if isinstance(a, FakeTensor)), None)
        if mode is not None:
            mode.allow_non_fake_inputs = True
        for w in CALLS:
            w.start(args)
        graph_call()  # the graph's own call around its kernels, once per run
        try:
            with kernel(Launch.COMPILED):  # the ATen calls it makes (extern matmuls) are no-grad calls
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
