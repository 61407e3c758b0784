"""The formula's per-layer terms for compiled code (``--compile blocks|model``): what AOTAutograd's partition saves
for backward, per family, read off the partitioner's saved-tensor list (trace/compiled_terms.py, which writes
formula/compiled_table.py).  No torch.

Each term is a monomial in b (micro-batch), s (sequence), k (KV heads), g (query heads per KV head), d (head dim)
and f (MLP inner size), with h = g·k·d; its coefficient is bytes: e.g. for the built-in GPT in fp32 with dropout
and no AC, ``9·b·k·s²`` (attention probabilities 4 bytes, their dropout mask 1, the dropped probabilities 4) where
eager PyTorch keeps more.  A fused elementwise chain is saved as nothing: the partition recomputes it in backward.
A block's backward is read the same way, off inductor's plan of it (trace/compiled_working.py, which writes
formula/compiled_working_table.py): the storages its backward holds at each high point, as monomials.  A
whole-model graph's backward is read off inductor's plan of a whole model (trace/compiled_model_working.py, which
writes formula/compiled_model_working_table.py), layer by layer, with v (the vocabulary) among the symbols.
"""
from __future__ import annotations

from fractions import Fraction

from batchlab.config import Backend, CompileMode, ModelSpec, Precision, RunConfig
from batchlab.formula import checkpointing
from batchlab.formula.activations import Impl, implementation

# families whose code the harness runs in place of another's (config/standin.py STAND_IN); torchtitan's Llama has
# a table entry of its own (transformers' code compiled as torchtitan's compiles: trace/compiled_terms.py)
_RUNS_AS = {Impl.NANOGPT: Impl.BUILTIN}
# precisions whose blocks save the same bytes as one the table holds: fp16 autocast as bf16 autocast; FSDP2's bf16
# param_dtype computes every op in bf16 as a pure-bf16 model does (config/choices.py Precision.BF16_FSDP)
_SAME_BYTES = {Precision.FP16_MIXED: Precision.BF16_MIXED, Precision.BF16_FSDP: Precision.BF16}
# layer policies the table holds: --ac modes that apply one of them to every layer
POLICIES = ("none", "full", "selective", "selective-op")


def _table():
    from batchlab.formula import compiled_table  # generated; imported only when a compiled config asks

    return compiled_table


# Hugging Face model types whose code the table's hf-* entries trace ("": a preset's, built as GPT-2 or Llama)
_HF_TYPES = {Impl.HF_GPT2: ("", "gpt2"), Impl.HF_LLAMA: ("", "llama")}


def _key(cfg: RunConfig, policy: str) -> str:
    m = cfg.model
    impl = implementation(cfg.model_kind, m)
    family = _RUNS_AS.get(impl, impl).value
    if impl in _HF_TYPES and m.family not in _HF_TYPES[impl]:
        family = m.family  # another architecture's code (mistral, gemma, ...): no entry of its own yet
    attention = "gqa" if m.kv_heads != m.heads else "mha"
    dropout = "dropout" if m.dropout > 0 else "no-dropout"
    precision = _SAME_BYTES.get(cfg.precision, cfg.precision).value
    return f"{family}|{attention}|{dropout}|{m.attention.value}|{policy}|{precision}"


def _policies(cfg: RunConfig) -> tuple[str, ...] | None:
    """Each layer's policy as the table names it, or None where a layer's --ac mode is not one of them."""
    names = tuple(str(mode) for mode in cfg.ac.layer_modes(cfg.model.layers))
    return names if all(n in POLICIES for n in names) else None


UNCOMPILED = "the block does not compile into one graph (a graph break around it: it runs eagerly)"


def runs_eager(cfg: RunConfig) -> bool:
    """cfg's blocks do not compile: the derivation of its table entries met a graph break around the block (dynamo
    refused its checkpointed code), so inductor never sees it and its ops run as eager ones."""
    if cfg.compile is CompileMode.NONE or (names := _policies(cfg)) is None:
        return False
    terms = _table().TERMS
    return any(terms.get(_key(cfg, p)) == UNCOMPILED for p in set(names))


def runs_compiled(cfg: RunConfig) -> bool:
    """cfg's blocks run as inductor's graphs: compiled, and not broken around by dynamo (``runs_eager``)."""
    return cfg.compile is not CompileMode.NONE and not runs_eager(cfg)


def applies(cfg: RunConfig) -> bool:
    """cfg is compiled and the table holds compiled terms for every layer's policy (and for no AC: the whole
    layer, which a recomputing layer restores in backward)."""
    if cfg.compile is CompileMode.NONE:
        return False
    names = _policies(cfg)
    if names is None or not _same_partition(cfg):
        return False
    terms = _table().TERMS
    return all(isinstance(terms.get(_key(cfg, p)), tuple) for p in {*names, "none"})


def _same_partition(cfg: RunConfig) -> bool:
    """The terms are one block's partition.  A whole-model graph (--compile model) partitions each block alike: a
    checkpointed block's forward saves its input, and the backward graph recomputes it fused with its gradient
    kernels, as a block's own graph does (traced on the built-in GPT).  Under budget:F its knapsack weighs every
    block's tensors together, and at 0 it recomputes the whole model from its inputs: not one block's choice."""
    if cfg.ac.budget is not None:
        return cfg.compile is CompileMode.BLOCKS
    return True


def dims(m: ModelSpec, s: int, b: int) -> dict[str, Fraction]:
    """The symbols' values for a model at (b, s)."""
    k = m.kv_heads
    d = Fraction(m.hidden, m.heads)
    return dict(b=Fraction(b), s=Fraction(s), k=Fraction(k), g=Fraction(m.heads, k), d=d, f=Fraction(m.ffn))


def scales(exponents: tuple[int, ...]) -> bool:
    """Whether a term of a compiled block's saved tensors is the block's own: one with a symbol in it.  The constant
    term is a block graph's generator state (a seed per dropout site), which a whole-model graph replaces by its one
    seeds buffer: the seed-term rule, for the formula and the trace alike."""
    return any(exponents)


def layer_bytes(cfg: RunConfig, policy: str, s: int | None = None, b: int | None = None) -> int:
    """Bytes one compiled block keeps for backward under ``policy`` at (b, s) (default: cfg's): the sum of its
    saved tensors' monomials.  In a whole-model graph whose working set is derived (``whole_model_highs``) the
    constant term, a block graph's generator state, is not the block's: that graph holds one seeds buffer."""
    values = dims(cfg.model, cfg.seq if s is None else s, cfg.micro_batch if b is None else b)
    terms = _table().TERMS[_key(cfg, policy)]
    if whole_model_highs(cfg) is not None:
        terms = tuple(t for t in terms if scales(t[0]))
    return round(_evaluate(terms, values))


def kept_per_layer(cfg: RunConfig) -> tuple[tuple[int, ...], int]:
    """(each layer's kept bytes under its policy, a whole layer's: AC none)."""
    names = _policies(cfg)
    assert names is not None
    each = {p: layer_bytes(cfg, p) for p in set(names) | {"none"}}
    if cfg.ac.budget is not None:
        return (budget_bytes(cfg, each["none"]),) * cfg.model.layers, each["none"]
    return tuple(each[p] for p in names), each["none"]


def _working_table():
    from batchlab.formula import compiled_working_table  # generated; imported only when a compiled config asks

    return compiled_working_table


def working_per_layer(cfg: RunConfig) -> tuple[int, ...] | None:
    """Each layer's compiled backward at its high point (what it is called with, its saved tensors and incoming
    gradient, and every buffer inductor's plan allocates in it: recomputed activations, activation and weight
    gradients): the largest of its derived high points at cfg's shape (trace/compiled_working.py), or None where a
    layer's policy has none derived.  A whole-model graph runs each block's backward as the block's graph does, and
    holds the head's inputs beside it (``held_to_the_end``, added by formula/memory.py); under budget:F the knapsack's
    choice is not the policy's (None).  They are inductor's CPU plan: on a GPU, Triton's kernels fuse and reuse
    buffers otherwise (None until derived there)."""
    names = _policies(cfg)
    if names is None or cfg.ac.budget is not None or not applies(cfg) \
            or cfg.device_spec.backend is not Backend.CPU:
        return None
    whole = _whole_model_working(cfg)
    if whole is not None:
        return whole
    try:
        highs = _working_table().HIGHS
    except ImportError:
        return None
    found = {p: highs.get(_key(cfg, p)) for p in set(names)}
    if not all(isinstance(h, tuple) for h in found.values()):
        return None
    values = dims(cfg.model, cfg.seq, cfg.micro_batch)
    each = {p: max(round(_evaluate(h, values)) for h in found[p]) for p in found}
    return tuple(each[p] for p in names)


def _model_table():
    from batchlab.formula import compiled_model_working_table  # generated; imported only when a compiled config asks

    return compiled_model_working_table


def whole_model_highs(cfg: RunConfig) -> dict | None:
    """The high points of a whole-model graph's backward per topological order and stretch (``stretch``), read
    off inductor's plan of a whole model (trace/compiled_model_working.py), or None: not --compile model, a layer
    policy mix or budget:F (derived with one policy in every layer), one layer (its stretch is the graph's whole
    backward, the embedding's and the head's together), a GPU (inductor's CPU plan), or no entry derived.  Each
    holds what that layer's stretch holds beyond the walk's own parts: its working set, the next layer's recompute
    inductor starts in it, the head's tensors and gradient, the graph-level masks; in a model that compiles into
    several graphs (the model's, then the loss's) the whole sequence of their backward graphs.  Under ``"bound"``,
    the orders whose stretches keep two schedules' high points (inductor's moved with the width)."""
    names = _policies(cfg)
    if cfg.compile is not CompileMode.MODEL or names is None or len(set(names)) != 1 or cfg.ac.budget is not None \
            or cfg.model.layers < 2 or cfg.device_spec.backend is not Backend.CPU:
        return None
    try:
        found = _model_table().HIGHS.get(_key(cfg, names[0]) + ("|tied" if cfg.model.tied_embeddings else "|untied"))
    except ImportError:
        return None
    return found if isinstance(found, dict) else None


def stretch(layer: int, layers: int) -> str:
    """Which derived stretch of a whole-model backward a layer's is: in a model of three layers or more, by its
    place from the bottom, the lowest three each their own (the partition and inductor's schedule treat them
    apart: what their recompute starts early, what their forward saves) and every layer above alike (derived with
    five and three layers); a two-layer model's two stretches are their own (derived with two)."""
    if layers == 2:
        return own_stretch(layer, layers)
    return str(layer) if layer < 3 else "3+"


# models whose every layer's stretch is derived with that many layers where an entry has them (``own_stretch``);
# not four: at the derivation's prime sizes a four-layer model's top layer holds the logits-sized buffers and the
# MLP's at once, which at real sizes it does not (GPT-2, 4 layers, h 80, 72 x 2, against inductor's plan: own
# stretches +6.8% full / +7.8% selective-op, the deeper models' -0.8% / +1.9%)
OWN_LAYERS = (2, 3)


def own_stretch(layer: int, layers: int) -> str:
    """A layer's stretch in a model of ``layers`` derived with that many layers: a shallow model's layers are each
    near its top and its bottom at once (the head's tensors, the embedding's, the next layer's recompute), which a
    deeper model's stretch of the same place from the bottom does not hold alike."""
    return f"{layers}:{layer}"


def _whole_model_working(cfg: RunConfig) -> tuple[int, ...] | None:
    chosen = _whole_model_order(cfg)
    return None if chosen is None else chosen[1]


def _whole_model_order(cfg: RunConfig) -> tuple[str, tuple[int, ...]] | None:
    """Each layer's stretch at its high point in the topological order inductor keeps at cfg's shape: its
    reordering for peak memory tries a few orders and keeps the one whose peak, with the graph's real sizes, is
    lowest (torch/_inductor/memory.py ``reorder_for_peak_memory``), so the order whose walk peaks lowest here (each
    layer's stretch, the layers below keeping theirs, the layers above holding their gradients) is taken, among the
    orders whose derivation passed its check (the table says why for the others)."""
    from batchlab.formula.ranks import share
    from batchlab.formula.states import model_states

    orders = whole_model_highs(cfg)
    if orders is None:
        return None
    m = cfg.model
    values = dict(dims(m, cfg.seq, cfg.micro_batch), v=Fraction(m.vocab))
    symbols = _model_table().SYMBOLS
    kept = layer_bytes(cfg, _policies(cfg)[0])
    rank = share(cfg, 0)  # a layer's gradient as the memory walk this imitates counts it (formula/memory.py)
    grad = rank.per_layer * model_states(cfg, rank).gradients // max(rank.params, 1)

    def working(stretches) -> tuple[int, ...]:
        each = {name: max(round(_evaluate(h, values, symbols)) for h in hs) for name, hs in stretches.items()}
        own = m.layers in OWN_LAYERS and all(own_stretch(i, m.layers) in each for i in range(m.layers))
        return tuple(each[own_stretch(i, m.layers) if own else stretch(i, m.layers)] for i in range(m.layers))

    def peak(ws: tuple[int, ...]) -> int:
        return max(w + i * kept + (m.layers - 1 - i) * grad for i, w in enumerate(ws))

    return min(((name, working(s)) for name, s in orders.items() if isinstance(s, dict)), key=lambda o: peak(o[1]))


def defers_head_gradient(cfg: RunConfig) -> bool:
    """A whole-model graph with its loss inside computes the LM head's weight gradient at its end, with the other
    graph outputs (traced on the built-in GPT and GPT-2, tied heads, where the embedding's part is added there):
    until then it does not exist, and the head's inputs stay held.  Where the whole graph's working set is derived
    (``whole_model_highs``) the head's gradient is in it, wherever inductor makes it."""
    from batchlab.formula.loss import in_graph

    return in_graph(cfg) or whole_model_highs(cfg) is not None


def held_to_the_end(cfg: RunConfig) -> int:
    """What a whole-model graph holds through its blocks' backward for the deferred head gradient
    (``defers_head_gradient``): the logits' gradient and the final norm's output, the matmul's two inputs (in the
    derived whole-model working set where there is one)."""
    if not defers_head_gradient(cfg) or whole_model_highs(cfg) is not None:
        return 0
    from batchlab.formula.activations import Widths
    from batchlab.formula.loss import loss_path

    w = Widths.of(cfg.precision, cfg.device_spec.backend)
    return loss_path(cfg).backward_transient + cfg.seq * cfg.micro_batch * cfg.model.hidden * w.e


def _evaluate(terms, values: dict[str, Fraction], symbols: tuple[str, ...] | None = None) -> Fraction:
    """A sum of monomials, each (exponents over ``symbols``, default the table's SYMBOLS, numerator, denominator), at
    ``values``."""
    total = Fraction(0)
    for exps, num, den in terms:
        term = Fraction(num, den)
        for name, e in zip(symbols or _table().SYMBOLS, exps):
            term *= values[name] ** e
        total += term
    return total


def budget_bytes(cfg: RunConfig, default: int) -> int:
    """What one block keeps under budget:F, F·(default − inputs) above its inputs.  The knob's definition
    (torch/_functorch/partitioners.py ``choose_saved_values_set``): at 0 the partition saves the graph's inputs,
    at 1 the default min-cut's set, in between a 0-1 knapsack (``_optimize_runtime_with_given_memory``, values:
    each op's FLOPs) keeps (saved − inputs) / (default − inputs) within F.  Which ops it keeps follows their
    runtimes, so these bytes are the budget's line, an upper bound where the solver's set fits within it.  The
    parameters are in both ends (backward reads nearly every weight) and are taken as cancelling, which leaves the
    block's input as the inputs' activation bytes (formula/checkpointing.py)."""
    m = cfg.model
    impl = implementation(cfg.model_kind, m)
    inputs = checkpointing.block_input_bytes(m, cfg.seq, cfg.micro_batch, cfg.precision,
                                             cfg.device_spec.backend, impl)
    return round(inputs + Fraction(cfg.ac.budget) * (default - inputs))


def _bound(cfg: RunConfig) -> bool:
    """The order the formula keeps at cfg's shape is one whose stretches keep two schedules' high points (an entry's
    ``"bound"`` orders, trace/compiled_model_working.py ``checked``)."""
    chosen = _whole_model_order(cfg)
    return chosen is not None and chosen[0] in (whole_model_highs(cfg) or {}).get("bound", ())


def source(cfg: RunConfig) -> str:
    """Where the compiled layer terms come from, for estimate's output."""
    impl = implementation(cfg.model_kind, cfg.model)
    ran = _RUNS_AS.get(impl)
    return (f"formula terms for compiled code (--compile {cfg.compile}): the saved-tensor list of AOTAutograd's "
            f"min-cut partition of one {(ran or impl).value} block (inductor's settings, torch {_table().TORCH}, CPU "
            f"kernels), as monomials in b, s, heads, head dim, ffn (trace/compiled_terms.py)"
            + ("; each layer's stretch of the whole-model backward at its high points from inductor's plan of a whole "
               "model (trace/compiled_model_working.py)" + ("; inductor's schedule moved with the derivation's width, "
                                                           "so it is the larger schedule's, a bound"
                                                           if _bound(cfg) else "")
               if whole_model_highs(cfg) is not None else
               "; each block's backward at its high point from inductor's plan of it (trace/compiled_working.py)"
               if working_per_layer(cfg) is not None else "")
            + (f"; derived with CPU kernels and CPU autocast, not {cfg.device_spec.backend.value}'s: what its compiled "
               "block keeps can differ" if cfg.device_spec.backend is not Backend.CPU else "")
            + (f"; {impl.value} runs as {ran.value} here" if ran else "")
            + (f"; ac={cfg.ac}: each block keeps its input plus {cfg.ac.budget:g} of the rest of that partition's "
               "saved bytes, the knob's line on what is saved, not a bound on the peak (torch's knapsack picks the "
               "tensors by FLOPs)"
               if cfg.ac.budget is not None else "")
            + ("; torchtitan's Llama is transformers' code here, its checkpointed blocks compiled whole"
               if impl is Impl.TT_LLAMA else ""))


def missing_note(cfg: RunConfig) -> str | None:
    """Why a compiled config's layer terms are eager PyTorch's, or None where the compiled terms apply."""
    if cfg.compile is CompileMode.NONE or applies(cfg):
        return None
    names = _policies(cfg)
    if names is None:
        why = f"compiled terms are derived for AC {', '.join(POLICIES)}, not {cfg.ac}"
    elif not _same_partition(cfg):
        why = (f"they are a block's partition (--compile blocks); under ac={cfg.ac} a whole-model graph's knapsack "
               "weighs all blocks together")
    elif (reasons := [r for r in (_table().TERMS.get(_key(cfg, n)) for n in {*names, "none"}) if isinstance(r, str)]):
        why = reasons[0]  # the derivation's own words (trace/compiled_terms.py)
    else:
        why = f"no compiled terms derived for {_key(cfg, names[0]).replace('|', ', ')}"
    return (f"the formula's layer terms are eager PyTorch's here (--compile {cfg.compile}): {why}; estimate --trace "
            f"--compile {cfg.compile} traces the compiled graphs' partition")
