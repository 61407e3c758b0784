"""The calculator against independent references: hand counts, the paper, published parameter counts,
FlopCounterMode, and the live tensors of a real training step."""
import subprocess
import sys

import pytest

from batchlab.config import Backend, Precision, RunConfig, preset
from batchlab.formula import estimate
from batchlab.formula import activations as act
from batchlab.formula.params import count
from batchlab.formula.timing import ring_allreduce_seconds


def test_importing_the_calculator_does_not_import_torch():
    code = ("import sys, batchlab, batchlab.formula, batchlab.formula.vary, batchlab.formula.explain, batchlab.host,"
            "batchlab.calibrate;"
            "from batchlab.formula import estimate; from batchlab.config import RunConfig; estimate(RunConfig());"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name, published", [
    ("gpt2", 124_439_808),  # Hugging Face gpt2 num_parameters()
    ("llama-2-7b", 6_738_415_616),  # Hugging Face meta-llama/Llama-2-7b-hf
    ("llama-3-8b", 8_030_261_248),  # Hugging Face meta-llama/Meta-Llama-3-8B
])
def test_parameter_counts_match_published(name, published):
    assert count(preset(name)).total == published


def test_megatron_layer_reproduces_korthikanti():
    s, b, h, a = 2048, 1, 12288, 96
    # Table 2 of Korthikanti et al. 2022, sbh(34 + 5as/h), by hand at GPT-3 175B's layer (s 2048, b 1, h 12288,
    # a 96): sbh = 25,165,824; 34sbh = 855,638,016; 5as/h = 80, so 5as^2b = 80 sbh = 2,013,265,920;
    # total 114 sbh = 2,868,903,936 bytes
    terms = act.korthikanti_terms(s, b, h, a)
    assert sum(terms.values()) == 2_868_903_936
    assert act.korthikanti_layer_bytes(s, b, h, a) == 2_868_903_936
    assert act.korthikanti_layer_bytes(s, b, h, a, selective=True) == 855_638_016
    # our 16-bit eager layer with 1-byte masks keeps exactly the paper's tensors, plus LayerNorm's
    # statistics (2 x 2 fp32 per token: 2048 x 16 = 32,768) and the causal mask (s x s bool: 4,194,304)
    m = preset("tiny", layers=1, hidden=h, heads=a, vocab=8, dropout=0.1, attention="eager", max_positions=s)
    ours = act.layer_activations(m, s, b, Precision.BF16, Backend.CUDA)
    assert ours.total == 2_868_903_936 + 32_768 + 4_194_304
    # selective recompute of the attention core leaves 34sbh (+ the same statistics)
    assert ours.total - ours.scores == 855_638_016 + 32_768


def test_sdpa_removes_the_s_squared_term():
    m = preset("gpt2")
    assert act.layer_activations(m, 1024, 1, Precision.BF16_MIXED, Backend.CUDA).scores == 0
    eager = act.layer_activations(preset("gpt2", attention="eager"), 1024, 1, Precision.BF16_MIXED, Backend.CUDA)
    assert eager.scores > 0


def test_six_n_rule_and_recompute_flops():
    cfg = RunConfig(model=preset("llama-2-7b"), seq=4096, micro_batch=1, device="h100-sxm", precision="bf16-mixed")
    e = estimate(cfg)
    m = cfg.model
    # by hand: N = 6,738,415,616 published - 2 x 32,000 x 4,096 embedding/head tables + 131,072,000 head matmul
    #            = 6,607,343,616;  6N = 39,644,061,696;  12·L·h·s = 12 x 32 x 4096 x 4096 = 6,442,450,944
    assert e.flops.model_flops_per_token == 39_644_061_696 + 6_442_450_944
    full = estimate(cfg.replace(ac="full")).flops
    # Korthikanti et al.: full recompute = one more forward of every layer (8N + 16Lhs vs 6N + 12Lhs for
    # the layers' share), less the MLP output matmul that early-stopping recompute never re-runs
    # per layer: 2 x 202,383,360 weights (4h^2 + 3·h·11008) + 4·h·s (67,108,864) - 2·h·f (90,177,536)
    assert count(m).per_layer == 202_383_360
    assert full.recompute_flops_per_token == 32 * (404_766_720 + 67_108_864 - 90_177_536)
    assert full.hardware_flops_per_update > e.flops.hardware_flops_per_update == e.flops.model_flops_per_update


def test_ring_allreduce():
    assert ring_allreduce_seconds(1e9, 1, 1e9) == 0
    # ring all-reduce moves 2(n-1)/n of the buffer per rank (Patarasuk & Yuan 2009): by hand, 1 GB over 8 ranks
    # at 100 GB/s is 2 x 7/8 x 10 ms = 17.5 ms
    assert ring_allreduce_seconds(1e9, 8, 100e9) == pytest.approx(0.0175)


def test_memory_breakdown_adds_up_and_zero_shards():
    cfg = RunConfig(model=preset("llama-2-7b"), seq=4096, micro_batch=1, dp=8, device="h100-sxm",
                    precision="bf16-mixed")
    m0 = estimate(cfg).memory
    n = 6_738_415_616  # Hugging Face meta-llama/Llama-2-7b-hf num_parameters(), not the formula's own count
    assert (m0.parameters_bytes, m0.master_bytes, m0.gradients_bytes, m0.optimizer_bytes) == (2 * n, 4 * n, 4 * n, 8 * n)
    # ZeRO's mixed precision (2 + 2 + 12 bytes per parameter): 16-bit weights and grads, fp32 master + Adam
    # sharded from stage 1, grads from stage 2, weights from stage 3
    m1 = estimate(cfg.replace(zero=1)).memory
    assert (m1.parameters_bytes, m1.gradients_bytes, m1.master_bytes, m1.optimizer_bytes) == \
        (2 * n, 2 * n, 4 * n // 8, 8 * n // 8)
    # ZeRO-3 runs on FSDP2 with MixedPrecisionPolicy: the fp32 parameter shards are the master copy, fp32
    # gradient shards, 16-bit copies only while gathered (none resident); still 16 bytes per parameter / 8
    m3 = estimate(cfg.replace(zero=3)).memory
    assert (m3.parameters_bytes, m3.gradients_bytes, m3.master_bytes) == (0, 4 * n // 8, 4 * n // 8)
    assert m0.peak_bytes == m0.peak_tensor_bytes + m0.margin_bytes
    assert sum(m0.activations_per_layer_bytes) < m0.activations_bytes
    assert not m0.fits and m1.peak_bytes < m0.peak_bytes


def test_accumulation_keeps_activations_and_changes_time():
    a = estimate(RunConfig(micro_batch=4, accum=1))
    b = estimate(RunConfig(micro_batch=4, accum=4))
    assert a.memory.activations_bytes == b.memory.activations_bytes
    # four micro-batches' work, plus adding each later micro-batch's gradients into .grad (a few percent here)
    assert 4 * a.time.compute_seconds < b.time.compute_seconds < 4.2 * a.time.compute_seconds


def narayanan_flops(cfg: RunConfig) -> float:
    """Model FLOPs of one update without recompute: 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) for B sequences
    (Narayanan et al. 2021, eq. 3; matmuls only, so the formula's count sits slightly above it)."""
    m, s = cfg.model, cfg.seq
    return 72 * cfg.global_batch * s * m.layers * m.hidden**2 * (1 + s / (6 * m.hidden) + m.vocab / (12 * m.layers * m.hidden))


def test_vary_micro_batch_at_a_kept_global_batch_rows_by_hand():
    from batchlab.formula.vary import vary

    rows = vary(RunConfig(micro_batch=1, accum=8), "micro_batch", ["1", "2", "4"])
    # global batch 8 kept: accum = 8 / micro-batch
    assert [(r.config.micro_batch, r.config.accum, r.config.global_batch) for r in rows] == [(1, 8, 8), (2, 4, 8), (4, 2, 8)]
    for r in rows:  # same tokens per update, so the same FLOPs: the paper's count within 1%
        assert r.estimate.flops.hardware_flops_per_update == pytest.approx(narayanan_flops(r.config), rel=0.01)
    assert [r.directions["hardware FLOPs/update"] for r in rows] == ["same", "same", "same"]
    # one micro-batch's activations are live at a time: they grow with the micro-batch, not with accum
    assert [r.directions["activations"] for r in rows] == ["same", "up", "up"]
    assert rows[2].estimate.memory.activations_bytes > rows[1].estimate.memory.activations_bytes


def test_vary_accum_at_a_kept_micro_batch_rows_by_hand():
    from batchlab.config import Keep
    from batchlab.formula.vary import vary

    rows = vary(RunConfig(micro_batch=2, accum=1), "accum", ["1", "2", "4"], Keep.ACCUM)
    assert [(r.config.micro_batch, r.config.accum, r.config.global_batch) for r in rows] == [(2, 1, 2), (2, 2, 4), (2, 4, 8)]
    flops = [r.estimate.flops.hardware_flops_per_update for r in rows]
    assert flops[1] == 2 * flops[0] and flops[2] == 4 * flops[0]  # FLOPs per update scale with the sequences
    assert flops[2] == pytest.approx(narayanan_flops(rows[2].config), rel=0.01)
    # accumulation does not keep several micro-batches' activations at once
    assert len({r.estimate.memory.activations_bytes for r in rows}) == 1
    assert [r.directions["activations"] for r in rows] == ["same", "same", "same"]
    assert [r.directions["update time"] for r in rows] == ["same", "up", "up"]


def test_vary_keeps_an_impossible_row_with_why_and_what_would_make_it_possible():
    from batchlab.config import ConfigError
    from batchlab.formula.vary import vary

    rows = vary(RunConfig(micro_batch=2, accum=4), "dp", ["1", "2", "4", "8"])  # global batch 8 kept
    assert [r.possible for r in rows] == [True, True, True, False]
    assert [r.config.accum for r in rows[:3]] == [4, 2, 1]
    bad = rows[3]
    # 8 sequences over 8 ranks of micro-batch 2: 16 per step; --keep accum gives 2 x 4 x 8 = 64
    assert "global batch 8" in bad.why and "16" in bad.why
    assert "--keep accum (global batch 64)" in bad.fix and "--global-batch 16" in bad.fix
    assert bad.to_dict() == {"value": "8", "possible": False, "why": bad.why, "fix": bad.fix}
    # the suggested global batch makes every row possible: lcm of accum x DP over 32 x 8, 64 x 8 = 512
    base = RunConfig(micro_batch=2, dp=8)
    with pytest.raises(ConfigError, match="--global-batch 512"):
        vary(base, "accum", ["32", "64"])
    ok = vary(base.with_global_batch(512), "accum", ["32", "64"])
    assert [(r.config.micro_batch, r.config.accum) for r in ok] == [(2, 32), (1, 64)]


def test_vary_arrows_use_the_compare_same_band():
    from batchlab.experiment.predict import FORMULA_SAME_TOLERANCE, direction_of
    from batchlab.formula.vary import direction

    # a 0.7% change is "same" in both; a 2% one is a direction in both
    for b in (1.007, 0.993, 1.02, 0.98):
        assert direction(1.0, b) == direction_of(b, FORMULA_SAME_TOLERANCE).value
    assert direction(1.0, 1.007) == "same"


# -- the formula against the live tensors of a real step (torch from here on)
# every policy at (seq 64, micro-batch 1) and (seq 128, micro-batch 4 with accum 2): every term is linear in the
# micro-batch and the s^2 terms move with seq; the full seq x micro-batch x policy grid: benchmarks/accuracy.py
GRID = [(seq, mb, ac) for seq, mb in ((64, 1), (128, 4)) for ac in ("none", "full", "every:2", "selective")]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "small"])
def test_formula_matches_a_real_step_within_3_percent(model):
    from batchlab.measure.harness import Trainer
    from batchlab.measure.memory import track_update

    grid = GRID if model == "tiny" else [(64, 2, ac) for ac in ("none", "full", "selective")]
    worst = []
    for seq, mb, ac in grid:
        cfg = RunConfig(model=preset(model), seq=seq, micro_batch=mb, ac=ac, accum=2 if mb == 4 else 1)
        measured = track_update(Trainer(cfg))
        f = estimate(cfg).memory
        act_err = f.activations_bytes / measured.activations_bytes - 1
        peak_err = f.peak_tensor_bytes / measured.peak_bytes - 1
        worst.append((abs(act_err), abs(peak_err), seq, mb, ac))
        assert abs(act_err) <= 0.03, (seq, mb, ac, act_err)
        assert abs(peak_err) <= 0.03, (seq, mb, ac, peak_err)
    assert max(w[0] for w in worst) < 0.01  # activations are counted tensor by tensor


@pytest.mark.parametrize("ac", ["none", "full"])
def test_flops_match_flop_counter_on_the_built_in_model(ac):
    """FlopCounterMode counts matmuls of one real update; the formula's 6N + 12Lhs (+ recompute) must agree
    up to what it leaves out on purpose (biases, norms, element-wise ops: < 2% here)."""
    from torch.utils.flop_counter import FlopCounterMode

    from batchlab.measure.harness import Trainer

    cfg = RunConfig(model=preset("tiny", dropout=0.0), seq=128, micro_batch=2, ac=ac)
    trainer = Trainer(cfg)
    batches = trainer.batches()
    with FlopCounterMode(display=False) as counter:
        trainer.gradients(batches)
    counted = counter.get_total_flops()
    predicted = estimate(cfg).flops.hardware_flops_per_update
    assert counted == pytest.approx(predicted, rel=0.02)


def test_per_op_overhead_makes_larger_micro_batches_faster_at_a_fixed_global_batch():
    # a dispatch-bound step (1 ms per op): the time ratio is the ratio of ops run, counted here on the real code
    from batchlab.measure.harness import Trainer
    from batchlab.trace.ops import record_update

    a = RunConfig(seq=16, micro_batch=1, accum=8).replace(op_overhead_seconds=1e-3)
    b = a.replace(micro_batch=2, accum=4)
    ta, tb = estimate(a).time, estimate(b).time
    counted = []
    for cfg in (a, b):
        trainer = Trainer(cfg)
        trainer.update()
        counted.append(sum(op.count for op in record_update(trainer)))
    assert tb.update_seconds < ta.update_seconds
    assert tb.update_seconds / ta.update_seconds == pytest.approx(counted[1] / counted[0], rel=0.03)
    # about the same ops per micro-batch either way (a batch of one skips a few copies; later micro-batches
    # add their gradients into .grad), so the dispatch per micro-batch barely moves
    assert ta.overhead_seconds_per_micro_batch == pytest.approx(tb.overhead_seconds_per_micro_batch, rel=0.1)
    nil = estimate(a.replace(op_overhead_seconds=0.0)).time
    assert nil.overhead_seconds_per_micro_batch == 0


@pytest.mark.parametrize("kw", [dict(), dict(micro_batch=1, accum=4), dict(ac="full")])
def test_the_breakdown_at_the_peak_adds_up_and_matches_the_live_tensors(kw):
    from batchlab.measure.harness import Trainer
    from batchlab.measure.memory import track_update

    cfg = RunConfig(seq=64, **kw)
    f = estimate(cfg).memory
    assert sum(f.at_peak.values()) == f.peak_tensor_bytes
    measured = track_update(Trainer(cfg))
    assert f.peak_phase == measured.peak_phase
    for part in ("parameters", "optimizer", "data"):  # exact by construction of both
        assert f.at_peak[part] == measured.breakdown[part], part
    assert f.at_peak["activations"] == pytest.approx(measured.breakdown["activations"], rel=0.02)
    # the tracker files a recomputed layer, and a weight gradient not yet accumulated, under temporaries
    moving = f.at_peak["gradients"] + f.at_peak["recompute"] + f.at_peak["temporaries"]
    assert moving == pytest.approx(measured.breakdown["gradients"] + measured.breakdown["temporaries"], rel=0.1)


@pytest.mark.parametrize("source, tolerance", [("hf:gpt2", 0.05), ("hf:llama-2-7b", 0.05)])
def test_formula_counts_hugging_face_layers_from_their_own_tensors(source, tolerance):
    """HF GPT-2's Python gelu_new keeps five s x b x f tensors, HF Llama's separate q/k/v projections keep no
    fused qkv output and pass GQA to SDPA: the formula follows each implementation (the trace is exact)."""
    pytest.importorskip("transformers")
    from batchlab.measure.harness import Trainer
    from batchlab.measure.memory import track_update

    name = "gpt2" if "gpt2" in source else "llama-2-7b"
    extra = {} if name == "gpt2" else dict(ffn=344, kv_heads=2)  # GQA: transformers lets SDPA repeat k/v
    spec = preset(name, layers=2, hidden=128, heads=4, vocab=512, **extra)
    cfg = RunConfig(model=spec, model_source=source, seq=64, micro_batch=2)
    measured = track_update(Trainer(cfg)).activations_bytes
    assert estimate(cfg).memory.activations_bytes == pytest.approx(measured, rel=tolerance)
    builtin = estimate(cfg.replace(model_source="builtin", impl="batchlab")).memory.activations_bytes
    assert abs(estimate(cfg).memory.activations_bytes - measured) < abs(builtin - measured)


NO_TORCH = [
    ["estimate", "--model", "llama-2-7b", "--seq", "4096", "--micro-batch", "1", "--device", "h100", "--json"],
    ["estimate", "--vary", "micro_batch=1,2,4", "--global-batch", "8"],
    ["explain"],
    ["fit", "--model", "llama-2-7b", "--seq", "4096", "--global-batch", "512", "--dp", "8", "--device", "h100-sxm",
     "--precision", "bf16-mixed", "--zero", "1", "--json"],
]


@pytest.fixture(scope="module")
def without_torch() -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each of NO_TORCH, run as ``batchlab ...`` would run it, each in its own
    interpreter where torch cannot be imported: a command cannot pass on what an earlier one imported, and one
    crash fails only its own test; the four start at once, so their interpreter starts overlap."""
    procs = [subprocess.Popen([sys.executable, "-c",
                               "import sys; sys.modules['torch'] = None\n"  # any `import torch` raises ImportError
                               f"sys.argv = ['batchlab'] + {argv!r}\n"
                               "from batchlab.cli import main\nmain()"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv in NO_TORCH]
    results = []
    for proc in procs:  # each child has its own pipes: draining one after another blocks none of them for good
        stdout, stderr = proc.communicate()
        results.append((proc.returncode, stdout, stderr))
    return results


@pytest.mark.parametrize("i", range(len(NO_TORCH)), ids=[f"argv{i}" for i in range(len(NO_TORCH))])
def test_the_calculator_commands_run_where_torch_cannot_be_imported(without_torch, i):
    returncode, stdout, stderr = without_torch[i]
    assert returncode == 0, (NO_TORCH[i], stderr[-2000:])
    assert "global" in stdout


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed", "bf16"])
def test_formula_matches_a_real_step_in_16_bit(precision):
    """Autocast on CPU keeps softmax in 16 bits, caches every weight copy until the forward leaves autocast,
    and the copies a matmul saved are freed by that layer's backward: the peak follows all of it."""
    from batchlab.measure.harness import Trainer
    from batchlab.measure.memory import track_update

    # fp16 matmuls on CPU run ~10x slower than bf16 ones here (no fast kernel): half the micro-batch and the
    # sequence, the same terms (each is linear in b, in s or in s^2)
    half = 2 if precision == "fp16-mixed" else 1
    for mb, ac in ((8, "none"), (2, "none"), (8, "full"), (8, "selective"), (4, "every:2")):
        cfg = RunConfig(seq=64 // half, micro_batch=mb // half, ac=ac, precision=precision)
        measured = track_update(Trainer(cfg))
        f = estimate(cfg).memory
        assert f.peak_tensor_bytes == pytest.approx(measured.peak_bytes, rel=0.03), (mb, ac)
