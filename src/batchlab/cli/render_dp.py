"""Plain-text lines for a DP measurement: the engine, memory per rank, the collectives.  Torch-free."""
from __future__ import annotations

from batchlab.distributed.launcher import Launcher
from batchlab.measure.result import MeasuredTraffic, Measurement
from batchlab.formula.opcost import link_text
from batchlab.util.units import fmt_bytes, fmt_seconds

_KIND_NAMES = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce",
               "broadcast": "broadcast"}


def memory_lines(m: Measurement) -> list[str]:
    mem = m.memory
    if mem is None or not mem.per_rank_peak_bytes:
        return []
    ranks = ", ".join(f"rank {k} {fmt_bytes(b)}" for k, b in enumerate(mem.per_rank_peak_bytes))
    out = [f"peak memory per rank ({mem.provenance}): {ranks}; max {fmt_bytes(mem.peak_bytes)}, "
           f"spread {fmt_bytes(mem.rank_spread_bytes)}"]
    t = m.traffic
    if t is not None and mem.breakdown.get("parameters", 0) > t.parameter_shard_bytes:
        out.append(f"parameters at the peak: {fmt_bytes(t.parameter_shard_bytes)} this rank's shards + "
                   f"{fmt_bytes(mem.breakdown['parameters'] - t.parameter_shard_bytes)} gathered working copies")
    if m.environment.get("gradient_as_bucket_view") and (t is None or t.engine in ("ddp", "zero1")):
        out.append("DDP gradient_as_bucket_view is on: gradients are views into the all-reduce buckets "
                   "(one gradient copy less than .grad + bucket)")
    return out


RANK_ROWS = 8  # the text table's rows; --json has every rank


def rank_lines(m: Measurement, formula_peaks: dict[int, int] | None = None) -> list[str]:
    """Every rank's own peak (allocator) and median update time (wall-clock) with its dp / tp / pp coordinates,
    beside the formula's peak of the rank's pipeline stage (``formula_peaks``: {stage: tensor bytes}); empty for
    one rank."""
    if len(m.ranks) < 2:
        return []
    peaks = formula_peaks or {}
    out = [f"{'rank':>4} {'dp':>3} {'tp':>3} {'pp':>3}  {'peak (allocator)':>16}  {'at':<9}  {'update (wall-clock)':>19}"
           f"  {'formula peak':>12}"]
    for r in m.ranks[:RANK_ROWS]:
        peak = fmt_bytes(r.peak_bytes) if r.peak_bytes is not None else "-"
        time = fmt_seconds(r.update_seconds_median) if r.update_seconds_median is not None else "-"
        formula = fmt_bytes(peaks[r.pp]) if r.pp in peaks else "-"
        out.append(f"{r.rank:>4} {r.dp:>3} {r.tp:>3} {r.pp:>3}  {peak:>16}  {r.peak_phase or '-':<9}  {time:>19}"
                   f"  {formula:>12}")
    if len(m.ranks) > RANK_ROWS:
        out.append(f"... {len(m.ranks) - RANK_ROWS} more ranks (--json has all)")
    out.append("peak of the run = the most loaded rank's; update time = each update's slowest rank")
    return out


def _kinds(d: dict[str, int]) -> str:
    return ", ".join(f"{_KIND_NAMES[k]} {fmt_bytes(v)}" for k, v in d.items() if v) or "none"


def traffic_lines(t: MeasuredTraffic | None, verbose: bool = True) -> list[str]:
    """The engine, its accumulation semantics, and every collective counted beside the formula's (per
    micro-batch: ``verbose``)."""
    if t is None:
        return []
    verdict = "equal to the formula's" if t.matches_formula else "DIFFERENT from the formula's"
    out = [f"engine: {t.engine} = {t.api}", f"accumulation: {t.accumulation}",
           f"collectives per update ({t.provenance}): {_kinds(t.per_update)}; formula: "
           f"{_kinds(t.predicted_per_update)} ({verdict}, per micro-batch too)"]
    if not verbose:
        return out
    for i, (seen, predicted) in enumerate(zip(t.per_micro_batch, t.predicted_per_micro_batch)):
        out.append(f"  micro-batch {i + 1}: {_kinds(seen)}" + ("" if seen == predicted else
                                                                f"  (formula: {_kinds(predicted)})"))
    if any(t.outside_micro_batches.values()):
        out.append(f"  optimizer step: {_kinds(t.outside_micro_batches)}")
    if t.bookkeeping_calls:
        out.append(f"  plus {t.bookkeeping_calls} one-element collective(s) ({fmt_bytes(t.bookkeeping_bytes)}): the "
                   "global useful-token count" + ("; DTensor's own one-element all-reduce of the sharded gradients' "
                   "norm runs inside DTensor dispatch and is not counted" if t.engine.startswith("fsdp") else ""))
    return out


def comm_lines(m: Measurement) -> list[str]:
    c = m.comm
    if c is None:
        return []
    rounds = "once" if c.rounds_per_update == 1 else f"{c.rounds_per_update} times"
    out = [f"gradient all-reduce ({c.backend}, {c.world_size} ranks): {rounds} per optimizer update, "
           f"{c.calls_per_update} bucket(s), {fmt_bytes(c.bytes_per_update)} per update (counted by a DDP comm hook)"]
    if c.seconds:
        predicted = f"; {c.predicted_provenance}"
        if c.predicted_seconds is not None:
            predicted += f": {fmt_seconds(c.predicted_seconds)}"
            if c.predicted_bytes is not None and c.predicted_bandwidth_bytes_per_s:
                predicted += (f" (ring 2(n-1)/n x {fmt_bytes(c.predicted_bytes)} over "
                              f"{link_text(c.predicted_bandwidth_bytes_per_s)})")
        out.append(f"all-reduce time per update (median, wall-clock via comm hook, approximate): "
                   f"{fmt_seconds(c.seconds_median)}{predicted}; compute (update minus all-reduce): "
                   f"{fmt_seconds(c.compute_seconds_median)}")
    if c.scope:
        out.append(f"scope: {c.scope}")
    return out


def formula_lines(m: Measurement) -> list[str]:
    """The formula's per-rank parts at its peak, and what the other FSDP2 accumulation choice would cost."""
    from batchlab.config import config_from_dict
    from batchlab.formula import memory
    from batchlab.formula.sharding import traffic, unsharded_gradient_bytes

    if m.memory is None or m.traffic is None:
        return []
    cfg = config_from_dict(m.config)
    est = memory(cfg)
    parts = "  ".join(f"{k} {fmt_bytes(v)}" for k, v in est.at_peak.items() if v)
    out = [f"formula per rank at its peak ({est.peak_phase}, {fmt_bytes(est.peak_tensor_bytes)}): {parts}"]
    if cfg.parallel.engine_spec.stage == 1 and cfg.precision.mixed:
        out.append("note: the formula's ZeRO-1 mixed precision is ZeRO's (DeepSpeed's: 16-bit weights and gradients, "
                   "fp32 master sharded); the engine measured here, DDP + ZeroRedundancyOptimizer under autocast, "
                   "keeps fp32 weights and gradients on every rank and shards only the optimizer state")
    if cfg.parallel.engine_spec.shards_gradients and cfg.accum > 1:
        saved = traffic(cfg).per_update["reduce_scatter"] - traffic(cfg, False).per_update["reduce_scatter"]
        full = unsharded_gradient_bytes(cfg)
        kept = f"{fmt_bytes(full)} instead of its {fmt_bytes(full // cfg.dp)} shard: +{fmt_bytes(full - full // cfg.dp)} per rank"
        out.append(f"the other choice, set_requires_gradient_sync(False) on micro-batches 1..{cfg.accum - 1}: "
                   f"{fmt_bytes(saved)} less reduce-scatter per update, but every rank keeps the unsharded "
                   f"gradient ({kept}) between micro-batches (formula)" if m.traffic.sync_every_micro_batch else
                   f"the other choice, a reduce-scatter after every micro-batch: {fmt_bytes(saved)} more traffic per "
                   f"update, and no unsharded gradient ({kept}) kept between micro-batches (formula)")
    return out


def launcher_lines(m: Measurement) -> list[str]:
    env = m.environment
    if "nproc_per_node" not in env:
        return []
    how = "started by torchrun" if env.get("launcher") == Launcher.TORCHRUN.value else env.get("launcher", "?")
    return [f"ranks: {env['nproc_per_node']} on this node of {env.get('world_size', '?')}, {how}"]


def lines(m: Measurement, verbose: bool = True) -> list[str]:
    """Everything DP-specific a report prints; empty for a one-process measurement.  Without ``verbose`` the
    formula's per-rank parts and the per-micro-batch collectives are left out."""
    return (launcher_lines(m) + memory_lines(m) + (formula_lines(m) if verbose else [])
            + traffic_lines(m.traffic, verbose) + comm_lines(m))
