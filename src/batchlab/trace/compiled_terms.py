"""Derive the formula's per-layer terms for compiled code from AOTAutograd's partition (``formula/compiled.py``).

One block of each family is compiled with the trace's partition-only backend (trace/compiled.py) on fake tensors
at dimensions that are distinct primes in a real model's ratios (micro-batch 13, sequence 1021, KV heads 11, query
heads per KV head 17 or 1, head dim 2·23, MLP inner size 2·709 or 2·12037), and one forward runs: the partitioner's forward graph lists the tensors it
saves for backward.  Each saved tensor's element count then factors uniquely into those dimensions, e.g.
11·17·13·13 is b·a·s² (the attention probabilities), so the bytes it keeps at any shape are that monomial times
its element size -- read off the partition, nothing fitted.  (The partition is a min-cut over sizes: at
unreal ratios it may save other tensors, hence the real ones.)  Views are counted once, with the tensor they view;
a graph input without the batch dimension (a parameter, a buffer, rotary tables made once per forward) is not
the layer's.  What is left of a count after the dimensions are divided out is a small integer (3 for a fused
q, k, v projection); a count with another large prime factor (a generator's state) is a constant.  A grouped-query
block is derived once more, at 19 query heads per KV head: a width that is a sum of dimensions (the fused q, k, v
projection's h + 2·kv = k·d·(g + 2)) is linear in g, and its two sizes give its two monomials (``combined``).

    PYTHONPATH=src python -m batchlab.trace.compiled_terms [--missing]   # rewrites formula/compiled_table.py (minutes)
"""
from __future__ import annotations

import contextlib
import itertools
import sys
from fractions import Fraction
from pathlib import Path

import torch

from batchlab.config import RunConfig, preset
from batchlab.formula import compiled

# symbol -> its prime at the derivation shape; d, f carry a factor 2 (RoPE halves the head dim).  The partition is
# a min-cut over tensor sizes, so the shape keeps a real model's ratios: MLP 2.8x hidden, sequence 22x the head dim
PRIMES = dict(b=13, s=1021, k=11, g=17, d=23, f=709)  # k x d = 506 hidden, MLP 1418
GQA_PRIMES = dict(PRIMES, f=12037)  # 187 query heads over 11 KV heads: 8602 hidden, MLP 24074
SYMBOLS = tuple(PRIMES)
DOUBLED = ("d", "f")  # their dimension is 2 x their prime
SMALL = (2, 3, 5, 7)  # what may remain of a count: a constant factor of the layer's code

# family (formula.activations.Impl value) -> (preset, model source) of the code that is traced
FAMILIES = {"builtin": ("tiny", "builtin"), "hf-gpt2": ("gpt2", "hf:gpt2"), "hf-llama": ("llama-2-7b", "hf:llama-2-7b"),
            # torchtitan's Llama is not installed: transformers' runs in its place (config/standin.py STAND_IN), with
            # dynamo told not to replay the checkpoint's side effects -- transformers' forward sets a context variable
            # inside the checkpoint (a graph break that leaves the block eager), torchtitan's sets none
            "torchtitan-llama": ("llama-2-7b", "hf:llama-2-7b")}
NO_REPLAY = ("torchtitan-llama",)
POLICIES = ("none", "full", "selective", "selective-op")
# the Llamas also in pure bf16, as torchtune trains them
PRECISIONS = {"builtin": ("fp32", "bf16-mixed"), "hf-gpt2": ("fp32", "bf16-mixed"),
              "hf-llama": ("fp32", "bf16-mixed", "bf16"), "torchtitan-llama": ("fp32", "bf16-mixed", "bf16")}
VARIANTS = {  # (grouped-query attention, dropout, attention)
    "builtin": tuple((g, d, a) for a in ("eager", "sdpa") for g, d in ((False, True), (False, False), (True, False))),
    "hf-gpt2": ((False, True, "sdpa"), (False, False, "sdpa")),
    "hf-llama": ((False, False, "sdpa"), (True, False, "sdpa")),
    "torchtitan-llama": ((False, False, "sdpa"), (True, False, "sdpa"))}


class Uncompiled(RuntimeError):
    """The block did not compile into a graph (a graph break around the whole block): it runs eagerly."""


UNCOMPILED = compiled.UNCOMPILED  # the table's entry for a block dynamo does not compile
NOT_PRODUCTS = ("what the partition saves is not a sum of monomials in the dimensions (checked with another number "
                "of KV heads)")
CHECK_K = 19  # KV heads of the second derivation that checks an entry (a prime no other symbol uses)
# query heads per KV head of a grouped-query block's second derivation: a width that is a sum of dimensions (a fused
# q, k, v projection, h + 2·kv = k·d·(g + 2)) is linear in g, and two values of g give its two terms
SECOND_G = 19


def primes_of(gqa: bool, k: int | None = None, g: int | None = None) -> dict[str, int]:
    return dict(GQA_PRIMES if gqa else PRIMES, **({"k": k} if k else {}), **({"g": g} if g else {}))


def derivation_config(family: str, gqa: bool, dropout: bool, attention: str, policy: str, precision: str,
                      k: int | None = None, g: int | None = None) -> RunConfig:
    base, source = FAMILIES[family]
    p = primes_of(gqa, k, g)
    g, k = (p["g"] if gqa else 1), p["k"]
    heads, d = k * g, 2 * p["d"]
    spec = preset(base, layers=1, hidden=heads * d, heads=heads, kv_heads=k, ffn=2 * p["f"], vocab=64,
                  max_positions=2 * p["s"], dropout=0.1 if dropout else 0.0, attention=attention)
    return RunConfig(model=spec, model_source=source, seq=p["s"], micro_batch=p["b"], ac=policy,
                     precision=precision, compile="blocks")


def _count(v) -> int:
    n = v.untyped_storage().nbytes() // v.element_size() if v.numel() else 0
    return int(n.node.hint if isinstance(n, torch.SymInt) else n)


def monomial(count: int, primes: dict[str, int] = PRIMES) -> tuple[Fraction, tuple[int, ...]]:
    """(coefficient, exponents over SYMBOLS) with count = coefficient x the symbols' dimensions at the derivation
    shape raised to the exponents; a count with a prime factor above 7 that is no symbol's is a constant."""
    n, exps = _factored(count, primes)
    rest = n
    for p in SMALL:
        while rest and rest % p == 0:
            rest //= p
    if rest > 1:
        return Fraction(count), (0,) * len(SYMBOLS)
    halves = sum(e for name, e in zip(SYMBOLS, exps) if name in DOUBLED)
    return Fraction(n, 2 ** halves), tuple(exps)


def _factored(count: int, primes: dict[str, int]) -> tuple[int, tuple[int, ...]]:
    """(what is left, exponents over SYMBOLS) with every symbol divided out of count."""
    n, exps = count, []
    for name in SYMBOLS:
        e = 0
        while n and n % primes[name] == 0:
            n, e = n // primes[name], e + 1
        exps.append(e)
    return n, tuple(exps)


def linear_in_g(count: int, other: int, primes: dict[str, int], others: dict[str, int]) -> dict | None:
    """One tensor's size at two values of g (``primes``, ``others``; all else equal) as monomials: what is left
    once the symbols are divided out is α·g + β (α = 0: a product), e.g. a fused q, k, v projection's
    b·s·k·d·(g + 2), or its weight's 16-bit copy, k²·d²·g·(g + 2).  None where the two counts are no such
    pair."""
    rest, exps = _factored(count, primes)
    rest2, exps2 = _factored(other, others)
    if exps != exps2 or primes["g"] == others["g"]:
        return None
    alpha = Fraction(rest - rest2, primes["g"] - others["g"])
    beta = rest - alpha * primes["g"]
    if alpha < 0 or beta < 0:
        return None
    halves = 2 ** sum(e for name, e in zip(SYMBOLS, exps) if name in DOUBLED)
    with_g = tuple(e + (name == "g") for name, e in zip(SYMBOLS, exps))
    return {k: c / halves for k, c in ((exps, beta), (with_g, alpha)) if c}


def combined(sizes: list[tuple[int, int]], others: list[tuple[int, int]], primes: dict[str, int],
             at: dict[str, int]) -> dict[tuple[int, ...], Fraction] | None:
    """Terms from two derivations' (count, bytes per element) lists at two values of g; None where they do not pair
    up.  Tensors pair within their kind (bytes per element, and the symbols other than g they hold) in order of
    size: the order they are made in can differ (the weight gradients' buffers), their order in g does not."""
    def kinds(items, p):
        out: dict = {}
        for n, w in items:
            exps = _factored(n, p)[1]
            out.setdefault((w, tuple(0 if name == "g" else e for name, e in zip(SYMBOLS, exps))), []).append(n)
        return {k: sorted(v) for k, v in out.items()}

    mine, theirs = kinds(sizes, primes), kinds(others, at)
    if mine.keys() != theirs.keys() or any(len(v) != len(theirs[k]) for k, v in mine.items()):
        return None
    terms: dict[tuple[int, ...], Fraction] = {}
    for (w, _), counts in mine.items():
        for n, n2 in zip(counts, theirs[(w, _)]):
            found = linear_in_g(n, n2, primes, at)
            if found is None:
                return None
            for e, c in found.items():
                terms[e] = terms.get(e, Fraction(0)) + c * w
    return terms


def _root(node):
    """The node whose output a chain of views reads (views share their base's storage)."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view \
            and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def saved_sizes(partitions, primes: dict[str, int] = PRIMES) -> list[tuple[int, int]]:
    """(element count, bytes per element) of each tensor the forward graphs save for backward, in order; a graph
    input without the batch dimension (a parameter, a buffer, a table made once per forward) is not the layer's."""
    sizes = []
    for fw, n_outputs in partitions:
        out = next(x for x in fw.graph.nodes if x.op == "output")
        seen: set = set()
        for node in out.args[0][n_outputs:]:
            root = _root(node) if isinstance(node, torch.fx.Node) else None
            v = root.meta.get("val") if root is not None else None
            if not isinstance(v, torch.Tensor) or root in seen:
                continue
            seen.add(root)
            n = _count(v)
            if root.op == "placeholder" and n % primes["b"]:
                continue  # a parameter, a buffer or a table made once per forward: not this layer's
            sizes.append((n, v.element_size()))
    return sizes


def product_terms(sizes: list[tuple[int, int]], primes: dict[str, int]) -> dict[tuple[int, ...], Fraction]:
    """(count, bytes per element) of each tensor as exponents -> coefficient (bytes per unit monomial)."""
    terms: dict[tuple[int, ...], Fraction] = {}
    for n, width in sizes:
        coef, exps = monomial(n, primes)
        terms[exps] = terms.get(exps, Fraction(0)) + coef * width
    return terms


def evaluate(terms: dict[tuple[int, ...], Fraction], primes: dict[str, int]) -> Fraction:
    """The terms' bytes at the shape ``primes`` describes (d and f are twice their primes)."""
    total = Fraction(0)
    for exps, coef in terms.items():
        for name, e in zip(SYMBOLS, exps):
            coef *= Fraction(primes[name] * (2 if name in DOUBLED else 1)) ** e
        total += coef
    return total


def checked(family: str, gqa: bool, dropout: bool, attention: str, policy: str,
            precision: str) -> dict[tuple[int, ...], Fraction] | None:
    """The saved bytes as monomials (a grouped-query block derived at two values of g, ``combined``), if they also
    give the bytes the partition saves with another number of KV heads, else None: the min-cut may choose other
    tensors at other sizes, and a width no monomials describe fails there."""
    at = primes_of(gqa)
    sizes = derive(family, gqa, dropout, attention, policy, precision)
    if gqa:
        terms = combined(sizes, derive(family, gqa, dropout, attention, policy, precision, g=SECOND_G), at,
                         primes_of(gqa, g=SECOND_G))
    else:
        terms = product_terms(sizes, at)
    other = derive(family, gqa, dropout, attention, policy, precision, k=CHECK_K)
    ok = terms is not None and evaluate(terms, primes_of(gqa, CHECK_K)) == sum(n * w for n, w in other)
    return terms if ok else None


def derive(family: str, gqa: bool, dropout: bool, attention: str, policy: str,
           precision: str, k: int | None = None, g: int | None = None) -> list[tuple[int, int]]:
    """One block's saved tensors, (count, bytes per element) in order, from one forward of the partition on fake
    tensors (seconds)."""
    from batchlab.models.compiled import using_backend
    from batchlab.trace.compiled import PARTITIONS, partition_only
    from batchlab.trace.patches import eager_branches
    from batchlab.trace.run import FakeTrainer, fake_mode

    cfg = derivation_config(family, gqa, dropout, attention, policy, precision, k, g)
    torch._dynamo.reset()
    found: list = []
    PARTITIONS.append(found)
    replay = contextlib.nullcontext() if family not in NO_REPLAY else \
        torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    try:
        with replay, using_backend(partition_only), eager_branches(), fake_mode():
            trainer = FakeTrainer(cfg, torch.device("cpu"))
            batch = trainer.workload.make_batch(trainer.generator, cfg.micro_batch, cfg.seq, trainer.device)
            with trainer._autocast():
                trainer.workload.loss_sum(trainer.model, *batch)
    finally:
        PARTITIONS.remove(found)
    if not found:
        raise Uncompiled(f"{family} {policy}: no compiled graph was partitioned")
    return saved_sizes(found, primes_of(gqa, k, g))


def _key(family: str, gqa: bool, dropout: bool, attention: str, policy: str, precision: str) -> str:
    heads, drop = "gqa" if gqa else "mha", "dropout" if dropout else "no-dropout"
    return f"{family}|{heads}|{drop}|{attention}|{policy}|{precision}"


def write_table(path: Path, keep: dict | None = None) -> None:
    """Derive every entry (``keep``: entries derived already, by key, with this torch) and write the table."""
    entries = {}
    for family in FAMILIES:
        for (gqa, dropout, attention), policy, precision in itertools.product(VARIANTS[family], POLICIES,
                                                                              PRECISIONS[family]):
            key = _key(family, gqa, dropout, attention, policy, precision)
            if keep is not None and key in keep:
                entries[key] = keep[key]
                continue
            print(f"deriving {key}", file=sys.stderr, flush=True)
            try:  # a string: why there are no terms (the formula's eager terms are used, and it says why)
                found = checked(family, gqa, dropout, attention, policy, precision)
                entries[key] = NOT_PRODUCTS if found is None else tuple((e, c.numerator, c.denominator)
                                                                        for e, c in sorted(found.items()))
            except Uncompiled:
                entries[key] = UNCOMPILED
    write_generated(path, "compiled_terms", "TERMS", entries,
                    "per family | heads (mha, gqa) | dropout | attention | layer policy | precision, the bytes one "
                    "compiled block saves for backward")


def write_generated(path: Path, module: str, name: str, entries: dict, what: str,
                    symbols: tuple[str, ...] = SYMBOLS) -> None:
    """A generated table of trace/``module``: ``name`` = {key: (exponents over SYMBOLS, numerator, denominator) terms
    or why there are none}, with the torch it was derived with (a table of another torch is derived again)."""
    rows = "\n".join(f"    {k!r}: {v!r}," for k, v in entries.items())
    header = (f'"""Generated by ``python -m batchlab.trace.{module}`` (torch {torch.__version__}, CPU kernels): {what}, '
              f'each a tuple of (exponents over {", ".join(symbols)}, numerator, denominator) bytes, or why there are '
              'none.  Do not edit."""\n')
    path.write_text(header + f"SYMBOLS = {symbols!r}\nTORCH = {torch.__version__!r}\n{name} = {{\n{rows}\n}}\n")


def command_line(table: str, name: str) -> tuple[Path, dict | None, str | None]:
    """A table generator's arguments: the formula/ module it writes, the entries ``--missing`` keeps (those made with
    this torch; None: derive all) and ``--only=PART,...`` (derive just the keys containing one of the parts)."""
    import importlib

    path = Path(__file__).resolve().parents[1] / "formula" / f"{table}.py"
    kept = None
    if "--missing" in sys.argv and path.exists():
        module = importlib.import_module(f"batchlab.formula.{table}")
        kept = getattr(module, name) if getattr(module, "TORCH", None) == torch.__version__ else None
    only = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")), None)
    return path, kept, only


if __name__ == "__main__":
    target, kept, _ = command_line("compiled_table", "TERMS")
    with contextlib.suppress(KeyboardInterrupt):
        write_table(target, kept)
