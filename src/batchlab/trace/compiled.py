"""The trace of a compiled run (``estimate --trace --compile model|blocks``).  On a CPU config the model compiles
with inductor itself, whose generated wrapper loads with no-op kernels (trace/inductor_plan.py): the update runs
that wrapper on fake tensors under the live-storage tracker, so the trace counts the buffers inductor plans,
allocates, reuses and frees, in its order, recomputed (checkpointed) regions fused as inductor fuses them.

Under ``--ac budget:F`` (torch.compile's activation_memory_budget, set around each compile by models/compiled.py)
inductor partitions with the knapsack's choice, and its plan fuses what the backward recomputes as any region.

Where inductor cannot plan here (a CUDA config: this machine lowers for CPU only; a lowering that fails) the
fallback is the partition-only backend: AOTAutograd with inductor's decompositions and its min-cut partitioner,
each graph run node by node on fake tensors; exact on what the forward saves and the graphs' outputs, pointwise
chains inductor fuses left uncounted, recomputed regions (a checkpoint's, budget:F's) counted unfused (an upper
bound there).
"""
from __future__ import annotations

import contextvars

from batchlab.config import Backend, CompileMode, ConfigError, RunConfig
from batchlab.config.phase import Phase

PLAN_NOTE = ("compiled ({mode}): inductor's own compile (AOTAutograd's min-cut partition, post-grad passes, "
             "lowering, scheduler and fusion), its wrapper run on fake tensors with no kernel built: exact on what the "
             "compiled forward saves for backward and on every buffer the wrapper allocates, reuses and frees, "
             "recomputed (checkpointed) regions fused as inductor fuses them; the time model prices the ops the wrapper "
             "dispatches (matmuls, fallbacks) and each generated kernel it calls as one launch moving its buffers once")
NOTE = ("compiled ({mode}): AOTAutograd's min-cut partition of each compiled graph (inductor's decompositions and "
        "partitioner settings), run on fake tensors without code generation: exact on what the compiled forward "
        "saves for backward and on the graphs' outputs; pointwise chains inductor fuses are not counted; "
        "recomputed regions (a checkpoint's, budget:F's) are counted unfused, an upper bound there")


_VIEWS = ("view.default", "_unsafe_view.default", "permute.default", "expand.default", "t.default", "transpose.int",
          "unsqueeze.default", "squeeze.dim", "squeeze.dims", "slice.Tensor", "select.int", "alias.default")


def _reductions() -> set:
    """Every overload of the reductions the formula's fusion rule names (formula/fusion.py REDUCTION_NAMES)."""
    import torch

    from batchlab.formula.fusion import REDUCTION_NAMES

    packets = [getattr(torch.ops.aten, n) for n in REDUCTION_NAMES if hasattr(torch.ops.aten, n)]
    return {getattr(p, o) for p in packets for o in p.overloads()}


def _aten(names):
    import torch

    return {getattr(getattr(torch.ops.aten, n.split(".")[0]), n.split(".")[1]) for n in names}


def _pointwise(node) -> bool:
    import torch

    t = node.target
    return node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags


def _fuses_into_consumers(node, outputs, views, reductions) -> bool:
    """Every consumer (through views) is a pointwise op or a reduction inductor fuses it into."""
    for u in node.users:
        if u in outputs or u.op != "call_function":
            return False
        if u.target in views:
            if not _fuses_into_consumers(u, outputs, views, reductions):
                return False
        elif not (_pointwise(u) or u.target in reductions):
            return False
    return True


def fused_away(gm, keep_recomputed: bool = True) -> set:
    """The graph's nodes inductor would not write to memory: a pointwise op that is not a graph output (so not
    saved for backward) and whose consumers all fuse it in.  Recomputed nodes (a checkpoint's, tagged by the
    partitioner; under budget:F every forward op of the backward graph) are kept (``keep_recomputed``): inductor
    fuses part of a recomputed region and realises the rest, so counting them all is the trace's upper bound on
    memory there; the time model fuses them."""
    import torch

    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat: list = []
    torch.fx.node.map_arg(out.args, flat.append)
    outputs, views, reductions = set(flat), _aten(_VIEWS), _reductions()
    return {n for n in gm.graph.nodes if _pointwise(n) and n not in outputs and n.users
            and (not keep_recomputed or (n.meta.get("recompute") is None and not n.meta.get(BUDGET_RECOMPUTED)))
            and _fuses_into_consumers(n, outputs, views, reductions)}


def chain_bytes(node, fused: set) -> int:
    """Bytes the kernel ending at ``node`` moves: its output, and each tensor entering the chain of fused-away
    nodes that feeds it, once (a pointwise chain's kernel reads its inputs and writes its output once)."""
    import torch

    from batchlab.trace.ops import footprint

    seen, inputs = set(), []

    def visit(n):
        for a in n.all_input_nodes:
            if a in seen:
                continue
            seen.add(a)
            if a in fused:
                visit(a)
            else:
                inputs.append(a)

    visit(node)
    vals = [a.meta.get("val") for a in inputs] + [node.meta.get("val")]
    return sum(footprint(v) for v in vals if isinstance(v, torch.Tensor))


def launches(gm) -> dict:
    """Per node the trace runs: who issues it and the bytes of its kernel (None: the op's own).  A view is free,
    a pointwise op or reduction is the kernel of the chain fused into it, anything else an extern call; a
    recomputed node inductor fuses (run for the memory count) has no launch of its own."""
    from batchlab.config.phase import Launch

    views, reductions = _aten(_VIEWS), _reductions()
    fused, out = fused_away(gm, keep_recomputed=False), {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n in fused:
            out[n] = (Launch.FUSED, 0)
        elif n.target in views:
            out[n] = (Launch.FUSED, None)
        elif _pointwise(n) or n.target in reductions:
            out[n] = (Launch.COMPILED, chain_bytes(n, fused))
        else:
            out[n] = (Launch.COMPILED, None)
    return out


def _graph_run(gm, example_inputs):
    """The graph run node by node (each value freed at its last use); a node inductor fuses away runs beneath
    every dispatch mode, so the live-storage tracker never counts its output; the others are recorded for the
    time model as inductor's kernels (``launches``)."""
    import torch
    from functorch.compile import make_boxed_func
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import _disable_current_modes

    from batchlab.trace.ops import graph_call, kernel

    fused = fused_away(gm)
    issued = launches(gm)

    class _Run(torch.fx.Interpreter):
        def run_node(self, n):
            if n in fused:  # a fake tensor's op still runs under its own fake mode
                with _disable_current_modes():
                    return super().run_node(n)
            if n in issued:
                with kernel(*issued[n]):
                    return super().run_node(n)
            return super().run_node(n)

    def run(*args):
        # a checkpoint's preserved RNG state is the real generator state (rng_prims' fake rule returns
        # torch.get_rng_state()), which the recompute in the backward graph reads: the trace's fake mode takes it
        fake = next((a for a in args if isinstance(a, FakeTensor)), None)
        if fake is not None:
            fake.fake_mode.allow_non_fake_inputs = True
        graph_call()  # the graph's own call around its kernels, once per run (forward or backward graph)
        return _Run(gm).run(*args)  # a fresh interpreter: nothing of this call is held after it

    return make_boxed_func(run)


BUDGET_RECOMPUTED = "batchlab_budget_recomputed"  # a forward op recomputed in backward under budget:F
PARTITIONS: list[list] = []  # while a list is in it, every partition's (forward graph, its user outputs) goes there


def _recomputed(bw) -> list:
    """The backward graph's forward ops (recomputed from what the forward saved): nodes no tangent reaches."""
    reached: set = set()
    for n in bw.graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(a in reached for a in n.all_input_nodes):
            reached.add(n)
    return [n for n in bw.graph.nodes if n.op == "call_function" and n not in reached]


def _partition(joint, joint_inputs, **kwargs):
    import torch
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    # compiler="inductor": the partitioner's set of ops it may recompute in backward, as inductor's compile_fx
    fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)
    if torch._functorch.config.activation_memory_budget < 1:  # budget:F (ACPolicy): its recompute, as a checkpoint's
        for n in _recomputed(bw):
            n.meta[BUDGET_RECOMPUTED] = True
    _partitioned(fw, bw, kwargs)
    return fw, bw


def _partitioned(fw, bw, kwargs) -> None:
    for listener in PARTITIONS:  # formula terms for compiled code read what the forward saves (trace/compiled_terms.py)
        listener.append((fw, kwargs["num_fwd_outputs"]))


_RULES_SET = []
# the CPU generator's state a checkpoint saves is device memory only where the device is the CPU (CUDA's state is
# a host tensor): estimate sets it per config
RNG_STATE_COUNTED = contextvars.ContextVar("batchlab_rng_state_counted", default=False)


def _tracker_rules() -> None:
    """The live-storage tracker's rules for the two higher-order ops a partitioned graph calls around a
    checkpointed random op (the forward saves the generator state, the recompute in backward replays it): the
    op itself runs under the tracker, so its outputs are counted as any op's (once per process)."""
    if _RULES_SET:
        return
    import torch
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
    from torch._subclasses.fake_tensor import FakeTensor

    from batchlab.measure.memory import StorageTracker, tensors_in

    def fake(args) -> bool:
        return any(isinstance(t, FakeTensor) for t in tensors_in(args))

    @run_and_save_rng_state.py_impl(StorageTracker)
    def _save(mode, op, *args, **kwargs):
        state = torch.get_rng_state()  # the CPU generator's (fake tensors' rule returns it too)
        if RNG_STATE_COUNTED.get():  # made outside the dispatcher: the tracker is told (kept for the recompute)
            mode.register([state], "activations" if mode.phase is Phase.FORWARD else "temporaries")
        with mode:
            return state, op(*args, **kwargs)

    @run_with_rng_state.py_impl(StorageTracker)
    def _replay(mode, rng_state, op, *args, **kwargs):
        if fake(args):  # no values: nothing to replay (as fake tensors' own rule)
            with mode:
                return op(*args, **kwargs)
        current = torch.get_rng_state()
        torch.set_rng_state(rng_state)
        try:
            with mode:
                return op(*args, **kwargs)
        finally:
            torch.set_rng_state(current)

    _RULES_SET.append(True)


def partition_only(gm, example_inputs):
    """A torch.compile backend: AOTAutograd with inductor's decompositions and the min-cut partition, each graph
    returned uncompiled (run by ``_graph_run``)."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.decomposition import select_decomp_table

    return aot_module_simplified(gm, example_inputs, fw_compiler=_graph_run, bw_compiler=_graph_run,
                                 partition_fn=_partition, decompositions=select_decomp_table())


def _traced(cfg: RunConfig, backend, within, falls_back: bool = False, **kwargs):
    """trace.run.estimate with the model compiled by ``backend`` inside ``within``; its compile-count note.
    ``falls_back``: the backend's own failure is raised as it is (the caller traces again with another backend)."""
    import torch

    from batchlab.models.compiled import break_summary, failure_text, using_backend
    from batchlab.trace.run import estimate as traced

    with within, using_backend(backend) as watches:
        try:
            result = traced(cfg, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:  # the model's own code did not compile
            if falls_back and isinstance(e, torch._dynamo.exc.BackendCompilerFailed):
                raise
            raise ConfigError("compile", f"{cfg.model_source} ({cfg.model.name}) did not compile for the trace: "
                                         f"{failure_text(e)}") from None
        compiles = sum(w.compiles for w in watches)
        count, reasons = break_summary({k: v for w in watches for k, v in w.graph_breaks().items()})
    return result, (f"compiled graphs: {compiles} compilations (dynamo frames and lazily compiled backwards), "
                    f"{count} graph breaks" + (f" (first: {'; '.join(reasons)})" if reasons else ""))


def no_plan_reason(cfg: RunConfig) -> str | None:
    """Why inductor's own plan is not used for ``cfg`` (None: it is)."""
    if cfg.device_spec.backend is not Backend.CPU:
        return (f"inductor lowers for CPU only here ({cfg.device} would lower with Triton on its GPU, fusing and "
                "planning differently)")
    return None


def estimate(cfg: RunConfig, tree: bool = False, timeline: bool = False, calibrations=None):
    """trace.run.estimate with the model compiled by inductor (``inductor_plan``), or where it cannot plan by
    ``partition_only``: the graph breaks and graphs counted, the compiled trace's note added."""
    assert cfg.compile is not CompileMode.NONE
    _tracker_rules()
    kwargs = dict(tree=tree, timeline=timeline, calibrations=calibrations)
    why = no_plan_reason(cfg)
    token = RNG_STATE_COUNTED.set(cfg.device_spec.backend is Backend.CPU)
    try:
        return _estimate(cfg, why, kwargs)
    finally:
        RNG_STATE_COUNTED.reset(token)


def _estimate(cfg: RunConfig, why: str | None, kwargs: dict):
    import contextlib
    import dataclasses

    from batchlab.models.compiled import failure_text
    from batchlab.trace.inductor_plan import inductor, kernels_not_built

    if why is None:
        try:
            result, counted = _traced(cfg, inductor, kernels_not_built(_partitioned), falls_back=True, **kwargs)
            notes = [PLAN_NOTE.format(mode=cfg.compile.value), counted]
            return dataclasses.replace(result, notes=[*notes, *result.notes])
        except ConfigError:  # the model's own code or the config: another backend would compile it to the same end
            raise
        except Exception as e:  # noqa: BLE001 - any failure of inductor's plan falls back (and says why)
            why = f"inductor's plan failed here ({failure_text(e)[:240]})"
    result, counted = _traced(cfg, partition_only, contextlib.nullcontext(), **kwargs)
    notes = [NOTE.format(mode=cfg.compile.value) + f"; not inductor's own plan: {why}", counted]
    return dataclasses.replace(result, notes=[*notes, *result.notes])
