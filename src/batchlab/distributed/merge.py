"""Per-rank results -> one Measurement.  Torch-free.

- Memory: the rank with the highest peak stands for the run (a rank OOMs on its own peak); every rank's
  peak is kept (``per_rank_peak_bytes``) with its spread.
- Time: an update is as slow as its slowest rank, so each update's time (and its compute / all-reduce
  split) comes from the rank that was slowest in that update.
- Useful tokens: summed over ranks (each rank trains on distinct data).
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from batchlab.config import RunConfig
from batchlab.distributed.measurable import applies
from batchlab.measure import unexpressed
from batchlab.measure.result import (MeasuredComm, MeasuredMemory, MeasuredTime, MeasuredTraffic, Measurement,
                                     Outcome, RankFigures, memory_from_dict)

SCOPE = ("Data parallelism measured on this machine's ranks and link; loopback gloo on CPU says nothing "
         "about NCCL over NVLink or InfiniBand.")


def predicted_allreduce(cfg: RunConfig) -> dict[str, Any]:
    """The calculator's all-reduce for ``cfg`` (time, bytes, link), as MeasuredComm's predicted_* fields."""
    try:
        from batchlab.cache.calibrations import load_all
        from batchlab.formula import estimate

        t = estimate(cfg, load_all()).time
    except Exception as exc:  # noqa: BLE001 - a failing prediction must not discard a finished measurement
        return dict(predicted_provenance=f"formula unavailable ({type(exc).__name__}: {exc})"[:200])
    return dict(predicted_seconds=t.allreduce_seconds, predicted_bytes=t.allreduce_bytes,
                predicted_bandwidth_bytes_per_s=t.bandwidth_bytes_per_s, predicted_provenance="formula")


def _memory(ranks: list[dict[str, Any]]) -> MeasuredMemory | None:
    mems = [r.get("memory") for r in ranks]
    if any(m is None for m in mems):
        return None
    top = max(mems, key=lambda m: m["peak_bytes"])
    return replace(memory_from_dict(top), per_rank_peak_bytes=[m["peak_bytes"] for m in mems])


def _slowest(ranks: list[dict[str, Any]], i: int) -> dict[str, Any]:
    return max(ranks, key=lambda r: r["samples"][i])


def _time(ranks: list[dict[str, Any]]) -> MeasuredTime | None:
    if any("samples" not in r for r in ranks):
        return None
    n = min(len(r["samples"]) for r in ranks)
    slow = [_slowest(ranks, i) for i in range(n)]
    samples = [r["samples"][i] for i, r in enumerate(slow)]
    phase_samples: dict[str, list[float]] = {}
    for i, r in enumerate(slow):
        for phase, sec in r["phase_seconds"][i].items():
            phase_samples.setdefault(phase, []).append(sec)
    reads = [r.get("probe_seconds") or [] for r in ranks]  # the host speed probe: the ranks' mean per update
    probe = [statistics.fmean(x[i] for x in reads) for i in range(n)] if all(len(x) >= n for x in reads) else []
    return MeasuredTime(samples=samples, cpu_seconds=[r["cpu_seconds"][i] for i, r in enumerate(slow)],
                        phase_samples=phase_samples,
                        phase_seconds={p: statistics.median(v) for p, v in phase_samples.items()},
                        warmup=ranks[0]["warmup"], probe_seconds=probe)


def _comm(cfg: RunConfig, ranks: list[dict[str, Any]]) -> MeasuredComm | None:
    if any("comm" not in r for r in ranks):
        return None
    n = min(len(r["samples"]) for r in ranks)
    slow = [_slowest(ranks, i) for i in range(n)]
    comm = [r["comm"]["seconds"][i] for i, r in enumerate(slow)]
    first = ranks[0]["comm"]
    return MeasuredComm(world_size=len(ranks), backend=ranks[0]["backend"],
                        calls_per_update=max(first["calls"]), rounds_per_update=max(first["rounds"]),
                        bytes_per_update=max(first["bytes"]), seconds=comm,
                        compute_seconds=[max(0.0, r["samples"][i] - c) for i, (r, c) in enumerate(zip(slow, comm))],
                        scope=SCOPE, **predicted_allreduce(cfg))


def _traffic(cfg: RunConfig, ranks: list[dict[str, Any]]) -> MeasuredTraffic | None:
    """Rank 0's collectives (every rank issues the same ones) beside the formula's."""
    from batchlab.formula.sharding import traffic

    first = ranks[0]
    if "traffic" not in first:
        return None
    t, engine = first["traffic"], first["engine"]
    predicted = traffic(cfg, engine["sync_every_micro_batch"])
    return MeasuredTraffic(engine=engine["name"], api=engine["engine"], accumulation=engine["accumulation"],
                           per_update=t["per_update"], calls_per_update=t["calls_per_update"],
                           per_micro_batch=t["per_micro_batch"], outside_micro_batches=t["outside_micro_batches"],
                           bookkeeping_calls=t["bookkeeping_calls"], bookkeeping_bytes=t["bookkeeping_bytes"],
                           parameter_shard_bytes=max(r["parameter_shard_bytes"] for r in ranks),
                           sync_every_micro_batch=engine["sync_every_micro_batch"],
                           predicted_per_update=predicted.per_update,
                           predicted_per_micro_batch=list(predicted.per_micro_batch))


def _ranks(ranks: list[dict[str, Any]]) -> list[RankFigures]:
    """Every rank's own peak and median update time, with its coordinates in the layout."""
    out = []
    for r in ranks:
        mem, where = r.get("memory") or {}, r.get("coordinates") or {}
        out.append(RankFigures(rank=r["rank"], dp=where.get("dp", r["rank"]), tp=where.get("tp", 0),
                               pp=where.get("pp", 0), peak_bytes=mem.get("peak_bytes"),
                               peak_phase=mem.get("peak_phase"),
                               update_seconds_median=statistics.median(r["samples"]) if r.get("samples") else None,
                               parameter_bytes=r.get("parameter_shard_bytes"),
                               provenance=mem.get("provenance", "allocator")))
    return out


def _consistency_warnings(ranks: list[dict[str, Any]]) -> list[str]:
    warnings = []
    for r in ranks:
        c = r.get("comm")
        if c and (set(c["rounds"]) != {1} or not c["last_micro_batch_only"]):
            warnings.append(f"rank {r['rank']}: gradients were all-reduced in {sorted(set(c['rounds']))} backward "
                            "passes per update, expected exactly one (the last micro-batch's)")
    return warnings


def merge(cfg: RunConfig, ranks: list[dict[str, Any]], environment: dict[str, Any] | None = None) -> Measurement:
    """One Measurement of a DP run from every rank's result (rank order)."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    layered = applies(cfg)  # tensor / pipeline ranks
    # the formula's collectives are the data-parallel engines'; tensor / pipeline ranks send others
    time_, comm, traffic = _time(ranks), _comm(cfg, ranks), None if layered else _traffic(cfg, ranks)
    useful = tps = None
    warnings = _consistency_warnings(ranks)
    warnings += unexpressed.warnings(cfg)
    if time_ is not None:
        # as measure.session does it: mean useful tokens per update (all ranks) / median update time
        per_update = statistics.fmean(sum(r["useful_tokens"][i] for r in ranks) for i in range(len(time_.samples)))
        useful, tps = round(per_update), per_update / time_.update_seconds_median
        if (noisy := time_.noise_warning()) is not None:
            warnings.append(noisy)
    env = dict(ranks[0].get("environment", {}))
    env.update(environment or {})
    env.update(world_size=len(ranks), backend=ranks[0]["backend"], device=ranks[0]["device"],
               torch=ranks[0]["torch"], threads_per_rank=ranks[0]["threads"],
               hosts=sorted({r["host"] for r in ranks}), layout=cfg.parallel.text(), scope=SCOPE,
               gradient_as_bucket_view=not layered and not cfg.parallel.fsdp)
    if all("page_faults_per_update" in r for r in ranks):  # host pages mapped afresh per update, worst rank
        env["page_faults_per_update"] = max(r["page_faults_per_update"] for r in ranks)
    return Measurement(config=cfg.to_dict(), outcome=Outcome.OK, global_batch=cfg.global_batch,
                       memory=_memory(ranks), time=time_, tokens_per_second=tps, useful_tokens_per_update=useful,
                       environment=env, warnings=warnings, comm=comm, traffic=traffic, ranks=_ranks(ranks))
