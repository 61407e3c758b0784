"""The loss path: what F.cross_entropy keeps in each precision, and the chunked loss, against real CPU steps."""
import functools

import pytest
import torch
import torch.nn.functional as F

from batchlab.config import ConfigError, RunConfig, preset
from batchlab.formula import estimate
from batchlab.formula.loss import loss_path

# a loss-dominated shape: one layer, a vocabulary 64 x the hidden size
SHAPE = dict(layers=1, vocab=8192, dropout=0.0, attention="sdpa")


def saved_bytes(fn, *args):
    """Bytes of the distinct storages autograd saves while ``fn`` runs (saved_tensors_hooks)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_keeps_an_fp32_log_softmax_whatever_the_logits_dtype(dtype):
    n, v = 256, 1024
    logits = torch.randn(n, v, dtype=dtype, requires_grad=True)
    _, kept = saved_bytes(lambda x: F.cross_entropy(x.float(), torch.randint(0, v, (n,))), logits)
    # log_softmax's fp32 output, by hand, + nll_loss's int64 targets and a scalar; the 16-bit logits are not saved
    assert n * v * 4 + n * 8 <= kept <= n * v * 4 + n * 8 + 16
    cfg = RunConfig(model=preset("tiny", **SHAPE), seq=64, micro_batch=4,
                    precision="fp32" if dtype == torch.float32 else "bf16-mixed")
    assert loss_path(cfg).kept == 64 * 4 * 8192 * 4


# one real step per configuration for the module: tests asserting different things about the same step share it
@functools.lru_cache(maxsize=None)
def measured(cfg):
    from batchlab.measure.harness import Trainer
    from batchlab.measure.memory import track_update

    return track_update(Trainer(cfg))


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("loss", ["full", "chunked:4"])
def test_formula_peak_matches_a_real_step_for_each_loss_path(precision, loss):
    cfg = RunConfig(model=preset("tiny", **SHAPE), seq=64, micro_batch=8, precision=precision, loss=loss)
    m = measured(cfg)
    f = estimate(cfg).memory
    assert f.peak_tensor_bytes == pytest.approx(m.peak_bytes, rel=0.03), (precision, loss, m.peak_phase)
    if precision == "fp32":  # under autocast the tracker files the 16-bit weight casts as activations
        assert f.activations_bytes == pytest.approx(m.activations_bytes, rel=0.03)


def test_chunked_loss_lowers_the_peak_and_gives_the_same_gradients():
    from batchlab.measure.harness import Trainer

    cfg = RunConfig(model=preset("tiny", **SHAPE), seq=64, micro_batch=8)
    full, chunked = measured(cfg), measured(cfg.replace(loss="chunked:8"))
    assert chunked.peak_bytes < 0.8 * full.peak_bytes
    a = Trainer(cfg)
    batches = a.batches()
    ga, gb = a.gradients(batches), Trainer(cfg.replace(loss="chunked:8")).gradients(batches)
    for name, g in ga.items():
        torch.testing.assert_close(gb[name], g, rtol=1e-5, atol=1e-7)


def test_loss_names_parse_and_fused_is_formula_only():
    assert str(RunConfig(loss="chunked").loss) == "chunked:8"  # torchtune's default num_output_chunks
    with pytest.raises(ConfigError, match="loss"):
        RunConfig(loss="chunky")
    from batchlab.measure.harness import Trainer

    with pytest.raises(ConfigError, match="formula-only"):
        Trainer(RunConfig(loss="fused"))
    bf16 = RunConfig(precision="bf16-mixed")  # fused keeps the 16-bit logits, not an fp32 log-softmax
    assert estimate(bf16.replace(loss="fused")).memory.logits_bytes < 0.6 * estimate(bf16).memory.logits_bytes


def test_the_trace_runs_the_chunked_loss_too():
    from batchlab.trace import estimate as trace

    cfg = RunConfig(model=preset("tiny", **SHAPE), seq=64, micro_batch=8, loss="chunked:4")
    assert trace(cfg).memory.peak_bytes == pytest.approx(measured(cfg).peak_bytes, rel=0.01)


def test_compiled_loss_keeps_what_inductors_partitioner_saves():
    """torch.compile of F.cross_entropy(logits.float()): AOTAutograd's min-cut partitioner (the one inductor
    uses; backend aot_eager_decomp_partition runs it without a C compiler) saves the bf16 logits and two fp32
    per-row statistics, not the fp32 log-softmax; the formula's compiled loss path keeps the same bytes."""
    b, s, v = 2, 128, 4096

    def ce(pred, labels):
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))

    pred = torch.randn(b, s, v, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, v, (b, s))
    compiled = torch.compile(ce, backend="aot_eager_decomp_partition")
    _, kept = saved_bytes(compiled, pred, labels)
    cfg = RunConfig(seq=s, micro_batch=b, precision="bf16", loss="compiled").replace(**dict(SHAPE, vocab=v))
    labels_and_scalar = b * s * 8 + 4  # int64 targets (the formula's data) and the fp32 loss divisor
    assert loss_path(cfg).kept == kept - labels_and_scalar
    _, eager = saved_bytes(ce, pred, labels)
    assert eager - labels_and_scalar == b * s * v * 4  # eager: the fp32 log-softmax


def _megatron_calculate_gradients(softmax, grad_output, target_mask, masked_target_1d):
    """megatron/core/fusions/fused_cross_entropy.py ``calculate_gradients`` as its operands reach it (Megatron-LM
    @ d98e8a64, VocabParallelCrossEntropy's two static steps inlined)."""
    grad_2d = softmax.view(-1, softmax.size()[-1])
    arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
    softmax_update = 1.0 - target_mask.view(-1).float()
    grad_2d[arange_1d, masked_target_1d] -= softmax_update
    softmax.mul_(grad_output.unsqueeze(dim=-1))
    return softmax.to(torch.bfloat16)


def test_megatron_fused_cross_entropy_copies_the_saved_softmax_in_backward():
    """Megatron's --cross-entropy-loss-fusion runs its steps under torch.compile (megatron/core/jit.py): the
    backward's scatter into the saved fp32 softmax comes out of AOTAutograd's functionalisation as an
    out-of-place index_put, a new tensor of the softmax's size while the saved one is still live.  The formula's
    Megatron loss under --loss fused holds that second fp32 shard; the unfused path scatters in place."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from batchlab.cli.common import config_from_command
    from batchlab.formula.activation_plan import rank_loss_path
    from batchlab.formula.ranks import shares

    graphs = []

    def grab(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    s, b, v = 8, 2, 64
    softmax = torch.rand(s, b, v)
    with torch.no_grad():  # as in the autograd Function's backward
        torch.compile(_megatron_calculate_gradients, backend=aot_autograd(fw_compiler=grab))(
            softmax, torch.rand(s, b), torch.zeros(s, b, dtype=torch.bool), torch.randint(0, v, (s * b,)))
    scatters = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "index_put" in str(n.target)]
    assert [str(n.target) for n in scatters] == ["aten.index_put.default"]  # out of place: a new tensor
    assert scatters[0].meta["val"].numel() == softmax.numel()

    # Megatron-LM's functional test gpt3_mcore_te_tp2_pp2_cross_entropy_loss_fusion: its last stage's loss
    argv = ("estimate --model gpt2 --layers 12 --hidden 512 --heads 8 --ffn 2048 --vocab 50257 --seq 1024 "
            "--micro-batch 4 --accum 4 --dp 2 --tp 2 --pp 2 --pp-schedule 1f1b --ac none --device h100-sxm "
            "--attention sdpa --impl megatron --sharding megatron --precision bf16").split()
    shard = 4 * 1024 * 50257 // 2  # logits of 4 x 1024 tokens over half the vocabulary (two tensor-parallel ranks)
    fp32_shard, bf16_shard = shard * 4, shard * 2
    fused_cfg, full_cfg = config_from_command(argv + ["--loss", "fused"]), config_from_command(argv)
    fused = rank_loss_path(fused_cfg, shares(fused_cfg)[-1])
    full = rank_loss_path(full_cfg, shares(full_cfg)[-1])
    assert (fused.kept, fused.backward_transient) == (fp32_shard, fp32_shard + bf16_shard)
    assert (full.kept, full.backward_transient) == (fp32_shard, bf16_shard)
    lasts = [estimate(c).memory.ranks[-1] for c in (fused_cfg, full_cfg)]
    allocated = [r.peak_bytes - r.parts["allocator"] for r in lasts]
    assert allocated[0] - allocated[1] == fp32_shard  # the last stage's peak is its loss's backward


def _peaks(run) -> tuple[int, int]:
    """(highest bytes above the start, bytes left at the end) of the CPU allocations ``run`` makes, from the
    profiler's allocation timeline (it sees DTensor's local ops, which a dispatch mode above DTensor does not)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as p:
        run()
    now = top = 0
    for _, action, _, size in MemoryProfile(p.profiler.kineto_results).timeline:
        now += size if action is Action.CREATE else -size if action is Action.DESTROY else 0
        top = max(top, now)
    return top, now


def test_loss_parallel_holds_three_fp32_shards_beside_the_logits_in_forward(tmp_path):
    """torch's loss_parallel on a one-rank mesh, bf16 logits: forward's high point is their fp32 copy, ``shifted``
    and one of ``exp(shifted)`` / the kept output (exp dies in its sum first); backward's three fp32 shards beside
    the kept one -- vocab_parallel_path's figures."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from batchlab.formula.loss import vocab_parallel_path

    b, s, v = 2, 64, 4096
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = distribute_tensor(torch.randn(32, v).bfloat16(), mesh, [Shard(1)]).requires_grad_()
        labels = torch.randint(0, v, (b * s,))
        out = {"logits": DTensor.from_local(torch.randn(b, s, 32).bfloat16(), mesh, [Replicate()]) @ weight}

        def forward():
            with loss_parallel():
                out["loss"] = F.cross_entropy(out["logits"].flatten(0, 1).float(), labels)

        def backward():
            with loss_parallel():
                out["loss"].backward()

        fwd, kept = _peaks(forward)
        del out["logits"]  # torchtitan's ``del pred`` before backward
        bwd, _ = _peaks(backward)
    finally:
        dist.destroy_process_group()
    path = vocab_parallel_path(RunConfig(model=preset("tiny", vocab=v), seq=s, micro_batch=b, precision="bf16"), 1)
    n, tol = b * s * v, b * s * v * 4 // 100  # the targets, masks and per-row statistics beside the shards
    assert abs(kept - path.kept) <= tol and abs(fwd + n * 2 - (path.kept + path.forward_transient)) <= tol
    assert abs(bwd - path.backward_transient) <= tol
