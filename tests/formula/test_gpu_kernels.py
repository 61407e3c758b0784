"""How the formula prices one update's ops on a GPU it has no calibration for (formula/timing.py, nominal costs):
fused kernels at their whole call's rate, bandwidth-bound work by its bytes (issue 36's mechanisms)."""
import pytest

from batchlab.config import RunConfig, preset
from batchlab.formula import estimate
from batchlab.formula.opcost import OpCount, Phase, op_class, price
from batchlab.formula.timing import nominal_costs

A100 = RunConfig(model=preset("gpt2"), seq=1024, micro_batch=8, precision="bf16-mixed", device="a100-80gb")


def sdpa(batch_heads: int, flops: float) -> OpCount:
    name = "_scaled_dot_product_flash_attention_for_cpu"
    return OpCount(name, Phase.FORWARD, op_class(name), flops, 0, 0, True, 1, int(flops // batch_heads))


def test_a_fused_attention_call_runs_at_its_whole_calls_rate_on_a_gpu():
    """FlashAttention is one kernel whose grid covers every (batch, head) (Dao et al. 2022, sec. 3.1): the same FLOPs
    split over 16 or 4096 entries cost the same; batchlab's CPU costs loop over entries (each entry's size)."""
    gpu = nominal_costs(A100)
    assert price((sdpa(16, 4e11),), gpu).seconds == pytest.approx(price((sdpa(4096, 4e11),), gpu).seconds)
    cpu = nominal_costs(A100.replace(device="cpu"))
    assert price((sdpa(65536, 1e9),), cpu).seconds > 1.5 * price((sdpa(16, 1e9),), cpu).seconds


def test_element_wise_work_on_a_gpu_costs_its_bytes_at_the_memory_bandwidth():
    """Roofline (Williams et al. 2009) for a bandwidth-bound kernel: 1 GB through an A100 80GB's 2.039 TB/s
    (NVIDIA A100 datasheet) is 0.49 ms; the launch (a few us) hides behind it."""
    op = OpCount("add", Phase.FORWARD, op_class("add"), 0, 10**9, 10**9 // 6, True, 1)
    # by hand: 1e9 B / 2.039e12 B/s = 0.4904 ms
    assert price((op,), nominal_costs(A100)).seconds == pytest.approx(0.4904e-3, rel=0.02)


def test_the_optimizer_step_on_a_gpu_takes_at_least_its_state_traffic():
    """AdamW reads parameter, gradient, m and v and writes parameter, m and v: 28 bytes per fp32 parameter at
    least (Loshchilov & Hutter 2019, Algorithm 2), over the card's bandwidth; it was priced at nothing before."""
    # by hand: GPT-2's 124,439,808 parameters (Hugging Face num_parameters()) x 28 B = 3,484,314,624 B; over the
    # A100 80GB's 2.039 TB/s that is 1.7088 ms
    assert estimate(A100).time.optimizer_seconds >= 1.7088e-3


def test_small_models_lose_more_of_the_peak_than_large_ones():
    """At the same card and precision, a model's element-wise bytes per token grow with h and its matmul FLOPs with
    h^2: the 125M shape's implied MFU sits below the 7B's (llm-foundry's A100 tables read 44.8% vs 64.2%)."""
    small = RunConfig(model=preset("gpt2", max_positions=2048), seq=2048, micro_batch=8, precision="bf16-mixed",
                      device="a100-80gb")
    big = small.replace(model=preset("gpt2", layers=32, hidden=4096, heads=32, max_positions=2048))
    assert estimate(small).mfu < 0.9 * estimate(big).mfu


def test_torchtitans_rms_norm_is_one_kernel_each_way_on_a_gpu():
    """torchtitan's nn.RMSNorm reaches ATen's _fused_rms_norm on CUDA (its 2024 configs: a fused Triton kernel);
    transformers' LlamaRMSNorm runs its Python ops: two norms per layer and the final one, one kernel each."""
    from batchlab.formula.oplist import micro_batch_ops

    tt = RunConfig(model=preset("llama-2-7b", layers=4, impl="torchtitan"), seq=1024, micro_batch=2,
                   precision="bf16-fsdp", device="a100-80gb")
    fused = [o for o in micro_batch_ops(tt) if o.name == "_fused_rms_norm"]
    assert sum(o.count for o in fused) == 2 * 4 + 1
    hf = micro_batch_ops(tt.replace(impl="hf"))
    assert not [o for o in hf if o.name.startswith("_fused_rms_norm")]
    assert sum(o.bytes * o.count for o in micro_batch_ops(tt) if o.cost_class.value != "matmul") < \
        sum(o.bytes * o.count for o in hf if o.cost_class.value != "matmul")


def test_attention_dropout_stays_in_the_fused_kernel_on_a_gpu():
    """FlashAttention draws its dropout mask inside the kernel (Dao 2023, FlashAttention-2, sec. 3.1), and CUDA SDPA
    takes dropout_p on its flash path: no s x s tensor is written; on CPU dropout sends SDPA to the math path."""
    from batchlab.formula.oplist import micro_batch_ops

    cfg = RunConfig(model=preset("gpt2", layers=2, attention="sdpa", dropout=0.1), seq=1024, micro_batch=2,
                    precision="bf16-mixed", device="a100-80gb")
    ops = micro_batch_ops(cfg)
    fused = [o for o in ops if o.name == "_scaled_dot_product_flash_attention"]
    # by hand: QK^T and PV, 2 x 2·b·s²·h FLOPs = 4 x 2 x 1024² x 768 = 6,442,450,944 per layer, 2 layers
    assert sum(o.flops * o.count for o in fused) == 2 * 6_442_450_944
    score_elements = 12 * 1024 * 1024 * 2  # a·s·s·b
    assert not [o for o in ops if o.elements == score_elements]
    cpu = micro_batch_ops(cfg.replace(device="cpu"))
    assert [o for o in cpu if o.elements == score_elements and o.name == "_softmax"]


def test_megatrons_rope_swiglu_and_norms_are_its_fused_kernels_on_a_gpu():
    """Megatron-LM fuses RoPE and SwiGLU unless told not to (megatron/training/arguments.py: --no-rope-fusion and
    --no-bias-swiglu-fusion are store_false) and runs fused norms; its flash attention takes grouped k/v as they are.
    A 4-layer Llama shape with GQA, b=2, s=1024 (T = 2048 tokens), h=4096, kv width 1024, f=11008, bf16."""
    from batchlab.formula.oplist import micro_batch_ops

    cfg = RunConfig(model=preset("llama-2-7b", layers=4, kv_heads=8, impl="megatron", attention="sdpa", dropout=0.0),
                    seq=1024, micro_batch=2, precision="bf16", device="h100-sxm")
    ops = micro_batch_ops(cfg)
    names = {o.name for o in ops}
    assert not names & {"silu", "neg", "pow", "rsqrt", "clone"}  # no rotate-half, composite norm or k/v repeat
    count = lambda name: sum(o.count for o in ops if o.name == name)  # noqa: E731
    assert count("fused_rope") == 2 * 4 and count("fused_rope_backward") == 2 * 4  # q and k, every layer
    assert count("_fused_rms_norm") == 2 * 4 + 1
    # by hand, bytes of one layer's SwiGLU kernel: forward reads gate and up (2 x 2048 x 11008) and writes their
    # product (2048 x 11008), 2 bytes each = 135,266,304 B; backward reads the product's gradient and both inputs,
    # writes both gradients: 5 x 2048 x 11008 x 2 = 225,443,840 B
    assert sum(o.bytes * o.count for o in ops if o.name == "fused_swiglu") == 4 * 135_266_304
    assert sum(o.bytes * o.count for o in ops if o.name == "fused_swiglu_backward") == 4 * 225_443_840
    # the same matmul FLOPs as the unfused layer: one fc1 of 2f outputs is the gate and up projections together
    flops = lambda c: sum(o.flops * o.count for o in micro_batch_ops(c) if o.cost_class.value == "matmul")  # noqa: E731
    assert flops(cfg) == flops(cfg.replace(model=preset("llama-2-7b", layers=4, kv_heads=8, impl="hf",
                                                        attention="sdpa", dropout=0.0)))
