"""Formula terms for compiled code: saved-tensor sizes factored into the model's dimensions (checked by hand), and
the terms' per-layer bytes at shapes other than the derivation's (checked against the partition itself in
tests/cli/test_compile_flag.py)."""
from fractions import Fraction

from batchlab.config import RunConfig, preset
from batchlab.formula import compiled, estimate


def test_a_saved_tensors_element_count_factors_into_the_models_dimensions():
    from batchlab.trace.compiled_terms import GQA_PRIMES, PRIMES, monomial

    b, s, k, g, d2, f2 = (GQA_PRIMES[n] for n in ("b", "s", "k", "g", "d", "f"))  # head dim 2·d2, MLP 2·f2
    # attention probabilities (b, heads, s, s) of a grouped-query model: b·k·g·s²
    assert monomial(b * k * g * s * s, GQA_PRIMES) == (Fraction(1), (1, 2, 1, 1, 0, 0))
    # the MLP's inner activation (b, s, 2·f2) is b·s·f
    assert monomial(b * s * 2 * f2, GQA_PRIMES) == (Fraction(1), (1, 1, 0, 0, 0, 1))
    # a fused q, k, v projection's output (b, s, 3h) without grouping, h = k·2·d2: 3·b·s·k·d
    b, s, k, d2 = (PRIMES[n] for n in ("b", "s", "k", "d"))
    assert monomial(b * s * 3 * k * 2 * d2) == (Fraction(3), (1, 1, 1, 0, 1, 0))
    assert monomial(b * s) == (Fraction(1), (1, 1, 0, 0, 0, 0))  # a norm's statistic (b, s, 1)
    # the CPU generator's state a checkpoint keeps (5056 bytes = 2^6·79): a constant, whatever the shape
    assert monomial(5056) == (Fraction(5056), (0,) * 6)


def test_compiled_terms_apply_where_derived_and_say_why_elsewhere():
    cfg = RunConfig(model=preset("tiny", layers=2), seq=64, micro_batch=4, compile="blocks")
    assert compiled.applies(cfg) and compiled.missing_note(cfg) is None
    assert "partition" in estimate(cfg).layer_terms
    assert not compiled.applies(cfg.replace(compile="none"))
    note = compiled.missing_note(cfg.replace(ac="selective-attn"))
    assert note is not None and "selective-attn" in note
    # a per-layer plan of derived policies is covered: each layer's own term, counted by hand (fp32, 4 bytes; masks
    # 1 byte) from the tensors the partition of this block saves (aot_eager's min-cut, read off its forward graph)
    b, s, h, a, f = 4, 64, 128, 4, 512
    full = b * s * h * 4 + 3 * 5056  # the block's input; 3 dropouts' CPU generator states (5056 bytes each)
    none = (b * s * h * 4  # the block's input
            + 2 * 2 * b * s * 4  # two layer norms' mean and rstd
            + 2 * b * s * h * 4  # the two norms' outputs
            + 3 * b * s * h * 4  # q, k, v
            + 2 * b * a * s * s * 4  # the scores and the probabilities after dropout
            + s * s  # the causal mask (bool)
            + 2 * b * a * s * 4  # the softmax's max and sum
            + b * a * s * s  # the attention dropout's mask
            + 2 * b * s * h * 4  # the attention's output and its projection
            + 2 * b * s * h  # the two residual dropouts' masks
            + 2 * b * s * f * 4)  # the MLP's up projection and its GELU
    mixed = cfg.replace(ac="plan:full,none")
    assert compiled.kept_per_layer(mixed) == ((full, none), none) == ((146_240, 2_768_896), 2_768_896)


def test_compiled_layers_keep_their_input_under_full_recompute():
    # a fully recomputed block saves its input (b, s, h); transformers' GPT-2 calls dropout (p = 0 here) inside the
    # checkpoint, which keeps the CPU generator's state for the recompute
    import torch

    state = torch.get_rng_state().numel()
    for src, base, extra in (("builtin", "tiny", 0), ("hf:gpt2", "gpt2", state)):
        spec = preset(base, layers=2, hidden=96, heads=3, vocab=256, max_positions=256, dropout=0.0)
        cfg = RunConfig(model=spec, model_source=src, seq=40, micro_batch=3, ac="full", compile="blocks")
        assert compiled.layer_bytes(cfg, "full") == 40 * 3 * 96 * 4 + extra


def test_another_architectures_code_gets_no_compiled_terms_of_gpt2_or_llama():
    # a Hugging Face config of another model type is built with its own class: the table's entries do not describe it
    spec = preset("llama-2-7b", layers=2, hidden=128, heads=4, vocab=256, max_positions=256, family="mistral")
    cfg = RunConfig(model=spec, model_source="hf:llama-2-7b", seq=32, micro_batch=2, compile="blocks")
    assert not compiled.applies(cfg) and "mistral" in compiled.missing_note(cfg)


def test_a_whole_model_graph_reads_the_block_terms_under_recompute_but_not_under_a_budget():
    cfg = RunConfig(model=preset("tiny", layers=2), seq=64, micro_batch=4, compile="model")
    assert compiled.applies(cfg)
    full = cfg.replace(ac="full")
    assert compiled.applies(full) and compiled.working_per_layer(full) is not None
    budget = cfg.replace(ac="budget:0.3")
    assert not compiled.applies(budget) and "knapsack" in compiled.missing_note(budget)


def test_a_whole_model_graph_partitions_its_own_loss_as_a_compiled_one():
    """The built-in GPT computes its loss in forward, so --compile model traces it into the graph: the partition
    keeps the logits and two fp32 statistics per token (64 x 4 tokens, vocab 512, fp32: by hand)."""
    from batchlab.formula.loss import loss_path

    cfg = RunConfig(model=preset("tiny", layers=2), seq=64, micro_batch=4, compile="model")
    assert loss_path(cfg).kept == 64 * 4 * 512 * 4 + 2 * 64 * 4 * 4
    assert loss_path(cfg.replace(compile="blocks")).kept == 64 * 4 * 512 * 4  # eager: the fp32 log-softmax
    # a tied head's gradient waits for the graph's end: its inputs, logits' gradient and final norm output, held (one
    # layer: no whole-model stretches are derived for it, formula/compiled.py whole_model_highs)
    one = RunConfig(model=preset("tiny", layers=1), seq=64, micro_batch=4, compile="model", ac="full")
    assert compiled.held_to_the_end(one) == 64 * 4 * 512 * 4 + 64 * 4 * 128 * 4


def test_a_width_that_is_a_sum_of_dimensions_is_linear_in_g_from_two_derivations():
    from batchlab.trace.compiled_terms import CHECK_K, GQA_PRIMES, SECOND_G, evaluate, linear_in_g, primes_of

    b, s, k, g, d2 = (GQA_PRIMES[n] for n in ("b", "s", "k", "g", "d"))
    at, at2 = primes_of(True), primes_of(True, g=SECOND_G)
    fused = lambda g: b * s * k * 2 * d2 * (g + 2)  # noqa: E731 - (b, s, h + 2·kv), h + 2·kv = k·d·(g + 2)
    terms = linear_in_g(fused(g), fused(SECOND_G), at, at2)
    assert terms == {(1, 1, 1, 1, 1, 0): 1, (1, 1, 1, 0, 1, 0): 2}  # b·s·k·g·d + 2·b·s·k·d
    assert evaluate(terms, primes_of(True, CHECK_K)) == b * s * CHECK_K * 2 * d2 * (g + 2)
    # a product stays one monomial (the probabilities, b·k·g·s²); a generator's state stays a constant
    assert linear_in_g(b * k * g * s * s, b * k * SECOND_G * s * s, at, at2) == {(1, 2, 1, 1, 0, 0): 1}
    assert linear_in_g(5056, 5056, at, at2) == {(0,) * 6: 5056}
    # the fused projection's weight, (h + 2·kv) x h, cast to 16 bits: 2 bytes x k²·d²·g·(g + 2)
    weight = lambda g: 2 * (k * 2 * d2) ** 2 * g * (g + 2)  # noqa: E731
    assert linear_in_g(weight(g), weight(SECOND_G), at, at2) == {(0, 0, 2, 2, 2, 0): 2, (0, 0, 2, 1, 2, 0): 4}


def test_a_width_that_is_a_sum_fails_the_check_at_another_shape_and_a_product_passes():
    from batchlab.trace.compiled_terms import CHECK_K, GQA_PRIMES, evaluate, monomial, primes_of

    b, s, k, g, d2 = (GQA_PRIMES[n] for n in ("b", "s", "k", "g", "d"))
    at = primes_of(True, CHECK_K)
    fused = monomial(b * s * k * 2 * d2 * (g + 2), GQA_PRIMES)  # (b, s, h + 2·kv), h + 2·kv = k·d·(g + 2)
    assert evaluate({fused[1]: fused[0]}, at) != b * s * CHECK_K * 2 * d2 * (g + 2)
    probs = monomial(b * k * g * s * s, GQA_PRIMES)  # (b, heads, s, s)
    assert evaluate({probs[1]: probs[0]}, at) == b * CHECK_K * g * s * s


def test_the_backward_high_points_are_the_storages_live_at_each_local_maximum():
    from batchlab.trace.compiled_working import _Window, pruned

    w = _Window()
    w.active = True  # as inside one compiled backward call
    for key, n in ((1, 100), (2, 50)):
        w.added(key, n, "temporaries")
        w.op_done(None, ())
    w.freed(1)  # falls from 150: that was a high point
    for key, n in ((3, 30), (4, 200)):
        w.added(key, n, "temporaries")
        w.op_done(None, ())
    w.added(5, 7, "parameters")  # a weight is resident, not the block's
    w.freed(2)
    w.end()
    assert w.highs == [[100, 50], [50, 30, 200]]
    # a high point no larger than another in every term is dropped; two that cross at some shape both stay
    x, y = (1, 0, 0, 0, 0, 0), (0, 1, 0, 0, 0, 0)
    assert pruned([{x: 1}, {x: 2}, {x: 1, y: 1}]) == [{x: 2}, {x: 1, y: 1}]


def test_compiled_blocks_backward_lands_on_measured_peaks_under_recompute():
    """The formula (no trace) against real inductor runs on CPU (measure --compile blocks, the allocator's events,
    kept in benchmarks/compiled_measured.json): a recomputing block's compiled backward holds what inductor's plan
    realises, not the whole layer restored."""
    import json
    from pathlib import Path

    import pytest

    measured = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "compiled_measured.json").read_text())
    tiny = preset("tiny", layers=2)
    gqa = preset("tiny", layers=2, hidden=160, heads=4, kv_heads=2, vocab=512, attention="sdpa", dropout=0.0)
    wide = preset("tiny", layers=3, hidden=192, heads=6, vocab=640)
    for name, spec, (seq, mb), ac in (("GPT tiny, 2 layers", tiny, (128, 4), "selective-op"),
                                      ("GPT tiny, 2 layers", tiny, (128, 4), "full"),
                                      ("GPT, 2 layers, h 160, SDPA, GQA", gqa, (112, 3), "selective-op"),
                                      ("GPT, 3 layers, h 192, 6 heads", wide, (96, 3), "selective-op")):
        cfg = RunConfig(model=spec, seq=seq, micro_batch=mb, ac=ac, compile="blocks")
        assert compiled.working_per_layer(cfg) is not None
        peak = measured[f"{name} | {ac}"]["peak"]
        assert estimate(cfg).memory.peak_tensor_bytes == pytest.approx(peak, rel=0.01), (name, ac)


def test_a_whole_model_graph_lands_near_measured_peaks_and_its_budget_stays_a_bound():
    """--compile model against real inductor runs (benchmarks/compiled_measured.json): the block's compiled terms,
    the loss in the graph, the tied head's gradient deferred; under budget:F the eager terms bound the peak."""
    import json
    from pathlib import Path

    measured = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "compiled_measured.json").read_text())
    cfg = RunConfig(model=preset("tiny", layers=2), seq=128, micro_batch=4, compile="model")
    for ac, tol in (("none", 0.02), ("full", 0.05)):
        peak = measured[f"GPT tiny, 2 layers | {ac} | model"]["peak"]
        assert abs(estimate(cfg.replace(ac=ac)).memory.peak_tensor_bytes / peak - 1) < tol, ac
    peak = measured["GPT tiny, 2 layers | budget:0.3 | model"]["peak"]
    assert estimate(cfg.replace(ac="budget:0.3")).memory.peak_tensor_bytes >= peak
