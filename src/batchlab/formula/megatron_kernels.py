"""The fused kernels Megatron-LM runs on CUDA where eager PyTorch code runs several ops, for the op list
(formula/oplist.py) of ``--impl megatron``.

Megatron-LM's training arguments turn these fusions on unless a flag turns them off (megatron/training/
arguments.py: ``--no-rope-fusion`` and ``--no-bias-swiglu-fusion`` are ``store_false``): the rotary embedding is one
kernel per tensor each way (Transformer Engine's ``fused_apply_rotary_pos_emb``), SwiGLU one kernel over fc1's
fused gate-and-up output (``bias_swiglu_impl``), and its norms are fused kernels (Transformer Engine's or Apex's
LayerNorm / RMSNorm, one read of the input and one write of the output).  Fused attention takes grouped k/v heads
as they are: nothing repeats them to every query head.  Bytes are what each kernel reads and writes.
"""
from __future__ import annotations

from batchlab.config.phase import Phase
from batchlab.formula.opbuild import op
from batchlab.formula.opcost import OpCount

BWD = Phase.BACKWARD


def rope(phase: Phase, n: int, width: int, backward: bool) -> list[OpCount]:
    """Rotary embedding of one tensor of ``n`` elements: reads it (and the small frequency table), writes the
    rotated copy; backward the same on its gradient."""
    out = [op("fused_rope", phase, n, 2 * n * width)]
    if backward:
        out.append(op("fused_rope_backward", BWD, n, 2 * n * width))
    return out


def swiglu(phase: Phase, t: int, f: int, width: int, backward: bool) -> list[OpCount]:
    """silu(gate) * up over fc1's (t, 2f) output: reads 2·t·f, writes t·f; backward reads the output's gradient and
    the saved input, writes the input's gradient (2·t·f)."""
    out = [op("fused_swiglu", phase, t * f, 3 * t * f * width)]
    if backward:
        out.append(op("fused_swiglu_backward", BWD, 2 * t * f, 5 * t * f * width))
    return out
