"""Liger's fused linear cross-entropy (--loss fused-linear) against its algorithm run on live tensors: the chunk
loop of liger_kernel/ops/fused_linear_cross_entropy.py ``fused_linear_cross_entropy_forward`` in plain torch (the
Triton cross-entropy kernel's in-place softmax gradient written as in-place torch ops), its storages counted by
batchlab's live-storage tracker."""
from __future__ import annotations

import torch

from batchlab.config import ModelSpec, RunConfig
from batchlab.formula.activation_plan import rank_loss_path
from batchlab.formula.loss import loss_path
from batchlab.formula.ranks import share
from batchlab.measure.memory import StorageTracker

N, H, V = 512, 64, 1000  # tokens, hidden, vocabulary


def _liger_forward(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor):
    inc_factor = -(-weight.shape[0] // H)  # the rows of the head this kernel is given
    chunk = 1 << (-(-N // inc_factor) - 1).bit_length()  # triton.next_power_of_2(triton.cdiv(BT, inc_factor))
    grad_input = torch.zeros_like(x)
    grad_weight = torch.zeros_like(weight)
    loss_1d = torch.zeros(N, dtype=torch.float32)
    for start in range(0, N, chunk):
        x_chunk = x[start:start + chunk]
        logits = x_chunk @ weight.t()
        # liger_cross_entropy_kernel: loss per row, then softmax - one_hot written over the logits, scaled by 1/N
        # (its fp32 arithmetic lives in registers: no fp32 copy of the chunk)
        lse = torch.logsumexp(logits, dim=-1)
        loss_1d[start:start + chunk] = lse - logits.gather(1, target[start:start + chunk, None])[:, 0].float()
        logits.sub_(lse[:, None]).exp_()
        logits.scatter_add_(1, target[start:start + chunk, None],
                            torch.full((logits.shape[0], 1), -1.0, dtype=logits.dtype))
        logits.div_(N)
        torch.mm(logits, weight, out=grad_input[start:start + chunk])
        grad_weight.addmm_(logits.t(), x_chunk)
        del logits, lse
    return loss_1d.sum() / N, grad_input, grad_weight, loss_1d


def test_fused_linear_keeps_both_gradients_and_one_chunk_of_logits():
    torch.manual_seed(0)
    x = torch.randn(N, H, dtype=torch.bfloat16)
    weight = torch.randn(V, H, dtype=torch.bfloat16) * 0.02
    target = torch.randint(0, V, (N,))
    after, peak = _tracked(x, weight, target)  # what its autograd Function saves for backward, and its peak
    model = ModelSpec(name="t", layers=1, hidden=H, heads=1, ffn=4 * H, vocab=V, max_positions=N)
    lp = loss_path(RunConfig(model=model, seq=N, micro_batch=1, precision="bf16", loss="fused-linear"))
    # kept: grad_input 512 x 64 x 2 + grad_weight 1000 x 64 x 2 + loss_1d 512 x 4 = 195,584 bytes; peak: one
    # 32-token chunk of logits (32 x 1000 x 2) on top; the tracker also sees the few per-row temporaries
    assert abs(lp.kept - after) <= 0.02 * after
    assert abs(lp.kept + lp.forward_transient - peak) <= 0.05 * peak
    assert lp.backward_transient == 0


def _tracked(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    """Bytes the kernel keeps for backward and its peak, above what was live before it."""
    tracker = StorageTracker(fake=False)
    tracker.register([x, weight, target], "parameters")
    tracker.reset()
    with tracker:
        kept = _liger_forward(x, weight, target)
        after = tracker.live_bytes - tracker.snapshot().baseline_bytes
    peak = tracker.snapshot().peak_bytes - tracker.snapshot().baseline_bytes
    tracker.close()
    del kept
    return after, peak


def test_fused_linear_under_vocabulary_parallelism_splits_only_the_vocabulary_sized_tensors():
    # tp = 2 divides V: one rank runs the kernel over its 500-row shard of the head, on every token
    torch.manual_seed(0)
    x = torch.randn(N, H, dtype=torch.bfloat16)
    shard = torch.randn(V // 2, H, dtype=torch.bfloat16) * 0.02
    target = torch.randint(0, V // 2, (N,))
    after, peak = _tracked(x, shard, target)
    model = ModelSpec(name="t", layers=1, hidden=H, heads=2, ffn=4 * H, vocab=V, max_positions=N)
    cfg = RunConfig(model=model, seq=N, micro_batch=1, precision="bf16", loss="fused-linear", tp=2)
    assert cfg.vocab_parallel
    lp = rank_loss_path(cfg, share(cfg, 0))
    # by hand: grad_input 512 x 64 x 2 = 65,536 and loss_1d 512 x 4 = 2,048 whole, grad_weight 500 x 64 x 2 = 64,000;
    # chunk next_pow2(ceil(512 / ceil(500 / 64))) = 64 tokens of 500 logits x 2 bytes = 64,000
    assert lp.kept == 65_536 + 64_000 + 2_048
    assert lp.forward_transient == 64 * 500 * 2
    assert abs(lp.kept - after) <= 0.02 * after
    assert abs(lp.kept + lp.forward_transient - peak) <= 0.05 * peak


def test_a_fused_loss_keeps_its_per_token_log_sum_exp_whole_under_vocabulary_parallelism():
    # --loss fused on one of 2 vocabulary shards: 512 tokens x 500 logits x 2 bytes, and the fp32 log-sum-exp of
    # every token (512 x 4), which the shards all-reduce and each keeps whole
    model = ModelSpec(name="t", layers=1, hidden=H, heads=2, ffn=4 * H, vocab=V, max_positions=N)
    cfg = RunConfig(model=model, seq=N, micro_batch=1, precision="bf16", loss="fused", tp=2)
    assert rank_loss_path(cfg, share(cfg, 0)).kept == 512 * 500 * 2 + 512 * 4
