"""torch.compile's kernels on an op list: the same ops, with each chain of pointwise ops between two matmuls
fused into one kernel, as inductor does (Ansel et al. 2024, "PyTorch 2", sec. 5: a pointwise op fuses into its
pointwise consumers and into a reduction's loop, a matmul is an extern kernel that ends a chain).

A chain's kernel reads what enters the chain and writes what leaves it once, one launch: for ops in the order
they run, each consuming the one before, the chain moves the members' bytes less each inner output twice (written
by one member, read by the next):

    bytes(kernel) = Σ bytes(op) − 2 · Σ_{inner outputs} elements · width

The members stay in the list, with no launch and no bytes of their own, so a transcendental member's arithmetic
(gelu, a softmax) is still paid, a random member's at the rate of inductor's in-kernel RNG, which draws each
number inside the kernel (calibrate/compiled_rng.py); matmuls and fused attention are unchanged but issued by the
compiled graph's wrapper (``Launch.COMPILED``), views cost nothing.  A reduction (a norm, softmax, a sum) takes
the chain before it into its loop and ends it.  The rule reads op kinds only (formula/opcost.py ``OpClass``): it
applies to the formula's op list (formula/oplist.py) and to any recorded one alike.  Inner outputs a chain also
saves for backward are written as well in the real kernel: the rule counts them once, as read by the next member
only.

A forward that keeps its dropout masks for backward (its block not recomputed) stores each as a bool buffer, which
inductor's C++ (CPU) kernels write through a vector-mask-to-bool conversion costing about as much per element as the draw
itself (calibrate/compiled_rng.py times it): ``MASK_STORE``, one per drawn element.  Its backward reads each back
(``MASK_LOAD_RANDOM``: a draw per element, widened with no runs for a branch predictor to follow), twice for a
dropout on a softmax's output, whose gradient's row sum and pointwise pass both recompute the dropout's backward.
A recomputed block's forward keeps no mask and its backward draws the numbers again inside the kernels that use
them, storing and reading none.

A member's arithmetic is priced as inductor's loop computes it (``_member``): at::vec's tanh, exp or a softmax's
passes at their timed in-kernel rates, not ATen's kernels of those ops (calibrate/compiled_rng.py); a masked fill is a
blend whose cost is its mask: a kept block reads the bool mask it saved for backward per element (``MASK_LOAD``),
a recomputed block computes a causal mask from the loop's indices (what the softmax kernels of a GPT block do under AC
none and full in inductor's generated code).
"""
from __future__ import annotations

from collections.abc import Iterable

from batchlab.config.phase import Launch, Phase
from batchlab.formula.inkernel import MASK_LOAD, MASK_LOAD_RANDOM, MASK_STORE, RNG, in_kernel
from batchlab.formula.opcost import OpClass, OpCount

POINTWISE = frozenset({OpClass.MEMORY, OpClass.STRIDED, OpClass.ACTIVATION, OpClass.ACTIVATION_GRAD,
                       OpClass.MASKED, OpClass.RANDOM})
REDUCING = frozenset({OpClass.NORM, OpClass.SOFTMAX, OpClass.LOSS})
# reductions inductor fuses a chain into (and ends it with); trace/compiled.py reads the same list
REDUCTION_NAMES = frozenset({"sum", "mean", "amax", "amin", "var_mean", "linalg_vector_norm", "max", "prod", "any",
                             "all"})
KERNEL = "fused"  # the name a chain's kernel goes by in the op list


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
    return OpCount(MASK_STORE, op.phase, OpClass.RANDOM, 0, op.elements, op.elements, op.low_precision, op.count, 0,
                   False, Launch.FUSED)


def _is_softmax(op: OpCount) -> bool:
    """A softmax's forward (its backward, ``_softmax_backward_data``, is of the same class)."""
    return op.cost_class is OpClass.SOFTMAX and op.name in ("_softmax", "softmax")


def _mask_read(op: OpCount, after: OpCount | None) -> OpCount:
    """The backward's bool reads of the mask a forward's random op kept: once per element, twice where the op
    follows a softmax (its gradient's two passes over a row each recompute the dropout's backward)."""
    reads = 2 if after is not None and _is_softmax(after) else 1
    return OpCount(MASK_LOAD_RANDOM, Phase.BACKWARD, OpClass.MASKED, 0, 0, op.elements * reads, op.low_precision,
                   op.count, 0, False, Launch.FUSED)


def _member(op: OpCount, chain: list[OpCount], kept: bool) -> OpCount:
    """``op``'s per-element work inside the chain's kernel, launch-free: an activation's or a softmax's arithmetic
    as inductor's loop computes it (``inductor_tanh``, ``inductor_softmax``: at::vec's functions, timed by
    calibrate/compiled_rng.py; ATen's rate of the op where not timed); a softmax's backward and a norm (forward
    or backward: a mean and a variance per row, inductor's vectorised Welford loop) none beyond their bytes; a
    masked fill a blend, whose mask is read back as bool per element where the block keeps it for backward
    (``kept``: its forward and backward; twice under a softmax, whose max and exp passes both recompute the fill)
    and is made from indices inside the loop where the block is recomputed."""
    name, cost_class, elements = op.name, op.cost_class, op.elements
    if cost_class in (OpClass.ACTIVATION, OpClass.ACTIVATION_GRAD):
        name = in_kernel(name)
    elif _is_softmax(op):
        name = in_kernel("softmax")
    elif (cost_class is OpClass.SOFTMAX and name == "_softmax_backward_data") or cost_class is OpClass.NORM:
        cost_class = OpClass.MEMORY
    elif cost_class is OpClass.MASKED and kept and op.phase in (Phase.FORWARD, Phase.BACKWARD):
        name = MASK_LOAD
        elements *= 2 if _is_softmax(chain[-1]) else 1
    elif cost_class is OpClass.MASKED:
        cost_class = OpClass.MEMORY
    return OpCount(name, op.phase, cost_class, 0, 0, elements, op.low_precision, op.count, op.flops_per_matmul,
                   False, Launch.FUSED)


def _kernel(chain: list[OpCount], width: int, kept: bool = True) -> list[OpCount]:
    """One chain's kernel (``count`` times when every member repeats alike) and its members, launch-free."""
    calls = sum(op.count for op in chain)
    moved = sum(op.bytes * op.count for op in chain)
    last = chain[-1]
    inner = sum(op.elements * op.count for op in chain) - last.elements  # every call's output but the chain's last
    fused = max(moved - 2 * width * inner, max(op.bytes for op in chain), 0)
    members = [_member(op, chain, kept) for op in chain]
    if calls == 1:  # one op alone: itself, issued by the compiled graph, its arithmetic as inductor's loop does it
        op, own = chain[0], members[0]
        return [OpCount(own.name, op.phase, own.cost_class, op.flops, op.bytes, own.elements, op.low_precision,
                        op.count, op.flops_per_matmul, False, Launch.COMPILED)]
    kernel = OpCount(KERNEL, last.phase, OpClass.MEMORY, 0, fused, max(op.elements for op in chain),
                     any(op.low_precision for op in chain), 1, 0, False, Launch.COMPILED)
    return [kernel, *members]


def _into_backward(chain: list[OpCount], width: int) -> list[OpCount]:
    """A recompute's last chain, after its last matmul, as inductor's backward graph runs it: fused into the
    kernel of its gradient, which reads the same input (a GPT block's gelu and gelu_backward both read fc1's
    output): no launch, its input read there already, its output written once (the weight gradient's matmul
    reads it), a transcendental evaluated once for both (the gradient's member prices it); random draws stay (a
    dropout past the block's last matmul, drawn again there: its output is not the one written)."""
    last = ([op for op in chain if op.cost_class is not OpClass.RANDOM] or chain)[-1]
    out = [OpCount(KERNEL, last.phase, OpClass.MEMORY, 0, last.elements * width * last.count, last.elements,
                   last.low_precision, 1, 0, False, Launch.FUSED)]
    for op in chain:
        member = _member(op, chain, False)
        shared = op.cost_class in (OpClass.ACTIVATION, OpClass.ACTIVATION_GRAD)
        out.append(OpCount(member.name, member.phase, OpClass.MEMORY if shared else member.cost_class, 0, 0,
                           member.elements, member.low_precision, member.count, 0, False, Launch.FUSED))
    return out


def fuse(ops: Iterable[OpCount], width: int, keeps_masks: bool = True, into_backward: bool = False) -> list[OpCount]:
    """``ops`` (one region's, in the order they run; any phases mixed) as a compiled graph runs them: per phase,
    pointwise chains fused into one kernel each (``width``: bytes of an inner output's element), matmuls and
    other ops issued by the graph's wrapper, views free; ``keeps_masks``: the forward keeps its dropout masks for
    backward (its block is not recomputed) and its C++ kernels store and read them back as bool at their timed
    rates (the op list passes False for a GPU's kernels, whose bool traffic is not priced); ``into_backward``: the region is a recompute whose last chain fuses
    into its gradient's backward kernel (``_into_backward``)."""
    out: list[OpCount] = []
    chains: dict = {}  # phase -> the open chain
    last: dict = {}  # phase -> the op before

    def close(phase) -> None:
        chain = chains.pop(phase, None)
        if chain:
            out.extend(_kernel(chain, width, keeps_masks))

    for op in ops:
        if op.cost_class is OpClass.RANDOM:
            op = _drawn_in_kernel(op)
            if keeps_masks and op.phase is Phase.FORWARD:
                out.extend((_mask_stored(op), _mask_read(op, last.get(op.phase))))
        if op.cost_class is not OpClass.VIEW:  # (dropout's empty_like before its draw)
            last[op.phase] = op
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
        if into_backward and phase is Phase.RECOMPUTE:
            out.extend(_into_backward(chains.pop(phase), width))
        close(phase)
    return out
