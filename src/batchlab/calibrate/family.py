"""A Hugging Face model's own dispatch cost per op, against the GPT the calibration times it on.

The calibration prices an op's fixed cost on batchlab's GPT at dispatch-bound sizes; a model's own Python runs
around its ops too, and differs by code: a Hugging Face model's forward can cost a multiple of batchlab's GPT's
per op beyond its work (its mask, config and output code), its backward about the same (autograd's own loop);
unpriced, a dispatch-bound forward is predicted far too short (docs/cpu.md, "Figures behind the code's
choices").  So the first time measure or compare meets a model's code, the same model at dispatch-bound sizes
and batchlab's GPT take turns for ~1.5 s, and the model's forward and backward cost per op over the GPT's is
cached with the CPU's calibration (``Calibration.family_dispatch``); the time model then prices that model's ops
with it (``formula.timing.own_dispatch``).  A ratio of alternated updates: the host's speed falls on both alike.
"""
from __future__ import annotations

import dataclasses

from batchlab.calibrate.dispatch import DISPATCH_GPT, DispatchSampler, counted, per_kind
from batchlab.calibrate.oneoff import at_threads, thread_clock
from batchlab.cache.calibrations import default_threads, load_cached, save
from batchlab.config import ConfigError, RunConfig
from batchlab.formula.opcost import OpCosts
from batchlab.formula.plausible import family_problems
from batchlab.formula.timing import dispatch_family

SECONDS = 1.5  # alternated updates of the two models, hundreds each at dispatch-bound sizes
KINDS = ("forward", "backward")  # the phases the model's own code runs in (plain ops: the harness's, torch's)


def dispatch_bound(cfg: RunConfig) -> RunConfig:
    """``cfg``'s model code at sizes where every op is dispatch-bound (2 layers of width 16, 8 tokens), as the
    calibration's own GPT is; its attention, norm, MLP and position code kept (a sliding window only where
    ``cfg`` reaches it: the code path changes there)."""
    m = cfg.model
    window = 4 if m.sliding_window is not None and cfg.seq >= m.sliding_window else None
    small = dataclasses.replace(m, layers=2, hidden=16, heads=2, vocab=32, max_positions=8, profile=None,
                                kv_heads=None if m.kv_heads in (None, m.heads) else 1,
                                ffn=None if m.ffn is None else 32, sliding_window=window)
    return RunConfig(model=small, model_source=cfg.model_source, seq=8, micro_batch=1)


def measure(cfg: RunConfig, costs: OpCosts, seconds: float = SECONDS) -> dict[str, float]:
    """{kind: ``cfg``'s model's fixed cost per op over batchlab's GPT's}, forward and backward: both models at
    dispatch-bound sizes, their fp32 updates alternated on this CPU at the current intra-op threads; each
    phase's time less its ops' work as ``costs`` price it (fused attention's fixed start on a CPU is work the
    model prices already: counted twice, it would double a small model's apparent cost per op)."""
    import torch

    cpu = torch.device("cpu")
    with thread_clock():
        runs = {"fp32": counted(DISPATCH_GPT, cpu), "model": counted(dispatch_bound(cfg), cpu)}
        sampler = DispatchSampler({name: (trainer, per_kind(ops)) for name, (trainer, ops) in runs.items()},
                                  lambda: None)
        sampler.run(seconds, at_least=20)
    per_op = sampler.seconds()

    def beyond_work(name: str, kind: str) -> float:
        ops = runs[name][1]
        n, work = per_kind(ops)[kind], per_kind(ops, costs.work_seconds)[kind]
        return max(per_op[name][kind] * n - work, 0.0) / n

    return {k: ratio(beyond_work("model", k), beyond_work("fp32", k), per_op["model"][k], per_op["fp32"][k])
            for k in KINDS}


SEPARABLE = 0.05  # the GPT's fixed cost per op beyond its work, as a share of its whole time per op


def ratio(model_beyond: float, gpt_beyond: float, model_per_op: float, gpt_per_op: float) -> float:
    """The model's fixed cost per op over the GPT's, as measured: nothing clamped (a figure outside
    plausible.FAMILY_RATIO is refused by ``ensure``, not bent into it).  Where this CPU runs the GPT's ops so
    fast that the work model already prices (nearly) all of their time, the fixed part is not separable from
    noise (it reads 0 or a few ns, and a ratio over it explodes): the whole times per op are compared instead,
    both models being dispatch-bound at these sizes."""
    if gpt_beyond > SEPARABLE * gpt_per_op:
        return model_beyond / gpt_beyond
    return model_per_op / gpt_per_op if gpt_per_op > 0 else 1.0


def ensure(cfg: RunConfig, threads: int | None = None) -> str | None:
    """For a Hugging Face model on this CPU whose calibration (at ``threads``) has no figures of its code yet:
    measure them and cache them with it.  Returns the line to show the user (None: nothing to say)."""
    key = dispatch_family(cfg)
    cal = load_cached("cpu", default_threads() if threads is None else threads) if key and cfg.device == "cpu" else None
    if cal is None or key in cal.family_dispatch:
        return None
    try:
        with at_threads(cal.threads):
            ratios = measure(cfg, cal.op_costs() or _nominal(cfg))
    except (ConfigError, RuntimeError, ValueError, TypeError) as e:  # a shape the model's code refuses
        return f"time model: {cfg.model_source}'s own dispatch per op not measured ({e}); batchlab's GPT's serves"
    if bad := family_problems(key, ratios):  # a stall or a broken run: priced, every prediction would follow it
        return (f"time model: {cfg.model_source}'s own dispatch per op measured implausible ({bad[0]}); not cached, "
                "batchlab's GPT's serves")
    cal.family_dispatch[key] = ratios
    save(cal)
    said = ", ".join(f"{k} x{r:.2f}" for k, r in ratios.items())  # in the order measured: forward, backward
    return (f"time model: measured {cfg.model_source}'s own dispatch per op once against batchlab's GPT "
            f"({said}) and cached it with the calibration")


def _nominal(cfg: RunConfig) -> OpCosts:
    """Work priced at nominal CPU rates where the cached calibration predates the per-op model."""
    from batchlab.formula.timing import nominal_costs

    return nominal_costs(cfg, 1.0)
