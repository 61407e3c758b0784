"""The trace of a compiled run (``estimate --trace --compile model|blocks``): the harness compiles what the config
names with a backend that runs AOTAutograd with inductor's decompositions and its min-cut rematerialisation
partitioner (inductor's choice of what the forward saves for backward) and returns the partitioned forward and
backward graphs without generating code; the update then runs those graphs on fake tensors under the same
live-storage tracker, node by node.

So the trace counts exactly the tensors the compiled forward saves for backward and every graph's outputs.  Of the
intermediates it counts what inductor writes to memory: a pointwise op whose consumers all fuse it in (pointwise
ops, reductions) runs beneath the tracker, as inductor's fused kernels never write it.  Nodes recomputed in backward
(activation checkpointing) are all counted: inductor fuses part of a recomputed region, so there the trace is an
upper bound; under ``--ac budget:F`` (torch.compile's activation_memory_budget, set around each compile by
models/compiled.py) the partition is the knapsack's own choice, and what its backward graph recomputes is counted
as a checkpoint's.  Measured on CPU (torch 2.13, fp32): without AC the peak within 1% of inductor's (to the byte at
seq 128 x 8 on the built-in GPT, and on a 2-layer Hugging Face GPT-2); with full or selective-op AC about a fifth
above it; the saved activations equal to within a few bytes (a checkpoint's RNG state, 5 KB per block, uncounted).
"""
from __future__ import annotations

from batchlab.config import CompileMode, ConfigError, RunConfig

NOTE = ("compiled ({mode}): AOTAutograd's min-cut partition of each compiled graph (inductor's decompositions and "
        "partitioner settings), run on fake tensors without code generation: exact on what the compiled forward "
        "saves for backward and on the graphs' outputs; pointwise chains inductor fuses are not counted; "
        "recomputed regions (a checkpoint's, budget:F's) are counted unfused, an upper bound there")


_VIEWS = ("view.default", "_unsafe_view.default", "permute.default", "expand.default", "t.default", "transpose.int",
          "unsqueeze.default", "squeeze.dim", "squeeze.dims", "slice.Tensor", "select.int", "alias.default")
_REDUCTIONS = ("sum.dim_IntList", "sum.default", "amax.default", "amin.default", "mean.dim", "var_mean.correction",
               "max.dim", "prod.dim_int", "any.dim", "all.dim")


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
    outputs, views, reductions = set(flat), _aten(_VIEWS), _aten(_REDUCTIONS)
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

    views, reductions = _aten(_VIEWS), _aten(_REDUCTIONS)
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

    from batchlab.trace.ops import kernel

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
    for listener in PARTITIONS:  # formula terms for compiled code read what the forward saves (trace/compiled_terms.py)
        listener.append((fw, kwargs["num_fwd_outputs"]))
    return fw, bw


_RULES_SET = []


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


def estimate(cfg: RunConfig, tree: bool = False, timeline: bool = False, calibrations=None):
    """trace.run.estimate with the model compiled by ``partition_only``: the graph breaks and graphs counted, the
    compiled trace's note added."""
    import dataclasses

    import torch

    from batchlab.models.compiled import break_summary, failure_text, using_backend
    from batchlab.trace.run import estimate as traced

    assert cfg.compile is not CompileMode.NONE
    _tracker_rules()
    with using_backend(partition_only) as watches:
        try:
            result = traced(cfg, tree=tree, timeline=timeline, calibrations=calibrations)
        except torch._dynamo.exc.TorchDynamoException as e:  # the model's own code did not compile
            raise ConfigError("compile", f"{cfg.model_source} ({cfg.model.name}) did not compile for the trace: "
                                         f"{failure_text(e)}") from None
        compiles = sum(w.compiles for w in watches)
        count, reasons = break_summary({k: v for w in watches for k, v in w.graph_breaks().items()})
    notes = [NOTE.format(mode=cfg.compile.value),
             f"compiled graphs: {compiles} compilations (dynamo frames and lazily compiled backwards), {count} graph breaks"
             + (f" (first: {'; '.join(reasons)})" if reasons else "")]
    return dataclasses.replace(result, notes=[*notes, *result.notes])

