"""Plan by formula: micro-batch x activation checkpointing (x ZeRO stage) for a fixed global batch.

Every candidate keeps the global batch: accum = global / (micro x DP), never the other way round.
Torch-free (the plan must answer in well under a second).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Callable

from batchlab.advise.candidate import Candidate, candidate, option_key, traced_candidate  # noqa: F401 (the plan's)
from batchlab.cache.calibrations import load_all
from batchlab.config import AC_POLICIES, ACPolicy, ConfigError, Counted, ModelSource, RunConfig
from batchlab.config.engines import TPOverlap
from batchlab.formula import estimate
from batchlab.formula.memory import model_states
from batchlab.util.units import fmt_amount, fmt_bytes

DEFAULT_MARGIN = 0.10  # of the device memory (or --memory-budget), kept free on top of the formula's peak
DEFAULT_TOKENS = 10**9  # token budget the time ranking uses when none is given
EVERY_K = (2, 4, 8)  # every:K policies tried (K < layers)
# A micro-batch of at least this many tokens keeps matmuls reasonably large: below it per-micro-batch overheads
# and small kernels dominate, which the per-op time model prices from the calibration of this device only.
MIN_MICRO_TOKENS = 4096
# Knobs a user may hold fixed (typed on the command line); the others are searched.  Precision is never
# searched (it changes the numerics), so holding it only names it.
KNOBS = ("micro_batch", "ac", "zero", "precision", "tp", "pp")
Progress = Callable[[int, int, str], None]
KNOB_FLAGS = {"micro_batch": "--micro-batch", "ac": "--ac", "zero": "--zero", "precision": "--precision",
              "tp": "--tp", "pp": "--pp"}


@dataclass(frozen=True)
class Goal:
    """What to plan for: ``base`` gives model, seq, precision, optimizer, DP, ZeRO stage, device, budget;
    its global batch (micro x accum x DP) is the target and never changes."""

    base: RunConfig
    tokens: float = DEFAULT_TOKENS
    margin: float = DEFAULT_MARGIN
    allow_zero: bool = False  # also try ZeRO stages 0-3 over the DP ranks (DP > 1)
    min_micro_tokens: int = MIN_MICRO_TOKENS
    held: frozenset[str] = frozenset()  # KNOBS kept as base has them (the user gave them explicitly)
    world: int | None = None  # search the layouts dp x tp x pp of this many devices (None: base's layout only)
    # asked of every layout searched (--world-size): the base, one device, cannot take them itself
    sequence_parallel: bool = False
    pp_virtual: int = 1
    tp_overlap: TPOverlap = TPOverlap.NONE  # needs sequence_parallel (on the goal or the base); a spelling is parsed

    def __post_init__(self):
        object.__setattr__(self, "tp_overlap", TPOverlap.parse("tp_overlap", self.tp_overlap))
        if not set(self.held) <= set(KNOBS):
            raise ConfigError("held", f"{sorted(set(self.held) - set(KNOBS))} not among {', '.join(KNOBS)}")
        if not (isinstance(self.margin, (int, float)) and 0.0 <= self.margin < 1.0):
            raise ConfigError("margin", f"must be a fraction in [0, 1), got {self.margin!r}")
        if not (isinstance(self.tokens, (int, float)) and 0 < self.tokens < float("inf")):  # NaN fails too
            raise ConfigError("tokens", f"must be > 0, got {self.tokens!r}")
        if self.min_micro_tokens < 1:
            raise ConfigError("min_micro_tokens", f"must be >= 1, got {self.min_micro_tokens}")
        if self.world is not None:
            check_world(self)
        elif self.sequence_parallel or self.pp_virtual != 1 or self.tp_overlap is not TPOverlap.NONE:
            raise ConfigError("sequence_parallel" if self.sequence_parallel else
                              "pp_virtual" if self.pp_virtual != 1 else "tp_overlap",
                              "asked of the layouts --world-size searches; without it, set it on the config")

    @property
    def global_batch(self) -> int:
        return self.base.global_batch

    @property
    def per_rank(self) -> int:
        """Sequences per rank per update: the largest possible micro-batch."""
        return self.global_batch // self.base.dp

    @property
    def capacity_bytes(self) -> int:
        return self.base.memory_capacity

    @property
    def usable_bytes(self) -> int:
        return int(self.capacity_bytes * (1 - self.margin))

    @property
    def searched(self) -> tuple[str, ...]:
        """The knobs the plan varies (in KNOBS order)."""
        out = [k for k in ("micro_batch", "ac") if k not in self.held]
        out += ["zero"] if len({z for d in {c.dp for c in layouts(self)} for z in zero_stages(self, d)}) > 1 else []
        return tuple(out + [k for k in ("tp", "pp") if self.world is not None and k not in self.held])

    def released(self, base: RunConfig, *knobs: str, allow_zero: bool = False) -> "Goal":
        """This goal for another base config, with ``knobs`` no longer held."""
        return dataclasses.replace(self, base=base, allow_zero=allow_zero, held=self.held - set(knobs))

    def reasonable(self, cfg: RunConfig) -> bool:
        """A micro-batch large enough for efficient kernels, or the whole batch of cfg's data-parallel rank."""
        return cfg.micro_batch * cfg.seq >= self.min_micro_tokens or cfg.micro_batch == self.global_batch // cfg.dp

    def at_layout(self, cfg: RunConfig) -> "Goal":
        """This goal with cfg (a candidate of it: same global batch) as the base, its layout no longer searched:
        what measuring a pick searches over."""
        assert cfg.global_batch == self.global_batch, (cfg.global_batch, self.global_batch)
        return self if self.world is None else dataclasses.replace(self, base=cfg, world=None)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def policies(layers: int) -> list[ACPolicy]:
    """Cheapest recompute first: none, every:K (largest K first), selective, full."""
    every = [ACPolicy.every_kth(k) for k in sorted(EVERY_K, reverse=True) if k < layers]
    return [ACPolicy()] + every + [ACPolicy(m) for m, s in AC_POLICIES.items() if s.in_ladder]


def check_world(goal: Goal) -> None:
    """--world-size: a whole number the base's own layout can fill (its degrees, where held, divide it)."""
    from batchlab.config.values import SIZE_MAX, whole_number

    whole_number("world_size", goal.world, maximum=SIZE_MAX)
    whole_number("pp_virtual", goal.pp_virtual, maximum=SIZE_MAX)
    goal.base.parallel.schedule_spec.check(1, 1, goal.pp_virtual)  # chunks per rank need an interleaved schedule
    goal.tp_overlap.check(goal.sequence_parallel or goal.base.sequence_parallel)
    held = (goal.base.tp if "tp" in goal.held else 1) * (goal.base.pp if "pp" in goal.held else 1)
    if goal.world % held:
        raise ConfigError("world_size", f"{goal.world} devices do not split into the tp x pp held ({held})")
    if not layouts(goal):
        asked = "".join([", has tp > 1 (sequence parallelism)"] * goal.sequence_parallel
                        + [f", has pp > 1 ({goal.pp_virtual} virtual stages)"] * (goal.pp_virtual > 1))
        raise ConfigError("world_size", f"no layout dp x tp x pp = {goal.world} keeps the global batch "
                                        f"{goal.global_batch} (dp must divide it){asked} and splits the model evenly")


@functools.lru_cache(maxsize=16)  # a Goal is frozen; fit asks for its layouts from five places
def layouts(goal: Goal) -> tuple[RunConfig, ...]:
    """The layouts searched, each as the base config with its degrees (micro-batch 1): the base's own without
    --world-size; else every dp x tp x pp = world whose dp divides the global batch, whose tp stays within one
    node (its collectives run per layer on the intra-node link: Narayanan et al. 2021, arXiv 2104.04473, §3.3)
    and that the model splits evenly (config/parallel.py check_degrees); degrees typed explicitly are held."""
    b = goal.base
    if goal.world is None:
        return (b,)
    per_node = b.device_spec.gpus_per_node
    sp, v = goal.sequence_parallel or b.sequence_parallel, max(goal.pp_virtual, b.pp_virtual)
    overlap = b.tp_overlap if goal.tp_overlap is TPOverlap.NONE else goal.tp_overlap
    out = []
    for tp in ([b.tp] if "tp" in goal.held else [d for d in divisors(goal.world) if d <= per_node]):
        for pp in ([b.pp] if "pp" in goal.held else divisors(goal.world // tp)):
            dp, rest = divmod(goal.world, tp * pp)
            # sequence parallelism splits over TP ranks, virtual stages are chunks of a pipeline: only such layouts
            if rest == 0 and goal.global_batch % dp == 0 and (tp > 1 or not sp) and (pp > 1 or v == 1):
                out += derived(b, [dict(dp=dp, tp=tp, pp=pp, micro_batch=1, accum=goal.global_batch // dp,
                                        sequence_parallel=sp, pp_virtual=v, tp_overlap=overlap)])
    return tuple(out)


def goal_policies(goal: Goal) -> list[ACPolicy]:
    return [goal.base.ac] if "ac" in goal.held else policies(goal.base.model.layers)


def micro_batches(goal: Goal, layout: RunConfig | None = None) -> list[int]:
    """The micro-batches searched on ``layout`` (the base's by default): the divisors of its per-rank batch whose
    accumulation the pipeline's schedule takes (1F1B over p stages needs at least p micro-batches per update)."""
    cfg = goal.base if layout is None else layout
    if "micro_batch" in goal.held:
        return [goal.base.micro_batch]
    per_rank = goal.global_batch // cfg.dp
    return [mb for mb in divisors(per_rank) if _schedulable(cfg, per_rank // mb)]


def _schedulable(cfg: RunConfig, accum: int) -> bool:
    if cfg.optimizer_in_backward and accum > 1:  # nothing to accumulate into (config/memtech.py)
        return False
    try:
        cfg.parallel.schedule_spec.check(cfg.pp, accum, cfg.pp_virtual)
    except ConfigError:
        return False
    return True


def zero_stages(goal: Goal, dp: int | None = None) -> tuple[int, ...]:
    """The ZeRO stages searched at data-parallel degree ``dp`` (the base's by default): one without sharding ranks,
    and one for an engine other than PyTorch's (Megatron, DeepSpeed): it implements its own stage only."""
    if goal.base.sharding is not None:
        return (goal.base.zero,)
    if goal.allow_zero and (goal.base.dp if dp is None else dp) > 1 and "zero" not in goal.held:
        return tuple(range(goal.base.zero, 4))
    return (goal.base.zero,)


def shape(goal: Goal, micro_batch: int, ac: ACPolicy, zero: int, layout: RunConfig) -> dict:
    """The fields that make ``layout`` (one of ``layouts(goal)``) this candidate; accum keeps the global batch."""
    return dict(micro_batch=micro_batch, accum=goal.global_batch // (layout.dp * micro_batch), ac=ac, zero=zero)


def shaped(goal: Goal, micro_batch: int, ac: ACPolicy, zero: int) -> RunConfig:
    return goal.base.replace(**shape(goal, micro_batch, ac, zero, goal.base))


def derived(cfg: RunConfig, changes: list[dict]) -> list[RunConfig]:
    """cfg with each of ``changes``; those it cannot take are left out (where they are used, the reason is said)."""
    out = []
    for change in changes:
        try:
            out.append(cfg.replace(**change))
        except ConfigError:
            continue
    return out


def searched_configs(goal: Goal) -> list[RunConfig]:
    """A config of each AC policy and ZeRO stage ``enumerate_candidates`` searches (the micro-batch aside: it
    changes no layer term), for the CLI to have an hf: model's layer profile cover them first."""
    return [c for lay in layouts(goal)
            for c in derived(lay, [dict(ac=ac, zero=z) for z in zero_stages(goal, lay.dp) for ac in goal_policies(goal)])]


def enumerate_candidates(goal: Goal, progress: Progress | None = None) -> list[Candidate]:
    """``progress(done, total, label)``: called before each candidate (a factory's are traced, ~0.2 s each)."""
    cals = load_all()
    shapes = [c for lay in layouts(goal) for z in zero_stages(goal, lay.dp) for ac in goal_policies(goal)
              for c in derived(lay, [shape(goal, mb, ac, z, lay) for mb in micro_batches(goal, lay)])]
    out = []
    for i, cfg in enumerate(shapes):
        if progress is not None:
            progress(i, len(shapes), f"candidate {i + 1} of {len(shapes)}: micro-batch {cfg.micro_batch}, {cfg.ac}")
        out.append(candidate(cfg, goal.tokens, cals))
    return out


def best_per_option(cands: list[Candidate], limit_bytes: int) -> list[Candidate]:
    """For each (policy, ZeRO stage, layout): the largest micro-batch whose predicted peak is within ``limit_bytes``."""
    best: dict[tuple[str, int], Candidate] = {}
    for c in cands:
        if c.peak_bytes <= limit_bytes and (c.key not in best or c.config.micro_batch > best[c.key].config.micro_batch):
            best[c.key] = c
    return list(best.values())


def rank(options: list[Candidate]) -> list[Candidate]:
    """Fastest to the token budget first (rounded to 9 digits, so equal figures tie); ties (ZeRO-1/2 move the
    same bytes as DDP) go to the lower ZeRO stage, less recompute, larger micro-batch."""
    return sorted(options, key=lambda c: (float(f"{c.time_to_tokens_seconds:.9g}"), c.config.zero,
                                          c.hardware_flops_per_update, -c.config.micro_batch))


def recommend(ranked: list[Candidate], goal: Goal) -> tuple[Candidate | None, str]:
    """No activation checkpointing if a reasonable micro-batch fits, else the cheapest policy that reaches one;
    if none does, the cheapest option that fits (the formula's time: least recompute)."""
    if not ranked:
        return None, "nothing fits within the margin"
    good = [c for c in ranked if goal.reasonable(c.config)]
    if good:
        return good[0], ("fastest predicted time to the token budget among options with a reasonable micro-batch "
                         f"(>= {goal.min_micro_tokens} tokens or the whole per-rank batch)")
    return ranked[0], (f"no option reaches a micro-batch of {goal.min_micro_tokens} tokens or the whole per-rank "
                       "batch; the fastest predicted option that fits")


def unfit_options(cands: tuple[Candidate, ...], ranked: tuple[Candidate, ...]) -> list[Candidate]:
    """For each (policy, ZeRO stage, layout) with no micro-batch within the margin: its smallest micro-batch."""
    have = {c.key for c in ranked}
    out: dict[tuple[str, int], Candidate] = {}
    for c in cands:
        if c.key not in have and (c.key not in out or c.config.micro_batch < out[c.key].config.micro_batch):
            out[c.key] = c
    return sorted(out.values(), key=lambda c: c.peak_bytes)


@dataclass(frozen=True)
class FitPlan:
    goal: Goal
    candidates: tuple[Candidate, ...]  # every configuration evaluated
    ranked: tuple[Candidate, ...]  # best micro-batch per (policy, ZeRO stage) within the margin, best first
    recommended: Candidate | None
    reason: str
    assumptions: tuple[str, ...] = field(default_factory=tuple)

    @property
    def predictor(self) -> str:
        """How the candidates' figures were obtained: formula, or trace for a factory model."""
        return self.candidates[0].provenance if self.candidates else "formula"

    @property
    def counted(self) -> Counted:
        return self.candidates[0].counted if self.candidates else Counted.TOKENS

    def predicted_limit(self, cfg: RunConfig) -> int | None:
        """Largest micro-batch the prediction says fits the full capacity (no safety margin), at cfg's policy,
        ZeRO stage and layout."""
        key = option_key(cfg)
        fits = [c.config.micro_batch for c in self.candidates
                if c.key == key and c.peak_bytes <= self.goal.capacity_bytes]
        return max(fits) if fits else None


def parameter_bytes_per_rank(goal: Goal) -> int:
    """Stored weights alone (fp32 master under mixed precision), sharded only where ZeRO-3 may be used; a
    factory's counted in its traced update (the formula knows only its stand-in shape)."""
    if goal.base.model_kind is ModelSource.FACTORY:
        cfg = goal.base.replace(zero=max(zero_stages(goal)))
        return _traced_parameter_bytes(cfg.replace(micro_batch=1, accum=1))
    per_layout = (model_states(lay.replace(zero=max(zero_stages(goal, lay.dp)))) for lay in layouts(goal))
    return min(s.master or s.parameters for s in per_layout)  # the layout that splits them most


@functools.lru_cache(maxsize=4)  # the CLI checks before its header, the plan again
def _traced_parameter_bytes(cfg: RunConfig) -> int:
    from batchlab.trace import estimate as trace

    return trace(cfg, calibrations=load_all()).memory.parameters_bytes


def check_capacity(goal: Goal) -> None:
    need = parameter_bytes_per_rank(goal)
    if need > goal.capacity_bytes:
        name = "memory_budget" if goal.base.memory_budget is not None else "device"
        raise ConfigError(name, f"{fmt_bytes(goal.capacity_bytes)} per rank cannot hold the parameters alone "
                                f"({fmt_bytes(need)}, formula); give more memory, more ranks with ZeRO-3 "
                                "(--dp, --allow-zero) or a smaller model")


def assumptions(goal: Goal, est_assumptions: tuple[str, ...], counted: Counted = Counted.TOKENS) -> tuple[str, ...]:
    factory = (f"model {goal.base.model_source} is a factory the formula cannot see inside: every candidate is "
               "traced instead (its own code, one update on fake tensors; time: the per-op model over the ops it "
               "ran, one rank, no communication)",) if goal.base.model_kind is ModelSource.FACTORY else ()
    return est_assumptions + factory + (
        f"safety margin {goal.margin:.0%} of {fmt_bytes(goal.capacity_bytes)} per rank: a candidate fits if its "
        f"predicted peak is <= {fmt_bytes(goal.usable_bytes)}",
        f"ranked by predicted time to {fmt_amount(goal.tokens, counted.value)} (per-op time model: a larger micro-batch runs "
        "fewer, larger ops; ties go to the larger micro-batch)",
        f"reasonable micro-batch: >= {goal.min_micro_tokens} tokens (micro-batch x seq) or the whole per-rank batch",
    )


def plan(goal: Goal, progress: Progress | None = None) -> FitPlan:
    check_capacity(goal)
    cands = enumerate_candidates(goal, progress)
    ranked = rank(best_per_option(cands, goal.usable_bytes))
    rec, why = recommend(ranked, goal)
    # a factory's figures are the trace's: the formula's assumptions are about its stand-in shape
    est_assumptions = () if goal.base.model_kind is ModelSource.FACTORY else estimate(goal.base, load_all()).assumptions
    counted = cands[0].counted if cands else Counted.TOKENS
    return FitPlan(goal, tuple(cands), tuple(ranked), rec, why, assumptions(goal, est_assumptions, counted))


def states_rule_out(goal: Goal) -> bool:
    """True when no candidate can fit: at every ZeRO stage searched, the master weights, gradients and
    optimizer state alone exceed the usable memory.  Every candidate's optimizer phase holds all three
    (formula/memory.py), and its peak is at least that phase's, where the phases are DDP's (not FSDP2's), the
    terms built in (no layer profile), the allocator margin not negative, and the model not a traced factory."""
    base = goal.base
    if (goal.world is not None or base.model_kind is ModelSource.FACTORY or base.model.matching_profile is not None
            or (base.assumptions.allocator_margin or 0.0) < 0):
        return False
    for z in zero_stages(goal):
        s = model_states(base.replace(zero=z))
        if (base.dp > 1 and z >= 2) or s.master + s.gradients + s.optimizer <= goal.usable_bytes:
            return False
    return True


def recommended(goal: Goal) -> Candidate | None:
    """``plan(goal).recommended``, without estimating candidates the model states already rule out."""
    return None if states_rule_out(goal) else plan(goal).recommended
