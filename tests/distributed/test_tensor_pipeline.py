"""Tensor and pipeline parallelism measured on forked gloo ranks (CPU), against one process and hand counts.

One 2-rank job (``ranks`` fixture) builds each layout below in the same ranks (distributed/layouts.py, the build
a measurement uses), runs two updates and keeps the losses, the parameter bytes and, for 1F1B, the tracked memory
of one more update; the single-process references train the unsharded model on the same micro-batches.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from batchlab.config import RunConfig, preset, resolve_model

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# dropout off: a sharded or staged model draws its masks in another order than one process does
BASE = RunConfig(model=preset("tiny"), micro_batch=2, seq=32).replace(dropout=0.0)
_LLAMA, _LLAMA_SOURCE = resolve_model("hf:llama", layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=512)
CASES = {
    "tp": BASE.replace(tp=2, accum=2),
    "tp-sp": BASE.replace(tp=2, sequence_parallel=True),
    "gpipe": BASE.replace(pp=2, accum=2, pp_schedule="gpipe"),
    "1f1b": BASE.replace(pp=2, accum=2, pp_schedule="1f1b"),
    # a Llama-family Hugging Face model (grouped-query attention: 2 query heads and 1 kv head per rank)
    "hf-tp": RunConfig(model=_LLAMA, model_source=_LLAMA_SOURCE, micro_batch=2, seq=32, tp=2, accum=2),
    # its pipeline: the embedding and layer 0 on one stage, layer 1, the final norm and the head on the other
    # (each layer inside its activation-checkpointing wrapper)
    "hf-1f1b": RunConfig(model=_LLAMA, model_source=_LLAMA_SOURCE, micro_batch=2, seq=32, pp=2, accum=2,
                         pp_schedule="1f1b", ac="full"),
    # 4 micro-batches of 4 x 64 tokens, a small vocabulary: the blocks' activations dominate each stage's
    "1f1b-memory": BASE.replace(pp=2, accum=4, micro_batch=4, seq=64, pp_schedule="1f1b", vocab=128),
}
# 4 ranks: data parallelism over tensor / pipeline ranks (gradient all-reduce, FSDP2 on the dp sub-mesh), and
# tensor parallelism inside pipeline stages
CASES_4 = {
    "tp2xdp2": BASE.replace(tp=2, dp=2),
    "fsdp2xtp2": BASE.replace(tp=2, dp=2, zero=3),
    "pp2xdp2": BASE.replace(pp=2, dp=2, accum=2),
    "tp2xpp2": BASE.replace(tp=2, pp=2, accum=2),
}


FUNCTIONAL = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
              "reduce_scatter_tensor": "reduce_scatter"}  # torch's functional collectives, as the formula names them


def _forked_rank(folder: Path, request: dict, parent: int) -> int:
    import torch
    import torch.profiler
    import torch.distributed as dist

    from batchlab.config import to_jsonable
    from batchlab.distributed import engines, layouts, worker

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    out = {}
    for name, cfg in (CASES if request["world"] == 2 else CASES_4).items():
        trainer, _ = layouts.build(cfg, torch.device("cpu"), rank)
        grad_bytes = []

        class Grads:  # after the last backward: the bytes of this rank's gradient shards
            def mark(self, phase):
                if phase == "optimizer":
                    grads = [getattr(p.grad, "_local_tensor", p.grad) for p in trainer.raw_model.parameters()
                             if p.grad is not None]  # the storages they keep alive: a view keeps all of its base
                    grad_bytes.append(sum({id(g.untyped_storage()): g.untyped_storage().nbytes()
                                           for g in grads}.values()))

        losses = [trainer.update(listener=Grads()).loss]
        with torch.profiler.profile() as prof:  # the functional collectives the second update issues, as run
            losses.append(trainer.update(listener=Grads()).loss)
        issued = {k: sum(e.name == f"_c10d_functional::{k}" for e in prof.events()) for k in FUNCTIONAL}
        rec = dict(losses=losses, parameter_bytes=engines.shard_bytes(trainer.raw_model), grad_bytes=grad_bytes,
                   issued=issued)
        if name == "1f1b-memory":
            rec["memory"] = to_jsonable(worker.measure_memory(trainer, None))
        out[name] = rec
    (folder.parent / f"result{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    os._exit(0)


def _job(tmp_path_factory, world: int) -> list[dict]:
    from batchlab.distributed import forked
    from batchlab.measure.runner import child_env

    out = tmp_path_factory.mktemp(f"layouts{world}")
    run = forked.run(world, f"{__name__}:_forked_rank", dict(world=world), out,
                     dict(child_env(), OMP_NUM_THREADS="1"), 240)
    assert run is not None and not run.timed_out and set(run.codes.values()) == {0}, run and run.log[-3000:]
    return [json.loads((out / f"result{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _job(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def ranks4(tmp_path_factory):
    return _job(tmp_path_factory, 4)


def _single_losses(cfg: RunConfig) -> list[float]:
    """Two updates of the unsharded model in one process on the micro-batches all data-parallel ranks drew (the
    Trainer seeds rank k's data with k)."""
    from batchlab.measure.harness import Trainer

    plain = cfg.replace(tp=1, pp=1, sequence_parallel=False, dp=1)
    sources = [Trainer(plain, "cpu", rank=k) for k in range(cfg.dp)]
    trainer = Trainer(plain.replace(accum=cfg.accum * cfg.dp), "cpu")
    trainer.batches = lambda: [b for source in sources for b in source.batches()]
    return [trainer.update().loss for _ in range(2)]


@pytest.mark.parametrize("name", ["tp", "tp-sp", "gpipe", "1f1b", "hf-tp", "hf-1f1b"])
def test_a_sharded_or_staged_update_trains_like_one_process(ranks, name):
    """The loss of the first update and the loss after one optimizer step (on the next micro-batches) equal the
    unsharded model's: the sharded forward, its gradients, their norm and the step are the same."""
    reference = _single_losses(CASES[name])
    for r in ranks:
        assert r[name]["losses"] == pytest.approx(reference, rel=1e-5), (name, r[name]["losses"], reference)


@pytest.mark.parametrize("name", list(CASES_4))
def test_four_rank_layouts_train_like_one_process(ranks4, name):
    """Each data-parallel replica's loss is its own micro-batches' mean; their mean is the global batch's, and
    after the step it still equals one process's on the global batch (TP2 x PP2: one replica)."""
    cfg = CASES_4[name]
    reference = _single_losses(cfg)
    replicas = [[r[name]["losses"][i] for r in ranks4] for i in range(2)]
    assert [sum(x) / len(x) for x in replicas] == pytest.approx(reference, rel=1e-5), (name, replicas, reference)
    # every rank keeps its gradients sharded like its parameters (the first stage's vocabulary-split embedding
    # too, whose backward alone gives a whole gradient)
    assert all(r[name]["grad_bytes"] == [r[name]["parameter_bytes"]] * 2 for r in ranks4)
    if name == "fsdp2xtp2":  # FSDP2 halves what each tensor-parallel rank holds (every dimension 0 is even)
        assert all(r[name]["parameter_bytes"] == _tp2_bytes() // 2 for r in ranks4)


@pytest.mark.parametrize("name", ["tp", "tp-sp", "hf-tp"])
def test_the_tensor_parallel_collectives_a_real_update_issues_are_the_formulas(ranks, name):
    """Every functional collective each rank's update issued on real gloo ranks (DTensor's redistributions,
    loss_parallel's, the norms' gradients; separate q/k/v and a gated MLP in the Llama), by kind: the formula's
    count per micro-batch (formula/pipeline.py ``tp_collectives``) times the micro-batches."""
    from batchlab.formula.pipeline import tp_collectives
    from batchlab.formula.ranks import shares

    cfg = CASES[name]
    want: dict[str, int] = {}
    for (kind, _), (calls, _) in tp_collectives(cfg, shares(cfg)[0]).items():
        want[kind] = want.get(kind, 0) + calls * cfg.accum
    for r in ranks:
        issued = {FUNCTIONAL[k]: n for k, n in r[name]["issued"].items() if n}
        assert issued == want, (name, issued, want)


def _tp2_bytes() -> int:
    """A TP2 rank's parameter bytes, counted by hand from the tiny model's shapes."""
    m = BASE.model
    h, v, f = m.hidden, m.vocab, m.ffn
    per_block = dict(norms=2 * 2 * h, qkv=3 * h * h + 3 * h, proj=h * h + h, up=f * h + f, down=h * f + h)
    total = v * h + m.max_positions * h + m.layers * sum(per_block.values()) + 2 * h  # tied head, final norm
    # column-wise qkv and up: weight and bias split; row-wise proj and down: weight split, bias replicated; the
    # tied embedding / head split over the vocabulary; learned positions and norms replicated
    split = m.layers * (3 * h * h + 3 * h + h * h + f * h + f + h * f) + v * h
    return 4 * (total - split // 2)


def test_tp2_rank_holds_half_the_split_matrices_and_the_replicated_rest(ranks):
    assert BASE.model.tied_embeddings and BASE.model.vocab % 2 == 0
    assert [r["tp"]["parameter_bytes"] for r in ranks] == [_tp2_bytes()] * 2
    # and the gradients are kept sharded like their parameters (the vocabulary-split embedding's too)
    assert [r["tp"]["grad_bytes"] for r in ranks] == [[_tp2_bytes()] * 2] * 2


def test_pp2_stages_hold_their_own_layers(ranks):
    m = BASE.model
    block = 2 * 2 * m.hidden + 4 * m.hidden * m.hidden + 4 * m.hidden + 2 * m.ffn * m.hidden + m.ffn + m.hidden
    first = 4 * (m.vocab * m.hidden + m.max_positions * m.hidden + 2 * block)
    last = 4 * (2 * block + 2 * m.hidden + m.vocab * m.hidden)  # final norm, the head's (tied) weight
    assert [r["gpipe"]["parameter_bytes"] for r in ranks] == [first, last]


def test_1f1b_first_stage_holds_more_activations_than_the_last(ranks):
    """1F1B keeps pp - stage micro-batches in flight: 2 on the first stage, 1 on the last (measured, at each
    rank's peak; the last stage's extra is its LM head's logits, small with this vocabulary)."""
    cfg = CASES["1f1b-memory"]
    assert [cfg.parallel.in_flight(s, cfg.accum) for s in (0, 1)] == [2, 1]
    first, last = (r["1f1b-memory"]["memory"] for r in ranks)
    assert first["breakdown"]["activations"] > 1.6 * last["breakdown"]["activations"], (first, last)
    assert first["peak_bytes"] > last["peak_bytes"]


def _measure(*args: str):
    import typer.main
    from typer.testing import CliRunner

    from batchlab.cli import app

    named = hasattr(typer.main.get_command(app), "commands")
    return CliRunner().invoke(app, (["measure"] if named else []) + list(args), env={"COLUMNS": "200"})


def test_measure_reports_every_ranks_peak_and_time_with_its_coordinates():
    """``measure --tp 2 --pp 2``: 4 forked ranks; the merged run is its most loaded rank, every rank in the table."""
    import batchlab.distributed

    launched, real = [], batchlab.distributed.launch

    def spy(*args, **kwargs):
        launched.append(real(*args, **kwargs))
        return launched[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batchlab.distributed, "launch", spy)
        res = _measure("--tp", "2", "--pp", "2", "--accum", "2", "--micro-batch", "2", "--seq", "32", "--warmup", "1",
                       "--steps", "1", "--no-calibrate", "--no-progress")
    assert res.exit_code == 0, res.output[-3000:]
    m = launched[0]
    assert m.ok and m.environment["world_size"] == 4
    assert [(r.rank, r.dp, r.tp, r.pp) for r in m.ranks] == [(0, 0, 0, 0), (1, 0, 1, 0), (2, 0, 0, 1), (3, 0, 1, 1)]
    assert m.memory.peak_bytes == max(r.peak_bytes for r in m.ranks) > 0
    assert all(r.update_seconds_median > 0 and r.provenance == "allocator" for r in m.ranks)
    # tensor-parallel peers hold equal shards; the stages differ (embedding vs final norm + head)
    assert m.ranks[0].parameter_bytes == m.ranks[1].parameter_bytes != m.ranks[2].parameter_bytes
    assert "rank  dp  tp  pp  peak (allocator)" in res.output
    assert "gradient_as_bucket_view" not in res.output
    # each row's formula column is its own pipeline stage's peak, not the most loaded stage's
    from batchlab.cli.common import config_from_command
    from batchlab.formula import memory
    from batchlab.util.units import fmt_bytes

    cfg = config_from_command(["measure", "--tp", "2", "--pp", "2", "--accum", "2", "--micro-batch", "2", "--seq", "32"])
    stages = {r.stage: fmt_bytes(r.peak_bytes - r.parts.get("allocator", 0)) for r in memory(cfg).ranks}
    rows = {int(line.split()[0]): line.split()[-2:] for line in res.output.splitlines()
            if line.strip()[:1].isdigit() and len(line.split()) > 8}
    assert " ".join(rows[0]) == stages[0] and " ".join(rows[2]) == stages[1] != stages[0]


@pytest.mark.parametrize("args, field", [
    (["--tp", "2", "--impl", "hf"], "tp"),  # the HF class of the preset: its layers are not split here
    (["--tp", "2", "--dp", "40"], "nproc"),  # 80 local ranks
    (["--tp", "2", "--dp", "2", "--zero", "1"], "zero"),
    (["--pp", "2", "--accum", "2", "--loss", "chunked:4"], "loss"),
])
def test_layouts_not_measured_are_one_line_exit_2(args, field):
    res = _measure(*args, "--no-calibrate", "--no-progress")
    assert res.exit_code == 2, res.output[-2000:]
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and field in lines[0], res.output
