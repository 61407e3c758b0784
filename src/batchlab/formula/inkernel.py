"""What an op is called when inductor's generated code computes it inside a fused kernel: ``inductor_tanh`` is
at::vec's tanh in a loop, not ATen's tanh kernel, and is priced at its own timed rate (calibrate/compiled_rng.py),
ATen's kernel's rate of the op where that is not timed (formula/opcost.py)."""
from __future__ import annotations

IN_KERNEL = "inductor_"


def in_kernel(name: str) -> str:
    """The name ``name``'s arithmetic goes by inside an inductor kernel."""
    return IN_KERNEL + name


# what inductor does in a kernel that no ATen op does, named as themselves in the op lists and the calibration
RNG = "inductor_random"  # the prim inductor lowers random ops to (torch/_inductor/inductor_prims.py)
MASK_STORE = "inductor_mask_store"  # a kept dropout mask's bool store inside a compiled kernel
MASK_LOAD = "inductor_mask_load"  # a kept bool mask read back inside a compiled kernel: structure (runs along a row)
# one holding a value per element of the loop reading it (a dropout's draw): no runs, each widening branch a guess
MASK_LOAD_RANDOM = "inductor_mask_load_random"
OWN = frozenset({RNG, "inductor_randint", MASK_STORE, MASK_LOAD, MASK_LOAD_RANDOM})


def aten_name(name: str) -> str:
    """The ATen op whose class an in-kernel op has (``tanh`` for ``inductor_tanh``)."""
    return name if name in OWN else name.removeprefix(IN_KERNEL)


def text(element_seconds: dict) -> str:
    """The assumptions line's clause on a compiled CPU model's in-kernel rates: timed here, or ATen's serving."""
    timed = sorted(k.split(":")[0].split("/")[1].removeprefix(IN_KERNEL) for k in element_seconds
                   if k.split(":")[0].partition("/")[2].startswith(IN_KERNEL))
    if not timed:
        return "; inductor's in-kernel rates not timed here: ATen's kernels' rates price its fused ops"
    return f"; inductor's in-kernel rates timed on this CPU ({', '.join(timed)}), ATen's for the others"


def rate_keys(cost_class: str, name: str, tag: str) -> tuple[str, ...]:
    """The calibration's per-element keys an op's rate is read from, first found first: its own (in-kernel where
    it is), ATen's kernel of the same op, its class's representative kernel; each in the op's precision, then
    fp32's."""
    aten = aten_name(name)
    return (f"{cost_class}/{name}:{tag}", f"{cost_class}/{name}:fp32", f"{cost_class}/{aten}:{tag}",
            f"{cost_class}/{aten}:fp32", f"{cost_class}:{tag}", f"{cost_class}:fp32")
