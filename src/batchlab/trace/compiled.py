"""The trace of a compiled run (``estimate --trace --compile model|blocks``): the harness compiles what the config
names with a backend that runs AOTAutograd and its min-cut rematerialisation partitioner (inductor's choice of
what the forward saves for backward) and returns the partitioned forward and backward graphs as they are, without
generating code; the update then runs those graphs on fake tensors under the same live-storage tracker.

So the trace sees exactly the tensors the compiled forward saves for backward and every graph's outputs.  Inside
a graph each intermediate is a tensor of its own from the op that makes it to its last use; inductor fuses
element-wise chains into kernels that never write some of them, and orders and reuses its buffers its own way
(a recomputed block's backward may hold more at once than the graph's order does): the trace is exact on saved
activations, and its temporaries are the unfused graph's, not inductor's (measured on the built-in GPT: the peak
within 1% for AC none and full at seq 64 x 4; 7.5% under at seq 128 x 8 with full AC, 8.7% over with
selective-op).  The graphs are not decomposed (inductor decomposes before fusing; decomposed, every piece of a
norm's backward would be counted as a buffer inductor never allocates: +25% on the peak).
"""
from __future__ import annotations

from batchlab.config import CompileMode, ConfigError, RunConfig

NOTE = ("compiled ({mode}): AOTAutograd's min-cut partition of each compiled graph (inductor's partitioner "
        "settings), run on fake tensors without code generation: exact on what the compiled forward saves for "
        "backward and on the graphs' outputs; temporaries as the unfused graph holds them (inductor fuses some "
        "away and orders its buffers its own way: the peak can differ either way)")


def _graph_as_is(gm, example_inputs):
    from functorch.compile import make_boxed_func
    from torch._subclasses.fake_tensor import FakeTensor

    def run(*args):
        # a checkpoint's preserved RNG state is the real generator state (rng_prims' fake rule returns
        # torch.get_rng_state()), which the recompute in the backward graph reads: the trace's fake mode takes it
        fake = next((a for a in args if isinstance(a, FakeTensor)), None)
        if fake is not None:
            fake.fake_mode.allow_non_fake_inputs = True
        return gm.forward(*args)

    return make_boxed_func(run)


def _partition(joint, joint_inputs, **kwargs):
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    # compiler="inductor": the partitioner's set of ops it may recompute in backward, as inductor's compile_fx
    return min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)


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
    """A torch.compile backend: AOTAutograd with the min-cut partition, each graph returned uncompiled."""
    from torch._functorch.aot_autograd import aot_module_simplified

    return aot_module_simplified(gm, example_inputs, fw_compiler=_graph_as_is, bw_compiler=_graph_as_is,
                                 partition_fn=_partition)


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

