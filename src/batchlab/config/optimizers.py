"""The optimizer catalogue: one entry per optimizer, owning every fact batchlab knows about it -- the state it keeps
per parameter, the ops its step runs (the time model prices them), the torch class the harness builds, and how the
printed script, each framework's settings and a live optimizer spell it.  The formula (memory.py, oplist.py), the
harness, the scripts ``fit`` prints, the framework settings and integrations/mapping.py read an entry; adding an
optimizer is adding an entry (and its tests) -- the pattern of devices.py and engines.py.

Torch-free: the torch class is named by its dotted path, resolved by the harness.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from batchlab.config.choices import Choice


class OptimizerKind(Choice):
    ADAMW = "adamw"
    SGD = "sgd"  # plain SGD, no state
    SGD_MOMENTUM = "sgd-momentum"  # one momentum buffer per parameter
    ADAFACTOR = "adafactor"  # torch.optim.Adafactor (torch >= 2.5): factored second moment, no first moment
    ADAMW8BIT = "adamw8bit"  # bitsandbytes AdamW8bit: 8-bit blockwise-quantized m and v (formula only here)
    ADAMW8BIT_PAGED = "adamw8bit-paged"  # bitsandbytes PagedAdamW8bit: the same states in CUDA unified memory


class StateShape(enum.Enum):
    """The shape of one state tensor, from its parameter's shape."""

    LIKE_PARAM = "like the parameter"
    # Shazeer & Stern 2018 (Adafactor), sec. 3: a matrix keeps its row and column statistics (the parameter's
    # shape with the last, resp. second-to-last, dimension 1); a vector keeps a full one (FULL_IF_VECTOR)
    ROWS = "row statistics (matrices only)"
    COLUMNS = "column statistics (matrices only)"
    FULL_IF_VECTOR = "like the parameter (vectors only)"

    def elements(self, shape: tuple[int, ...]) -> int:
        """Elements of this state for a parameter of ``shape``."""
        n = 1
        for d in shape:
            n *= d
        matrix = len(shape) > 1
        if self is StateShape.LIKE_PARAM:
            return n
        if self is StateShape.FULL_IF_VECTOR:
            return 0 if matrix else n
        if not matrix:
            return 0
        return n // shape[-1] if self is StateShape.ROWS else n // shape[-2]


@dataclass(frozen=True)
class StepOp:
    """One op of the step on one parameter, as the time model prices it: ``passes`` parameter-sized tensors read
    plus written (each ``elements`` = the parameter's), or a scalar op of fixed ``elements`` and ``nbytes``."""

    name: str
    passes: int = 0
    elements: int = 0  # a scalar op's (passes == 0)
    nbytes: int = 0

    @property
    def per_element(self) -> bool:
        return self.passes > 0


def _pass(name: str, passes: int) -> StepOp:
    return StepOp(name, passes)


def _scalar(name: str, elements: int = 0, nbytes: int = 0) -> StepOp:
    return StepOp(name, 0, elements, nbytes)


@dataclass(frozen=True)
class Blockwise8bit:
    """bitsandbytes' 8-bit blockwise states (Dettmers et al. 2022, 8-bit Optimizers via Block-wise Quantization):
    per parameter tensor, ``states`` uint8 tensors like it plus one fp32 absmax per ``block`` elements each; a
    tensor under ``min_8bit`` elements keeps fp32 states.  ``paged_min``: with paging, the states of a tensor of at
    least that many elements live in CUDA unified memory (cudaMallocManaged), outside PyTorch's caching
    allocator, so the device's allocated / active bytes never count them; None: not paged."""

    states: int = 2
    # bitsandbytes/optim/optimizer.py Optimizer2State.init_state: blocks = ceil(n / 2048), min_8bit_size=4096
    block: int = 2048
    min_8bit: int = 4096
    # bitsandbytes/optim/optimizer.py Optimizer8bit.get_state_buffer: paged only where p.numel() >= 1e5
    paged_min: int | None = None

    def device_bytes(self, n: int) -> int:
        """State bytes of an ``n``-element tensor that the device's allocator holds."""
        if n < self.min_8bit:
            return self.states * 4 * n
        absmax = self.states * 4 * -(-n // self.block)  # the per-block scales stay on the device
        paged = self.paged_min is not None and n >= self.paged_min
        return absmax + (0 if paged else self.states * n)


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer's facts.  State tensors live in the weights' dtype (fp32; bf16 under pure bf16), each
    parameter also holds a 0-dim fp32 ``step`` where the optimizer counts steps (not counted: a few bytes)."""

    kind: OptimizerKind
    states: tuple[StateShape, ...]  # one per state tensor of a parameter
    step_ops: tuple[StepOp, ...]  # its _single_tensor_* loop on one parameter (foreach=False)
    torch_class: str  # the class the harness builds, as the printed script writes it
    kwargs: tuple[tuple[str, object], ...]  # the harness's arguments besides foreach=False
    script_kwargs: str  # the printed script's extra arguments (", momentum=0.9")
    hf_optim: str | None  # transformers TrainingArguments(optim=...); None: no equivalent
    deepspeed_type: str  # DeepSpeed "optimizer": {"type": ...} (a torch.optim name DeepSpeed falls back to)
    live_names: tuple[str, ...]  # torch class names a live optimizer is recognised by (integrations/mapping.py)
    live_momentum: bool | None = None  # recognised only with (True) / without (False) momentum; None: either
    note: str = ""
    blockwise: Blockwise8bit | None = None  # 8-bit quantized states (bitsandbytes); None: states in the weights' dtype
    package: str = ""  # the package the class comes from, where not torch (a measurement without it is refused)

    @property
    def torch_kwargs(self) -> dict:
        # foreach=False: the per-parameter loop keeps temporaries to one parameter at a time (what the
        # calculator assumes); the fused/foreach paths hold a temporary per parameter group.
        return dict(self.kwargs) if self.package else dict(self.kwargs, foreach=False)  # bitsandbytes: no foreach

    def model_state_elements(self, total: int, shapes: dict[tuple[int, ...], int]) -> int:
        """State elements of a whole model: ``total`` parameters (a state like the parameter needs only the count,
        whatever the model's code), ``shapes`` ({shape: tensors}) for the factored ones."""
        if self.blockwise is not None:
            raise ValueError("a quantized state is counted in bytes: blockwise.device_bytes per tensor")
        like = sum(1 for s in self.states if s is StateShape.LIKE_PARAM)
        factored = tuple(s for s in self.states if s is not StateShape.LIKE_PARAM)
        return like * total + sum(k * s.elements(shape) for shape, k in shapes.items() for s in factored)

    def recognises(self, class_name: str, momentum: float | None) -> bool:
        if class_name not in self.live_names:
            return False
        return self.live_momentum is None or self.live_momentum == bool(momentum)


OPTIMIZERS: dict[OptimizerKind, OptimizerSpec] = {s.kind: s for s in (
    # torch.optim.adamw._single_tensor_adamw: m and v (Loshchilov & Hutter 2019)
    OptimizerSpec(OptimizerKind.ADAMW, (StateShape.LIKE_PARAM, StateShape.LIKE_PARAM),
                  (_scalar("add_", 1, 8), _scalar("_local_scalar_dense"), _pass("mul_", 2), _pass("lerp_", 3),
                   _pass("mul_", 2), _pass("addcmul_", 4), _pass("sqrt", 2), _pass("div", 2), _pass("add_", 2),
                   _pass("addcdiv_", 4)),
                  "torch.optim.AdamW", (("lr", 1e-4), ("weight_decay", 0.1)), "", "adamw_torch", "AdamW",
                  ("AdamW", "Adam")),  # Adam: the same two moments per parameter
    OptimizerSpec(OptimizerKind.SGD, (), (_pass("add_", 3),), "torch.optim.SGD", (("lr", 1e-3),), "", "sgd", "SGD",
                  ("SGD",), live_momentum=False),
    OptimizerSpec(OptimizerKind.SGD_MOMENTUM, (StateShape.LIKE_PARAM,),
                  (_pass("mul_", 2), _pass("add_", 3), _pass("add_", 3)),
                  "torch.optim.SGD", (("lr", 1e-3), ("momentum", 0.9)), ", momentum=0.9", None, "SGD",
                  ("SGD",), live_momentum=True,
                  note="no TrainingArguments optim runs SGD with momentum: pass Trainer(optimizers=(torch.optim.SGD(..., "
                       "momentum=0.9), None))"),
    # torch.optim._adafactor._single_tensor_adafactor (Shazeer & Stern 2018, beta1 = 0): a matrix keeps its
    # row_var and col_var, a vector its variance.  Its step, matrix path: the parameter's, the gradient's row and
    # column norms, the outer product row_var @ col_var (priced as one written pass), its division, clamp and
    # rsqrt, the multiply by the gradient, the update's norm and the parameter add
    OptimizerSpec(OptimizerKind.ADAFACTOR, (StateShape.ROWS, StateShape.COLUMNS, StateShape.FULL_IF_VECTOR),
                  (_scalar("add_", 1, 8), _scalar("_local_scalar_dense"), _pass("linalg_vector_norm", 1),
                   _pass("linalg_vector_norm", 1), _pass("linalg_vector_norm", 1), _pass("mul", 1), _pass("div_", 2),
                   _pass("clamp_", 2), _pass("rsqrt_", 2), _pass("mul_", 3), _pass("linalg_vector_norm", 1),
                   _pass("add_", 3)),
                  "torch.optim.Adafactor", (("lr", 1e-2),), "", None, "Adafactor", ("Adafactor",),
                  note="transformers' optim=\"adafactor\" is its own Adafactor, not torch's: pass "
                       "Trainer(optimizers=(torch.optim.Adafactor(...), None))"),
    # bitsandbytes' fused kernel (optimizer_update_8bit_blockwise): one pass reads the gradient and the weights,
    # writes the weights, reads and writes both 8-bit states (about one 16-bit pass)
    OptimizerSpec(OptimizerKind.ADAMW8BIT, (StateShape.LIKE_PARAM, StateShape.LIKE_PARAM),
                  (_pass("optimizer_update_8bit_blockwise", 4),),
                  "bitsandbytes.optim.AdamW8bit", (("lr", 1e-4), ("weight_decay", 0.1)), "", "adamw_bnb_8bit",
                  "AdamW", ("AdamW8bit",), blockwise=Blockwise8bit(), package="bitsandbytes"),
    OptimizerSpec(OptimizerKind.ADAMW8BIT_PAGED, (StateShape.LIKE_PARAM, StateShape.LIKE_PARAM),
                  (_pass("optimizer_update_8bit_blockwise", 4),),
                  "bitsandbytes.optim.PagedAdamW8bit", (("lr", 1e-4), ("weight_decay", 0.1)), "", "paged_adamw_8bit",
                  "AdamW", ("PagedAdamW8bit",), blockwise=Blockwise8bit(paged_min=100_000), package="bitsandbytes",
                  note="paged states live in CUDA unified memory: the driver pages them to host memory under "
                       "pressure; PyTorch's allocated and reserved bytes never include them"),
)}


def optimizer_spec(kind: OptimizerKind) -> OptimizerSpec:
    return OPTIMIZERS[kind]


def from_live(class_name: str, momentum: float | None) -> OptimizerKind | None:
    """The entry a live optimizer (its class name and first group's momentum) is, or None."""
    for spec in OPTIMIZERS.values():
        if spec.recognises(class_name, momentum):
            return spec.kind
    return None
