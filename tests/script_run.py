"""Run printed training scripts as a user would: one ``torchrun --standalone`` launch, the scripts in turn.

One launch of ``nproc`` ranks runs a small driver (torch only; batchlab is not on its path) that first runs the
single-process reference scripts, shared out between the ranks, with torchrun's variables taken away (as
``python train.py`` runs them), then in every rank each distributed script as ``__main__``.  Each distributed script after the first rendezvouses
on a store of its own, served by rank 0 on torchrun's port + i: a re-made default group on torchrun's store reads
the first group's keys.  Every rank's output goes to its own file, each script's part headed ``== name``; the
``update N: loss X`` lines are read from whichever rank printed them (a pipeline's last stage).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_GUARD = '''\
class NoBatchlab:  # the printed scripts are self-contained: an import of batchlab fails the run
    def find_spec(self, name, path=None, target=None):
        if name == "batchlab" or name.startswith("batchlab."):
            raise ImportError("the printed script imported " + name)


sys.meta_path.insert(0, NoBatchlab())
'''

_DRIVER = '''\
import json, os, runpy, sys


''' + _GUARD + '''req = json.load(open(sys.argv[1]))
rank = os.environ["RANK"]
fd = os.open(os.path.join(req["folder"], "out%s.txt" % rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(fd, 1)
saved = {k: os.environ.pop(k) for k in req["torchrun_vars"] if k in os.environ}
for name, path in req["references"][int(rank)::int(saved["WORLD_SIZE"])]:  # shared out: the ranks run theirs at once
    print("== " + name, flush=True)
    runpy.run_path(path, run_name="__main__")
os.environ.update(saved)
first = int(os.environ["MASTER_PORT"])
for i, (name, path) in enumerate(req["scripts"]):
    if i:  # a store of its own, served by rank 0
        os.environ["MASTER_PORT"], os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(first + i), "False"
    print("== " + name, flush=True)
    runpy.run_path(path, run_name="__main__")
sys.stdout.flush()
'''
# torchrun's variables a plain `python train.py` does not have
_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


@dataclass(frozen=True)
class ScriptRun:
    returncode: int
    losses: dict[str, list[float]]  # script name -> the losses its update lines printed, update 1 first
    log: str  # torchrun's output, for a failure's message

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def sharpened(script: str, lr: float = 0.5) -> str:
    """A printed script edited to make its losses a check of its gradients: SGD at a large learning rate (the
    loss after an update then moves with each gradient's size; Adam's first step is about lr x sign(g), blind to
    a gradient scaled by a constant) and 8 decimals.  Apply it to the script and to its reference alike."""
    import re

    out = re.sub(r"torch\.optim\.\w+\((.*?), lr=[0-9.e-]+[^)\n]*\)", rf"torch.optim.SGD(\1, lr={lr})", script)
    out = re.sub(r"ZeroRedundancyOptimizer\((.*?), optimizer_class=torch\.optim\.\w+, lr=[^)\n]*\)",
                 rf"ZeroRedundancyOptimizer(\1, optimizer_class=torch.optim.SGD, lr={lr})", out)
    if out.count("torch.optim.SGD") != 1:
        raise ValueError("the script's optimizer line was not found")
    return out.replace(":.4f}", ":.8f}")


def sections(text: str) -> dict[str, str]:
    """``== name`` sections of a driver's output -> each one's text."""
    out: dict[str, str] = {}
    name = None
    for line in text.splitlines(keepends=True):
        if line.startswith("== "):
            name = line[3:].strip()
            out[name] = ""
        elif name is not None:
            out[name] += line
    return out


def update_losses(text: str) -> dict[str, list[float]]:
    """``== name`` sections of one rank's output -> the losses of their ``update N: loss X`` lines."""
    out: dict[str, list[float]] = {}
    for name, body in sections(text).items():
        losses = [float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                  if line.startswith("update ") and ": loss " in line]
        if losses:
            out[name] = losses
    return out


def run_scripts(folder: Path, nproc: int, scripts: dict[str, str], references: dict[str, str] | None = None,
                timeout: float = 600) -> ScriptRun:
    """Write ``scripts`` (name -> text; run by all ``nproc`` ranks) and ``references`` (name -> text; each by one
    rank, before them, without torchrun's variables) under ``folder`` and run them in one torchrun launch."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, text in {**(references or {}), **scripts}.items():
        paths[name] = folder / f"{name}.py"
        paths[name].write_text(text)
    request = folder / "request.json"
    request.write_text(json.dumps({
        "folder": str(folder), "torchrun_vars": list(_TORCHRUN_VARS),
        "references": [[n, str(paths[n])] for n in references or {}], "scripts": [[n, str(paths[n])] for n in scripts]}))
    driver = folder / "driver.py"
    driver.write_text(_DRIVER)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}  # torch only: batchlab not importable
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(driver),
           str(request)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=folder,
                            start_new_session=True)  # its own process group: the ranks go with it on a timeout
    try:
        log, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        code, log = -9, f"timed out after {timeout:.0f} s\n{log}"
    losses: dict[str, list[float]] = {}
    for rank in range(nproc):
        path = folder / f"out{rank}.txt"
        if path.exists():
            for name, values in update_losses(path.read_text()).items():
                losses.setdefault(name, values)
    return ScriptRun(code, losses, log)


_IN_TURN = '''\
import runpy, sys


''' + _GUARD + '''
for name, path in zip(sys.argv[1::2], sys.argv[2::2]):
    print("== " + name, flush=True)
    runpy.run_path(path, run_name="__main__")
    sys.stdout.flush()
'''


def run_in_turn(folder: Path, scripts: dict[str, str], timeout: float = 240) -> tuple[subprocess.CompletedProcess,
                                                                                        dict[str, str]]:
    """Write ``scripts`` (name -> text) under ``folder`` and run them as ``__main__`` in turn in one fresh
    interpreter (torch imported once for all: a ``python train.py`` each would import it again), batchlab not
    importable, as ``run_scripts``'s driver; (the process, each script's stdout by name).  A script that raises ends the process: the ones after it print nothing."""
    folder.mkdir(parents=True, exist_ok=True)
    argv = []
    for name, text in scripts.items():
        (folder / f"{name}.py").write_text(text)
        argv += [name, str(folder / f"{name}.py")]
    (folder / "in_turn.py").write_text(_IN_TURN)
    done = subprocess.run([sys.executable, str(folder / "in_turn.py"), *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=folder, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return done, sections(done.stdout)
