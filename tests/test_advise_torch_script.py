"""The PyTorch script `fit` prints runs as printed: DP = 1 with no process group or torchrun environment, DP = 2
through torchrun (gloo, CPU) for DDP, ZeRO-1 (ZeroRedundancyOptimizer), ZeRO-2 and ZeRO-3 (FSDP2 fully_shard)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from batchlab.advise.snippets import all_snippets
from batchlab.advise.torch_script import STAND_IN_BEGIN, STAND_IN_END, training_script
from batchlab.config import ACPolicy, RunConfig, preset

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


def env() -> dict[str, str]:
    # the script must not need batchlab: run it without the source tree on the path
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**e, "OMP_NUM_THREADS": "1"}


def run_scripts(commands: list[list[str]], timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Run the commands at the same time (each is mostly torch's import and process start-up)."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env())
             for c in commands]
    out = []
    for c, p in zip(commands, procs):
        text, _ = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(c, p.returncode, text))
    return out


# Runs printed scripts in turn in one interpreter (torch imported once), each as __main__ in a fresh namespace.
# Scripts after "--plain" run first, in rank 0 alone, before any process group and with torchrun's environment
# taken away, as `python train.py` runs them (rank 1 meanwhile waits in the first rendezvous).  Under torchrun
# each script must leave no process group behind, and each after the first rendezvouses on a store of its own
# (rank 0 serves it on torchrun's port + i): a re-made default group reuses the first one's store keys, and
# gloo then read a peer's stale address now and then (connection reset).  Rank 0 names each script.
RUNNER = """\
import os, runpy, sys
import torch.distributed as dist
args = sys.argv[1:]
cut = args.index('--plain')
if os.environ['RANK'] == '0':
    torchrun_env = {k: os.environ.pop(k) for k in list(os.environ)
                    if k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'GROUP_WORLD_SIZE',
                             'ROLE_RANK', 'ROLE_WORLD_SIZE', 'ROLE_NAME', 'MASTER_ADDR', 'MASTER_PORT')
                    or k.startswith('TORCHELASTIC_')}
    for p in args[cut + 1:]:
        print('== ' + p, flush=True)
        runpy.run_path(p, run_name='__main__')
        assert not dist.is_initialized(), 'a DP = 1 script made a process group'
    os.environ.update(torchrun_env)
    print('== --plain', flush=True)
for i, p in enumerate(args[:cut]):
    assert not dist.is_initialized(), 'a process group left over from the previous script'
    if i:
        port = int(os.environ.pop('BATCHLAB_FIRST_PORT', os.environ['MASTER_PORT']))
        os.environ.update(BATCHLAB_FIRST_PORT=str(port), MASTER_PORT=str(port + i), TORCHELASTIC_USE_AGENT_STORE='False')
    if os.environ['RANK'] == '0':
        print('== ' + p, flush=True)
    runpy.run_path(p, run_name='__main__')
"""


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


DP2 = [config(dp=2, zero=0), config(dp=2, zero=1, precision="bf16-mixed", ac="full"),
       config(dp=2, zero=2, ac="selective-op"), config(dp=2, zero=3, precision="bf16-fsdp", ac="every:2")]


def dp1_scripts() -> list[str]:
    """The script as `fit` prints it at DP = 1 (first), every precision and policy at DP = 1, and the marked
    stand-in replaced by a model of the test's own (the documented placeholder), as a user would."""
    script = training_script(config(ac="every:2"))
    scripts = [script] + [training_script(config(precision=p, ac=ac, optimizer=o))
                          for p, ac, o in (("bf16-mixed", "selective", "sgd-momentum"), ("fp16-mixed", "full", "sgd"),
                                           ("bf16", "selective-op", "adamw"), ("bf16-fsdp", "megatron-selective", "adamw"))]
    head, rest = script.split(STAND_IN_BEGIN)
    return scripts + [head + OWN_MODEL + rest.split(STAND_IN_END)[1]]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """One torchrun (each launch is mostly torch's import in three processes) running, in rank 0, the DP = 1
    scripts with no torchrun environment, then in both ranks the DP = 2 scripts of DP2 in turn.
    (The DP = 2 paths, the DP = 1 paths, the CompletedProcess, rank 0's output per script by path.)"""
    tmp = tmp_path_factory.mktemp("scripts")
    dp2 = [str(write(tmp, f"train_dp2_{i}.py", training_script(cfg))) for i, cfg in enumerate(DP2)]
    dp1 = [str(write(tmp, f"train_dp1_{i}.py", s)) for i, s in enumerate(dp1_scripts())]
    runner = write(tmp, "runner.py", RUNNER)
    [r] = run_scripts([[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(runner), *dp2, "--plain", *dp1]])
    outputs = r.stdout.split("== ")[1:]
    return dp2, dp1, r, outputs


@pytest.mark.slow
@pytest.mark.distributed  # its scripts run in rank 0 of the shared torchrun job
def test_dp1_scripts_precisions_policies_and_the_users_own_model_run(ran):
    """The script as `fit` prints it at DP = 1 (the bug: DistributedSampler and model.no_sync() crashed without a
    process group / DDP); every precision and policy at DP = 1; and the marked stand-in replaced by a model of
    the test's own, as a user would.  They run in turn in one interpreter, before any process group."""
    assert all_snippets(config(ac="every:2"))["pytorch"] == dp1_scripts()[0]
    _, dp1, r, outputs = ran
    assert r.returncode == 0, r.stdout
    assert [o.split()[0] for o in outputs[:len(dp1) + 1]] == [*dp1, "--plain"], r.stdout
    for text in outputs[:len(dp1)]:
        assert updates_printed(text) == [1, 2], text


@pytest.mark.slow
@pytest.mark.distributed
def test_dp2_scripts_run_through_torchrun(ran):
    """DDP, ZeRO-1, ZeRO-2 and ZeRO-3 at DP = 2 with accumulation 2, launched as the script's own comment says
    (one torchrun runs the four in turn)."""
    for cfg in DP2:
        launch = next(line for line in training_script(cfg).splitlines() if line.startswith("# launch: "))
        assert launch == "# launch: python -m torch.distributed.run --standalone --nproc-per-node 2 train.py"
    dp2, dp1, r, outputs = ran
    assert r.returncode == 0, r.stdout
    assert [o.split()[0] for o in outputs[len(dp1) + 1:]] == dp2, r.stdout
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
            for ac in ("none", "full", "every:2", "selective", "selective-op", "megatron-selective"):
                ast.parse(training_script(config(dp=dp, zero=zero, precision=precision, ac=ac)))


def test_multi_node_launch_line():
    cfg = RunConfig(model=preset("tiny"), micro_batch=1, accum=1, dp=16, zero=3, device="h100-sxm")
    assert "--nnodes 2 --nproc-per-node 8" in training_script(cfg)
