"""The PyTorch script `fit` prints runs as printed, where only torch is installed: DP = 1 with no process group or
torchrun environment, DP = 2 with torchrun's (2 ranks, gloo, CPU) for DDP, ZeRO-1 (ZeroRedundancyOptimizer),
ZeRO-2 and ZeRO-3 (FSDP2 fully_shard).  The script reads nothing of torchrun but its variables (rank, world,
store address), so its ranks are forks of batchlab's pre-imported process given them, as batchlab's own DP
ranks are on CPU; torchrun itself is launched in distributed/test_ddp_on_gloo.py and util/test_lifeline.py."""
from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

from batchlab.advise.snippets import all_snippets
from batchlab.advise.torch_script import STAND_IN_BEGIN, STAND_IN_END, training_script
from batchlab.config import ACPolicy, RunConfig, preset
from script_run import run_in_turn

pytest.importorskip("torch")


def config(dp: int = 1, zero: int = 0, precision: str = "fp32", ac: str = "none", optimizer: str = "adamw",
           accum: int = 2) -> RunConfig:
    return RunConfig(model=preset("tiny", layers=4, attention="sdpa"), seq=16, micro_batch=2, accum=accum, dp=dp, zero=zero,
                     precision=precision, ac=ACPolicy.parse(ac), optimizer=optimizer)


def updates_printed(output: str) -> list[int]:
    return [int(line.split()[1].rstrip(":")) for line in output.splitlines() if line.startswith("update ")]


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


class _NoBatchlab:
    """A meta-path finder that refuses batchlab: the printed script must run where only torch is installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "batchlab" or name.startswith("batchlab."):
            raise ImportError(f"the printed script imported {name}")
        return None


# torchrun's variables a plain `python train.py` does not have (forked.rank_env's, and torchelastic's)
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _forked_rank(folder: Path, request: dict, parent: int) -> int:
    """One rank (forked.run's entry, with torchrun --standalone's environment): the printed scripts run in turn,
    each as __main__ in a fresh namespace, with batchlab hidden (its modules out of sys.modules, its import
    refused).  Rank 0 first runs the DP = 1 scripts with torchrun's variables taken away, as `python train.py`
    runs them (rank 1 meanwhile waits in the first rendezvous); then both ranks the DP = 2 scripts.  Each must
    leave no process group behind, and each after the first rendezvouses on a store of its own (rank 0 serves
    it on the first port + i): a re-made default group reuses the first one's store keys, and gloo then read a
    peer's stale address now and then (connection reset).  Rank 0's output, each script named, goes to
    out0.txt."""
    import runpy

    import torch.distributed as dist

    rank = os.environ["RANK"]
    fd = os.open(folder.parent / f"out{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    hidden = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "batchlab" or k.startswith("batchlab.")}
    sys.meta_path.insert(0, _NoBatchlab())
    try:
        if rank == "0":
            torchrun_env = {k: os.environ.pop(k) for k in TORCHRUN_VARS}
            for p in request["dp1"]:
                print("== " + p, flush=True)
                runpy.run_path(p, run_name="__main__")
                assert not dist.is_initialized(), "a DP = 1 script made a process group"
            os.environ.update(torchrun_env)
            print("== --plain", flush=True)
        first = int(os.environ["MASTER_PORT"])
        for i, p in enumerate(request["dp2"]):
            assert not dist.is_initialized(), "a process group left over from the previous script"
            os.environ["MASTER_PORT"] = str(first + i)
            if rank == "0":
                print("== " + p, flush=True)
            runpy.run_path(p, run_name="__main__")
        sys.stdout.flush()
    finally:
        sys.meta_path.remove(next(f for f in sys.meta_path if isinstance(f, _NoBatchlab)))
        sys.modules.update(hidden)
    return 0


OWN_MODEL = '''\
class Own(torch.nn.Module):  # the user's model: a list of blocks under .layers, dropout inside
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(100, 24)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(24, 24), torch.nn.Dropout(0.1))
                                          for _ in range(3))
        self.out = torch.nn.Linear(24, 100)

    def forward(self, x):
        h = self.embed(x)
        for block in self.layers:
            h = h + block(h)
        return self.out(h)


model = Own()
data = torch.randint(100, (MICRO_BATCH * ACCUM * DP * UPDATES, SEQ + 1))
dataset = TensorDataset(data[:, :-1], data[:, 1:])


def loss_fn(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
'''


PLAN = "plan:full,selective-op,megatron-selective,none"  # a per-layer plan as fit --ac auto writes it
DP2 = [config(dp=2, zero=0), config(dp=2, zero=1, precision="bf16-mixed", ac="full"),
       config(dp=2, zero=2, ac="selective-op"), config(dp=2, zero=3, precision="bf16-fsdp", ac="every:2"),
       config(dp=2, zero=3, ac=PLAN)]  # fit --ac auto plans under FSDP2 too


def dp1_scripts() -> list[str]:
    """The script as `fit` prints it at DP = 1 (first), every precision and policy at DP = 1, and the marked
    stand-in replaced by a model of the test's own (the documented placeholder), as a user would."""
    script = training_script(config(ac="every:2"))
    scripts = [script] + [training_script(config(precision=p, ac=ac, optimizer=o))
                          for p, ac, o in (("bf16-mixed", "selective", "sgd-momentum"), ("fp16-mixed", "full", "sgd"),
                                           ("bf16", "selective-op", "adamw"), ("bf16-fsdp", "megatron-selective", "adamw"),
                                           ("bf16-mixed", PLAN, "adamw"))]
    head, rest = script.split(STAND_IN_BEGIN)
    return scripts + [head + OWN_MODEL + rest.split(STAND_IN_END)[1]]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """One 2-rank job (forks of the pre-imported process with torchrun --standalone's environment, as batchlab's
    own DP measurement runs its ranks; torchrun itself is launched in distributed/test_ddp_on_gloo.py and
    util/test_lifeline.py) running, in rank 0, the DP = 1 scripts with no torchrun environment, then in both
    ranks the DP = 2 scripts of DP2 in turn.  (The DP = 2 paths, the DP = 1 paths, the Ranks, rank 0's output
    per script by path.)"""
    from batchlab.distributed import forked
    from batchlab.measure.runner import child_env

    tmp = tmp_path_factory.mktemp("scripts")
    dp2 = [str(write(tmp, f"train_dp2_{i}.py", training_script(cfg))) for i, cfg in enumerate(DP2)]
    dp1 = [str(write(tmp, f"train_dp1_{i}.py", s)) for i, s in enumerate(dp1_scripts())]
    out = tmp / "job"
    out.mkdir()
    ranks = forked.run(2, f"{__name__}:_forked_rank", dict(dp1=dp1, dp2=dp2), out,
                       dict(child_env(), OMP_NUM_THREADS="1"), 240)
    assert ranks is not None, "no pre-imported process to fork ranks from"
    printed = (out / "out0.txt").read_text() if (out / "out0.txt").exists() else ""
    return dp2, dp1, ranks, printed, printed.split("== ")[1:]


@pytest.mark.slow
@pytest.mark.distributed  # its scripts run in rank 0 of the shared 2-rank job
def test_dp1_scripts_precisions_policies_and_the_users_own_model_run(ran):
    """The script as `fit` prints it at DP = 1 (the bug: DistributedSampler and model.no_sync() crashed without a
    process group / DDP); every precision and policy at DP = 1; and the marked stand-in replaced by a model of
    the test's own, as a user would.  They run in turn in one interpreter, before any process group."""
    assert all_snippets(config(ac="every:2"))["pytorch"] == dp1_scripts()[0]
    _, dp1, ranks, printed, outputs = ran
    assert not ranks.timed_out and set(ranks.codes.values()) == {0}, printed + ranks.log
    assert [o.split()[0] for o in outputs[:len(dp1) + 1]] == [*dp1, "--plain"], printed
    for text in outputs[:len(dp1)]:
        assert updates_printed(text) == [1, 2], text


@pytest.mark.slow
@pytest.mark.distributed
def test_dp2_scripts_run_through_torchrun(ran):
    """DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (and ZeRO-3 with a per-layer plan) at DP = 2 with accumulation 2, in ranks
    with the environment the launch line in the script's own comment gives them (one job runs the five in turn)."""
    for cfg in DP2:
        launch = next(line for line in training_script(cfg).splitlines() if line.startswith("# launch: "))
        assert launch == "# launch: python -m torch.distributed.run --standalone --nproc-per-node 2 train.py"
    dp2, dp1, ranks, printed, outputs = ran
    assert not ranks.timed_out and set(ranks.codes.values()) == {0}, printed + ranks.log
    assert [o.split()[0] for o in outputs[len(dp1) + 1:]] == dp2, printed
    for cfg, text in zip(DP2, outputs[len(dp1) + 1:]):
        assert updates_printed(text) == [1, 2], (cfg.zero, text)  # rank 0 alone prints


def test_each_zero_stage_uses_its_pytorch_api():
    """What runs above, named: no DDP no_sync under FSDP2, no process group at DP = 1."""
    one = training_script(config())
    for absent in ("DistributedSampler", "no_sync", "init_process_group", "DDP("):
        assert absent not in one, absent
    ddp, z1, z2, z3 = (training_script(config(dp=2, zero=z)) for z in range(4))
    assert "model.no_sync()" in ddp and "ZeroRedundancyOptimizer" not in ddp and "fully_shard" not in ddp
    assert "ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW" in z1
    for text, reshard in ((z2, False), (z3, True)):
        assert f"fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward={reshard})" in text
        assert "set_requires_gradient_sync(last)" in text
        assert "no_sync" not in text and "DDP(" not in text


def test_script_is_valid_python_for_every_printed_combination():
    for dp, zero in ((1, 0), (2, 0), (2, 1), (2, 2), (2, 3)):
        for precision in ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "bf16-fsdp"):
            for ac in ("none", "full", "every:2", "selective", "selective-op", "megatron-selective", "selective-attn",
                       PLAN):
                ast.parse(training_script(config(dp=dp, zero=zero, precision=precision, ac=ac)))


def test_multi_node_launch_line():
    cfg = RunConfig(model=preset("tiny"), micro_batch=1, accum=1, dp=16, zero=3, device="h100-sxm")
    assert "--nnodes 2 --nproc-per-node 8" in training_script(cfg)


def _plan_probe() -> str:
    script = training_script(config(ac=PLAN))
    assert "PLAN = ['full', 'selective-op', 'megatron-selective', 'none']" in script
    return script + "\nprint('wrapped', [type(b).__name__ == 'Checkpointed' for b in model.layers], " \
                    "[getattr(b, 'context_fn', 0) is None for b in model.layers])\n"


def _in_backward_probe() -> str:
    script = training_script(config(accum=1).replace(optimizer_in_backward=True))
    assert "register_post_accumulate_grad_hook(step_in_backward)" in script and "optimizer.step()" not in script
    probe = script.replace("for step, (x, y) in enumerate(loader):",
                           "before = [p.detach().clone() for p in model.parameters()]\n"
                           "for step, (x, y) in enumerate(loader):")
    return probe + ("\nprint('grads left', sum(p.grad is not None for p in model.parameters()))"
                    "\nprint('moved', all(not torch.equal(a, p) for a, p in zip(before, model.parameters())))\n")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """The two probed scripts below run as printed in one fresh interpreter (torch only, imported once for both):
    (the process, each script's output by name)."""
    return run_in_turn(tmp_path_factory.mktemp("fresh"), {"train_plan": _plan_probe(),
                                                          "train_inbwd": _in_backward_probe()})


def test_a_plan_script_wraps_each_layer_with_its_policy_and_runs(fresh):
    """The script of a per-layer plan runs as printed (a fresh interpreter, torch only) and wraps exactly the
    layers the plan names, each with its own selective policy."""
    r, out = fresh
    assert r.returncode == 0, r.stderr[-2000:]
    assert updates_printed(out["train_plan"]) == [1, 2], r.stdout
    assert "wrapped [True, True, True, False] [True, False, False, False]" in out["train_plan"], r.stdout


def test_an_optimizer_in_backward_script_steps_in_the_hooks_and_runs(fresh):
    """--optimizer-in-backward's script runs as printed (a fresh interpreter): one optimizer per parameter, stepped
    in its post-accumulate-grad hook, so no gradient is left after backward and the weights moved."""
    r, out = fresh
    assert r.returncode == 0, r.stderr[-2000:]
    assert updates_printed(out["train_inbwd"]) == [1, 2], r.stdout
    assert "grads left 0" in out["train_inbwd"] and "moved True" in out["train_inbwd"], r.stdout
