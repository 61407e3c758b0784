"""torch.compile's kernels on an op list: the same ops, with each chain of pointwise ops between two matmuls
fused into one kernel, as inductor does (Ansel et al. 2024, "PyTorch 2", sec. 5: a pointwise op fuses into its
pointwise consumers and into a reduction's loop, a matmul is an extern kernel that ends a chain).

A chain's kernel reads what enters the chain and writes what leaves it once, one launch: for ops in the order
they run, each consuming the one before, the chain moves the members' bytes less each inner output twice (written
by one member, read by the next):

    bytes(kernel) = Σ bytes(op) − 2 · Σ_{inner outputs} elements · width

The members stay in the list, with no launch and no bytes of their own, so a transcendental member's arithmetic
(gelu, softmax, a norm) is still paid, a random member's at the rate of inductor's in-kernel RNG, which draws each
number inside the kernel (calibrate/compiled_rng.py); matmuls and fused attention are unchanged but issued by the
compiled graph's wrapper (``Launch.COMPILED``), views cost nothing.  A reduction (a norm, softmax, a sum) takes
the chain before it into its loop and ends it.  The rule reads op kinds only (formula/opcost.py ``OpClass``): it
applies to the formula's op list (formula/oplist.py) and to any recorded one alike.  Inner outputs a chain also
saves for backward are written as well in the real kernel: the rule counts them once, as read by the next member
only.

A forward that keeps its dropout masks for backward (its block not recomputed) stores each as a bool buffer, which
inductor's C++ (CPU) kernels write through a vector-mask-to-bool conversion costing about as much per element as the draw
itself (calibrate/compiled_rng.py times it): ``MASK``, one per drawn element.  A recomputed block's forward keeps
no mask and its backward draws the numbers again inside the kernels that use them, storing none.
"""
from __future__ import annotations

from collections.abc import Iterable

from batchlab.config.phase import Launch, Phase
from batchlab.formula.opcost import OpClass, OpCount

POINTWISE = frozenset({OpClass.MEMORY, OpClass.STRIDED, OpClass.ACTIVATION, OpClass.ACTIVATION_GRAD,
                       OpClass.MASKED, OpClass.RANDOM})
REDUCING = frozenset({OpClass.NORM, OpClass.SOFTMAX, OpClass.LOSS})
# reductions inductor fuses a chain into (and ends it with); trace/compiled.py reads the same list
REDUCTION_NAMES = frozenset({"sum", "mean", "amax", "amin", "var_mean", "linalg_vector_norm", "max", "prod", "any",
                             "all"})
KERNEL = "fused"  # the name a chain's kernel goes by in the op list
RNG = "inductor_random"  # the prim inductor lowers random ops to (torch/_inductor/inductor_prims.py)
MASK = "inductor_mask_store"  # a kept dropout mask's bool store inside a compiled kernel (calibrate/compiled_rng.py)


def _reduces(op: OpCount) -> bool:
    return op.cost_class in REDUCING or op.name in REDUCTION_NAMES


def launched(op: OpCount, launch: Launch) -> OpCount:
    """``op`` issued by ``launch`` (a compiled graph runs no selective-checkpointing dispatch mode per op)."""
    return OpCount(op.name, op.phase, op.cost_class, op.flops, op.bytes, op.elements, op.low_precision, op.count,
                   op.flops_per_matmul, False, launch)


def _drawn_in_kernel(op: OpCount) -> OpCount:
    """A random op as inductor runs it: each number drawn inside the fused kernel (``prims.inductor_random``, one
    Philox engine per element on CPU: calibrate/compiled_rng.py), priced at that RNG's own per-element rate."""
    return OpCount(RNG, op.phase, op.cost_class, op.flops, op.bytes, op.elements, op.low_precision, op.count,
                   op.flops_per_matmul, op.sac_dispatched, op.launch)


def _mask_stored(op: OpCount) -> OpCount:
    """The bool mask a forward's random op keeps for backward, stored inside its kernel: one byte per element."""
    return OpCount(MASK, op.phase, OpClass.RANDOM, 0, op.elements, op.elements, op.low_precision, op.count, 0,
                   False, Launch.FUSED)


def _kernel(chain: list[OpCount], width: int) -> list[OpCount]:
    """One chain's kernel (``count`` times when every member repeats alike) and its members, launch-free."""
    calls = sum(op.count for op in chain)
    moved = sum(op.bytes * op.count for op in chain)
    last = chain[-1]
    inner = sum(op.elements * op.count for op in chain) - last.elements  # every call's output but the chain's last
    fused = max(moved - 2 * width * inner, max(op.bytes for op in chain), 0)
    members = [OpCount(op.name, op.phase, op.cost_class, 0, 0, op.elements, op.low_precision, op.count,
                       op.flops_per_matmul, False, Launch.FUSED) for op in chain]
    if calls == 1:  # one op alone: itself, issued by the compiled graph
        return [launched(chain[0], Launch.COMPILED)]
    kernel = OpCount(KERNEL, last.phase, OpClass.MEMORY, 0, fused, max(op.elements for op in chain),
                     any(op.low_precision for op in chain), 1, 0, False, Launch.COMPILED)
    return [kernel, *members]


def fuse(ops: Iterable[OpCount], width: int, keeps_masks: bool = True) -> list[OpCount]:
    """``ops`` (one region's, in the order they run; any phases mixed) as a compiled graph runs them: per phase,
    pointwise chains fused into one kernel each (``width``: bytes of an inner output's element), matmuls and
    other ops issued by the graph's wrapper, views free; ``keeps_masks``: the forward keeps its dropout masks for
    backward (its block is not recomputed)."""
    out: list[OpCount] = []
    chains: dict = {}  # phase -> the open chain

    def close(phase) -> None:
        chain = chains.pop(phase, None)
        if chain:
            out.extend(_kernel(chain, width))

    for op in ops:
        if op.cost_class is OpClass.RANDOM:
            op = _drawn_in_kernel(op)
            if keeps_masks and op.phase is Phase.FORWARD:
                out.append(_mask_stored(op))
        if op.cost_class is OpClass.VIEW:
            out.append(launched(op, Launch.FUSED))
        elif op.cost_class in POINTWISE or _reduces(op):
            chains.setdefault(op.phase, []).append(op)
            if _reduces(op):
                close(op.phase)
        else:  # a matmul, fused attention, anything inductor calls as an extern kernel: ends the chain
            close(op.phase)
            out.append(launched(op, Launch.COMPILED))
    for phase in list(chains):
        close(phase)
    return out
