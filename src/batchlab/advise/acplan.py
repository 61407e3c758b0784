"""``fit --ac auto``: the per-layer activation-checkpointing plan with the least predicted update time whose
predicted peak fits a memory budget, jointly with the micro-batch at a fixed global batch.

The model solved (formula, allocated tensor bytes; on CUDA the check adds the caching allocator's view):
    peak(plan) = max( F + sum_j held_j,  max_i ( B_i + sum_{j<i} held_j ),  O )
F: the forward's high point besides the layers' kept activations; B_i: layer i's backward (bottom first)
besides what the layers below still hold, with layer i rebuilt to its whole working set by its recompute;
O: the optimizer step (no activations).  held_j: what layer j keeps for backward under its policy (plus,
under autocast, the 16-bit weight copies its matmuls keep when it is not recomputed).  Costs: the per-op time
model's extra update seconds of each policy per layer (its recompute ops).  Solved exactly by dynamic
programming (advise/knapsack.py); the plan is then checked by the formula's full estimate of it, and the
budget tightened by any excess (the layer profile's backward and the allocator margin are not in the sum).
Torch-free.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from batchlab.advise import knapsack
from batchlab.advise.acmodel import MODEL_TEXT, LayerModel
from batchlab.advise.plan import EVERY_K, Goal, micro_batches, shaped
from batchlab.cache.calibrations import load_all
from batchlab.config import ACMode, ACPolicy, AttentionImpl, CompileMode, ConfigError, ModelSource, RunConfig
from batchlab.config.acpolicies import layer_policies, no_recompute, whole_block
from batchlab.config.planfile import MAX_LAYERS
from batchlab.formula import Calibrations, compiled, estimate
from batchlab.util.units import fmt_bytes

MENU = layer_policies()  # the catalogue's per-layer policies, least recompute first (config/acpolicies.py)
NONE = no_recompute()  # the reference every policy's bytes and seconds are read against
TIGHTEN_TRIES = 4
BISECTIONS = 16  # after tightening: to 1/65536 of the gap between a fitting and a failing model budget


def menu(cfg: RunConfig) -> tuple[ACMode, ...]:
    """The layer policies a plan may use (those that recompute the fused attention call: SDPA only); compiled,
    those the formula has compiled terms for (formula/compiled.py), where there are two or more."""
    modes = tuple(m for m in MENU if not m.spec.needs_sdpa or cfg.model.attention is AttentionImpl.SDPA)
    if cfg.compile is CompileMode.NONE:
        return modes
    covered = tuple(m for m in modes if compiled.applies(cfg.replace(ac=uniform(m, cfg.model.layers))))
    return covered if len(covered) > 1 else modes


def uniform(mode: ACMode, layers: int) -> ACPolicy:
    return ACPolicy.of_layers((mode,) * layers)


def layer_model(cfg: RunConfig, cals: Calibrations) -> LayerModel:
    """Read F, B_i, O and each policy's bytes and seconds off the formula (uniform plans of each policy)."""
    n = cfg.model.layers
    modes = menu(cfg)
    ests = {m: estimate(cfg.replace(ac=uniform(m, n)), cals) for m in modes}
    none = ests[NONE].memory
    walked = none if none.backward_walk else estimate(_builtin(cfg).replace(ac="none"), cals).memory
    assert walked.backward_walk, "the built-in terms walk DDP's backward and FSDP's"
    copy = walked.layer_copy_bytes
    kept = {m: e.memory.activations_per_layer_bytes[0] for m, e in ests.items()}
    held = tuple(kept[m] + (copy if m is NONE else 0) for m in modes)
    held_none = walked.activations_per_layer_bytes[0] + copy
    start, *layers = walked.backward_walk
    if walked is not none:  # a profile's backward is its high point, with every layer's kept: a total constraint
        start = none.phase_peaks["backward"]
    walk = tuple(w - i * held_none for i, w in enumerate(reversed(layers)))
    start -= n * (kept[NONE] + copy)
    # the forward holds every layer's weight copies whatever the plan: its total counts the kept bytes alone
    forward = none.phase_peaks["forward"] - n * kept[NONE]
    base_seconds = ests[NONE].time.update_seconds
    seconds = tuple((ests[m].time.update_seconds - base_seconds) / n for m in modes)
    opt = none.phase_peaks.get("optimizer", 0)
    # one total constraint where the forward's cannot bind before the backward start's (held >= kept per layer)
    if not copy or forward <= start:
        return LayerModel(cfg, modes, (held,) * n, (seconds,) * n, walk, max(start, forward), opt)
    rows = tuple(kept[m] for m in modes)
    return LayerModel(cfg, modes, (held,) * n, (seconds,) * n, walk, start, opt, kept=(rows,) * n,
                      forward_kept=forward)


def model_at(cfg: RunConfig, cals: Calibrations) -> LayerModel:
    """The formula's model, or for a factory (the formula cannot see inside it) the trace's."""
    if cfg.model_kind is ModelSource.FACTORY:
        from batchlab.advise.acplan_trace import trace_layer_model

        return trace_layer_model(cfg, cals)
    return layer_model(cfg, cals)


def _builtin(cfg: RunConfig) -> RunConfig:
    """cfg without its layer profile: the built-in terms' backward walk (a profile gives only its high point)."""
    return cfg.replace(model=cfg.model.with_profile(None))


def solve(lm: LayerModel, budget: int) -> ACPolicy | None:
    """The model's optimum within ``budget`` tensor bytes, or None."""
    if lm.optimizer > budget:
        return None
    caps = [budget - b for b in lm.walk]
    second = {} if lm.kept is None else dict(kept=lm.kept, kept_cap=budget - lm.forward_kept)
    choice = knapsack.solve(lm.seconds, lm.held, caps, budget - lm.forward, **second)
    if choice is None:
        return None
    return ACPolicy.of_layers(lm.modes[j] for j in choice)


@dataclass(frozen=True)
class Point:
    """One configuration on the memory/time axes (formula)."""

    ac: str
    micro_batch: int
    peak_bytes: int
    update_seconds: float
    kind: str  # "plan" (with the budget it was solved for) or "preset"
    budget_bytes: int | None = None
    allocated_bytes: int | None = None  # tensor bytes (peak_bytes less the caching allocator's slack on CUDA)
    layers: int | None = None  # the model's: a preset (full, every:2) names no layer count of its own

    @property
    def allocated(self) -> int:
        """Tensor bytes at the predicted peak: what a trial's allocator peak is compared with."""
        return self.allocated_bytes or self.peak_bytes

    @property
    def slack(self) -> int:
        """The caching allocator's predicted bytes beyond the tensors (CUDA's reserved view; 0 on CPU)."""
        return self.peak_bytes - self.allocated

    @property
    def per_layer(self) -> list[str]:
        """One policy per layer, a preset's too: what the plan file fit writes holds (advise/acfit.py)."""
        pol = ACPolicy.parse(self.ac)
        layers = self.layers or len(pol.layers)
        return [m.value for m in pol.layer_modes(layers)] if layers else []


def per_layer_of(cfg: RunConfig) -> list[str]:
    """cfg's policy per layer, a preset's too: the plan file fit writes and the plan's JSON both hold it."""
    return [m.value for m in cfg.ac.layer_modes(cfg.model.layers)]


def point(cfg: RunConfig, kind: str, cals: Calibrations, budget: int | None = None) -> Point:
    """cfg's predicted peak and update time: the formula's, or for a factory the trace's."""
    if cfg.model_kind is ModelSource.FACTORY:
        from batchlab.advise.acplan_trace import traced

        t = traced(cfg, cals)
        return Point(str(cfg.ac), cfg.micro_batch, t.memory.peak_bytes + t.memory.margin_bytes, t.time.seconds, kind,
                     budget, t.memory.peak_bytes, cfg.model.layers)
    e = estimate(cfg, cals)
    return Point(str(cfg.ac), cfg.micro_batch, e.memory.peak_bytes, e.time.update_seconds, kind, budget,
                 e.memory.allocated_bytes, cfg.model.layers)


def plan_within(lm: LayerModel, budget: int, cals: Calibrations) -> Point | None:
    """The model's optimum, checked by the formula's full estimate (on CUDA the reserved view, whose allocator
    slack the model leaves out): the model's budget tightened by any excess, then bisected between the
    largest model budget whose plan fitted and the least whose plan did not, for the fastest plan that fits.
    The first try allows the discretisation's rounding (a plan that fits to the byte is not lost to it)."""
    slack = 0 if knapsack.by_counts(lm.seconds, lm.held, lm.kept) else (lm.layers + 1) * -(-budget // knapsack.UNITS)
    target, fitted, failed = budget + slack, None, None
    for _ in range(TIGHTEN_TRIES):
        p = _at(lm, target, budget, cals)
        if p is None or p.peak_bytes <= budget:
            fitted = (target, p) if p is not None else None
            break
        failed = target
        target -= max(p.peak_bytes - budget, slack, budget // 1000 if target <= budget else 0)
    if fitted is None and failed is None:
        return None  # nothing fits the model at all
    lo, best = fitted if fitted is not None else (0, None)
    hi = failed if failed is not None else lo
    for _ in range(BISECTIONS if lm.provenance == "formula" else BISECTIONS // 2):
        if hi - lo <= max(slack, budget // 10**5):
            break
        mid = (lo + hi) // 2
        p = _at(lm, mid, budget, cals)
        if p is not None and p.peak_bytes > budget:
            hi = mid
            continue
        lo = mid
        if p is not None and (best is None or p.update_seconds < best.update_seconds):
            best = p
    return best


def _at(lm: LayerModel, target: int, budget: int, cals: Calibrations) -> Point | None:
    """The model's optimum within ``target`` as a point of the full estimate (None: nothing fits the model)."""
    ac = solve(lm, target)
    return point(lm.cfg.replace(ac=ac), "plan", cals, budget) if ac is not None else None


def presets(lm: LayerModel) -> list[ACPolicy]:
    every = [ACPolicy.every_kth(k) for k in EVERY_K if k < lm.layers and k <= lm.cfg.model.layers]
    return [ACPolicy(m) for m in lm.modes] + every


@dataclass
class ACPlan:
    """What ``fit --ac auto`` found: the plan, its figures, the frontier and the model solved."""

    budget_bytes: int
    chosen: Point | None
    config: RunConfig | None
    frontier: list[Point] = field(default_factory=list)
    best_preset: Point | None = None  # the fastest preset that fits the same budget (any micro-batch)
    model: str = MODEL_TEXT
    provenance: str = "formula"  # of every predicted figure: formula, or trace for a factory
    notes: list[str] = field(default_factory=list)
    file: str | None = None  # where the plan was written

    def to_dict(self) -> dict:
        from batchlab.config import to_jsonable

        c = self.chosen
        per_layer = per_layer_of(self.config) if self.config is not None and c else (c.per_layer if c else None)
        return {"per_layer": per_layer, "ac": c.ac if c else None,
                "predicted_peak_bytes": c.peak_bytes if c else None,
                "predicted_update_seconds": c.update_seconds if c else None, "budget_bytes": self.budget_bytes,
                "micro_batch": c.micro_batch if c else None, "best_preset": to_jsonable(self.best_preset),
                "frontier": [dict(to_jsonable(p), per_layer=p.per_layer) for p in self.frontier],
                "model_solved": self.model, "provenance": self.provenance, "notes": self.notes, "file": self.file}


def _fastest(points: list[Point], budget: int) -> Point | None:
    fits = [p for p in points if p.peak_bytes <= budget]
    return min(fits, key=lambda p: (round(p.update_seconds, 12), -p.micro_batch)) if fits else None


def layer_models(goal: Goal, cals: Calibrations | None = None) -> dict[int, LayerModel]:
    """The planner's model at each micro-batch the goal searches (one if held): built once per fit, then
    planned at every budget its fallbacks try."""
    if goal.base.model.layers > MAX_LAYERS:  # a plan names each layer: the bound every plan form has
        raise ConfigError("layers", f"--ac auto plans at most {MAX_LAYERS:,} layers, got {goal.base.model.layers:,}")
    cals = load_all() if cals is None else cals
    return {mb: model_at(shaped(goal, mb, ACPolicy(), goal.base.zero), cals) for mb in micro_batches(goal)}


def plan_ac(goal: Goal, budget: int | None = None, frontier_points: int = 6,
            models: dict[int, LayerModel] | None = None) -> ACPlan:
    """Jointly over the micro-batches the goal searches (one if held) and per-layer policies; ``models``:
    ``layer_models(goal)`` where the caller has them already."""
    cals = load_all()
    budget = goal.usable_bytes if budget is None else budget
    models = layer_models(goal, cals) if models is None else models
    check_budget(goal, models.values(), budget)
    plans = [p for lm in models.values() if (p := plan_within(lm, budget, cals)) is not None]
    preset_points = [point(lm.cfg.replace(ac=ac), "preset", cals) for lm in models.values() for ac in presets(lm)]
    best_preset = _fastest(preset_points, budget)
    chosen = _fastest(plans, budget)
    any_model = next(iter(models.values()))
    out = ACPlan(budget, chosen, None, best_preset=best_preset, model=any_model.solved,
                 provenance=any_model.provenance)
    if chosen is None and best_preset is None:
        out.notes.append(f"no plan fits {fmt_bytes(budget)} at any micro-batch searched")
        return out
    if chosen is None or best_preset is not None and best_preset.update_seconds < chosen.update_seconds:
        why = "is faster than the model's optimum by the full estimate" if chosen is not None else \
            "fits where no plan of the model did"
        out.notes.append(f"preset {best_preset.ac} {why}: taken")
        chosen = out.chosen = dataclasses.replace(best_preset, kind="plan", budget_bytes=budget)
    lm = models[chosen.micro_batch]
    out.config = lm.cfg.replace(ac=chosen.ac)
    same_mb = [p for p in preset_points if p.micro_batch == chosen.micro_batch]
    ends = {p.ac: p.peak_bytes for p in same_mb}  # every layer recomputed, and none: the presets full and none
    out.frontier = frontier(lm, cals, frontier_points, ends[str(whole_block())], ends[str(NONE)]) + same_mb
    if all(p.ac != chosen.ac for p in out.frontier):  # the chosen plan is a point of its frontier
        out.frontier.append(chosen)
    return out


def check_budget(goal: Goal, models: Iterable[LayerModel], budget: int | None = None) -> None:
    """A budget below the model states (and the optimizer step) is a user error: no plan can help."""
    budget = goal.usable_bytes if budget is None else budget
    need = min(lm.optimizer for lm in models)
    if need > budget:
        raise ConfigError("memory_budget", f"{fmt_bytes(budget)} (after the {goal.margin:.0%} margin) is below the "
                                           f"model states and the optimizer step alone ({fmt_bytes(need)}, formula)")


def frontier(lm: LayerModel, cals: Calibrations, count: int, lo: int, hi: int) -> list[Point]:
    """Each budget's best plan at this micro-batch, budgets spread from ``lo`` (every layer recomputed: the
    preset full's peak) to ``hi`` (none's)."""
    budgets = sorted({lo + (hi - lo) * k // max(count - 1, 1) for k in range(count)})
    out: dict[str, Point] = {}  # each distinct plan once, at the least budget that gave it
    for p in (plan_within(lm, b, cals) for b in budgets):
        if p is not None and p.ac not in out:
            out[p.ac] = p
    return list(out.values())


def next_budget(budget: int, predicted: int, measured: int) -> int:
    """After a plan measured above the budget: plan again with the excess (at least 1%) taken off."""
    return budget - max(measured - predicted, measured - budget, budget // 100)
