"""Start a DP measurement's ranks, wait for them with a timeout, and leave no process behind.

On one node on CPU the ranks are forks of the pre-imported process (forked.py: no import per rank).  Elsewhere
(several nodes, CUDA, no fork) torchrun (``python -m torch.distributed.run``) starts one worker per local rank,
each in its own session; it runs in a fresh session of its own here.  Whatever happens (success, a rank killed,
an exception, a hang), the launcher returns a Measurement: on failure it kills torchrun's process group and
every worker's (found through the pid files the ranks write, checked against their command line), and workers
also die with torchrun through PR_SET_PDEATHSIG (see __main__.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from batchlab.config import ConfigError, RunConfig, Choice
from batchlab.distributed import forked
from batchlab.distributed.failures import diagnose
from batchlab.util.lifeline import kill_group, module_command, runs
from batchlab.distributed.merge import SCOPE, merge
from batchlab.measure.runner import preloaded
from batchlab.measure.options import MeasureOptions
from batchlab.measure.result import Measurement

DEFAULT_TIMEOUT_S = 600.0
MAX_LOCAL_RANKS = 64  # a world beyond this on one node is a typo, not a measurement
_MULTI_NODE_FLAGS = ("--rdzv-endpoint", "--rdzv_endpoint", "--master-addr", "--master_addr")


def _flag_value(args: Sequence[str], *names: str) -> str | None:
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def nnodes_of(torchrun_args: Sequence[str]) -> int:
    text = _flag_value(torchrun_args, "--nnodes")
    if text is None:
        return 1
    try:
        return int(text)
    except ValueError:
        raise ConfigError("nnodes", f"needs a fixed node count (elastic ranges are not supported), got {text!r}") from None


def torchrun_args(nnodes: int | None = None, node_rank: int | None = None,
                  rdzv_endpoint: str | None = None) -> list[str]:
    """torchrun's multi-node flags (static rendezvous: every node names the same endpoint, its own rank)."""
    if (nnodes or 1) > 1 and (node_rank is None or not rdzv_endpoint):
        raise ConfigError("nnodes", "more than one node needs --node-rank and --rdzv-endpoint host:port too")
    args = []
    for flag, value in (("--nnodes", nnodes), ("--node-rank", node_rank), ("--rdzv-endpoint", rdzv_endpoint)):
        if value is not None:
            args += [flag, str(value)]
    return args


def torchrun_command(nproc: int, torchrun_args: Sequence[str], spec: Path, out: Path) -> list[str]:
    """torchrun under batchlab.util.lifeline (it dies with batchlab, taking its ranks and ``out`` along); ranks start
    without the working directory on sys.path (PYTHONSAFEPATH in their environment; on 3.10, as a script)."""
    node = [] if any(_flag_value(torchrun_args, f) for f in _MULTI_NODE_FLAGS) else ["--standalone"]
    rank = ["-m", "batchlab.distributed"] if sys.version_info >= (3, 11) else [str(Path(__file__).with_name("__main__.py"))]
    # torchrun's per-rank log folders in ``out`` (removed with it) unless the caller names one: by default torch
    # makes a /tmp/torchelastic_* folder per launch and never removes it
    logs = [] if _flag_value(torchrun_args, "--log-dir", "--log_dir") else ["--log-dir", str(out / "torchrun-logs")]
    return [*module_command("batchlab.util.lifeline", str(out), "torch.distributed.run"), *node, "--nproc-per-node",
            str(nproc), "--max-restarts", "0", *logs, *torchrun_args, *rank, "--spec", str(spec), "--out", str(out)]


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _env(nproc: int) -> dict[str, str]:
    from batchlab.measure.runner import child_env

    env = child_env()  # the caller's sys.path: a factory model importable here imports in the ranks
    # the cores shared fairly between local ranks (torchrun would set 1 and print a banner)
    env.setdefault("OMP_NUM_THREADS", str(max(1, _cpus() // nproc)))
    return env


def _ours(pid: int, marker: str) -> bool:
    """Is ``pid`` still one of this launch's ranks?  (Its command line names this launch's spec file.)"""
    return runs(pid, marker)


def cleanup(proc: subprocess.Popen, out: Path, marker: str) -> None:
    """SIGKILL every rank this launch started that is still alive, then torchrun's own group."""
    for pid in _pids(out).values():
        if _ours(pid, marker):
            kill_group(pid)  # each worker leads its own session (torchrun starts it so)
    kill_group(proc.pid)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _pids(out: Path) -> dict[int, int]:
    pids = {}
    for p in out.glob("rank*.pid"):
        try:
            pids[int(p.stem[4:])] = int(p.read_text())
        except ValueError:
            continue
    return dict(sorted(pids.items()))


@dataclass
class _Finished:
    returncode: int | None  # None: timed out
    log: str
    environment: dict  # how the ranks were started: launcher, its pid or the pre-imported process's, rank pids
    codes: dict[int, int | None] | None = None  # per rank, where no torchrun summary has them


RANK_ENTRY = "batchlab.distributed.__main__:forked"


class Launcher(Choice):
    """How this node's ranks start."""

    FORK = "fork"  # forks of the pre-imported process (forked.py): one node, CPU
    TORCHRUN = "torchrun"  # fresh interpreters under torchrun's agent (any node count, CUDA)


def _run(cmd: list[str], out: Path, env: dict[str, str], timeout_s: float, marker: str) -> _Finished:
    log_path = out / "torchrun.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            cleanup(proc, out, marker)
    started = dict(launcher=Launcher.TORCHRUN.value, torchrun_pid=proc.pid, rank_pids=_pids(out))
    return _Finished(rc, log_path.read_text(errors="replace"), started)


def _run_forked(nproc: int, spec: Path, out: Path, env: dict[str, str], timeout_s: float,
                preload: tuple[str, ...]) -> _Finished | None:
    ranks = forked.run(nproc, RANK_ENTRY, {"spec": str(spec)}, out, env, timeout_s, preload)
    if ranks is None:
        return None
    failed = any(code != 0 for code in ranks.codes.values())
    return _Finished(None if ranks.timed_out else int(failed), ranks.log,
                     dict(launcher=forked.LAUNCHER, pre_imported_pid=ranks.server_pid, rank_pids=ranks.pids),
                     ranks.codes)


def forkable(cfg: RunConfig, opts: MeasureOptions, torchrun_args: Sequence[str]) -> bool:
    """One node, CPU: the ranks can be forks of the pre-imported process (where this platform forks)."""
    from batchlab.measure.runner import backend

    return not torchrun_args and backend(cfg, opts) == "cpu"


def check_world(cfg: RunConfig, nproc: int, nnodes: int) -> None:
    if nproc < 1:
        raise ConfigError("nproc", f"must be >= 1, got {nproc}")
    world = cfg.parallel.world_size
    if nproc * nnodes != world:
        if world == cfg.dp:
            raise ConfigError("dp", f"{cfg.dp} does not match the world size --nproc x --nnodes = {nproc} x {nnodes} "
                                    f"= {nproc * nnodes}; the config's DP is the number of ranks")
        raise ConfigError("nproc", f"--nproc x --nnodes = {nproc} x {nnodes} = {nproc * nnodes} ranks, but the "
                                   f"layout's {cfg.parallel.text()}")
    if nnodes == 1 and world > MAX_LOCAL_RANKS:
        raise ConfigError("nproc", f"{world} ranks on this node: more than the {MAX_LOCAL_RANKS} local processes a "
                                   "measurement starts (each holds a whole PyTorch); use several nodes or fewer ranks")


def check_local(cfg: RunConfig, opts: MeasureOptions, nproc: int) -> None:
    """User errors found before starting anything: an absent device, too few GPUs, a budget too small."""
    from batchlab.distributed.measurable import check
    from batchlab.measure.runner import backend

    check(cfg)  # tensor / pipeline layouts batchlab does not run
    if backend(cfg, opts) == "cpu" and cfg.memory_budget is None:
        return  # nothing to look up: torch stays out of this process (~2 s), the ranks import it
    from batchlab.measure.device import torch_device
    from batchlab.measure.session import check_budget

    dev = torch_device(cfg, opts.torch_device)
    if dev.type == "cuda":
        import torch

        if torch.cuda.device_count() < nproc:
            raise ConfigError("nproc", f"{nproc} ranks on this node need {nproc} CUDA devices; "
                                       f"{torch.cuda.device_count()} visible")
    elif dev.type != "cpu":
        raise ConfigError("device", f"DDP measurement runs on cpu (gloo) or cuda (nccl), not {dev.type}")
    check_budget(cfg)


def launch(cfg: RunConfig, opts: MeasureOptions | None = None, nproc: int | None = None,
           torchrun_args: Sequence[str] = (), timeout_s: float | None = None,
           launcher: Launcher | str | None = None) -> Measurement:
    """Measure ``cfg`` with its layout's dp x tp x pp ranks on its engine (this node's ``nproc`` of them).  ``launcher``:
    None forks them from the pre-imported process where ``forkable`` (torchrun where the fork cannot be had);
    FORK asks for that (a ConfigError where it cannot apply); TORCHRUN for torchrun.

    Never raises for a failed run: a dead, stuck or out-of-memory rank gives a Measurement with outcome
    failed / oom and ``outcome_detail`` naming the rank and the reason.
    """
    opts = opts or MeasureOptions()
    launcher = None if launcher is None else Launcher.parse("launcher", launcher)
    if launcher is Launcher.FORK and not forkable(cfg, opts, torchrun_args):
        raise ConfigError("launcher", "fork starts one node's ranks on CPU; several nodes or CUDA need torchrun")
    nnodes = nnodes_of(torchrun_args)
    nproc = nproc if nproc is not None else cfg.parallel.world_size // nnodes
    check_world(cfg, nproc, nnodes)
    check_local(cfg, opts, nproc)
    timeout = timeout_s or opts.timeout_s or DEFAULT_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="batchlab-ddp-") as tmp:
        out = Path(tmp)
        spec = out / "spec.json"
        spec.write_text(json.dumps(dict(config=cfg.to_dict(), options=opts.to_dict(), collective_timeout_s=timeout)))
        t0 = time.perf_counter()
        env = _env(nproc)
        run = None
        if launcher is not Launcher.TORCHRUN and forkable(cfg, opts, torchrun_args):
            run = _run_forked(nproc, spec, out, env, timeout, preloaded(cfg))
        if run is None:
            run = _run(torchrun_command(nproc, list(torchrun_args), spec, out), out, env, timeout, marker=str(spec))
        env = dict(run.environment, nproc_per_node=nproc, nnodes=nnodes,
                   launch_wall_seconds=time.perf_counter() - t0)
        world = out / "world.json"
        if run.returncode == 0 and world.exists():
            return merge(cfg, json.loads(world.read_text()), env)
        failure = diagnose(out, run.returncode, run.log, timeout, run.codes)
        if failure.config_field:
            raise ConfigError(failure.config_field, failure.config_message)
        env.update(scope=SCOPE, log_tail=run.log[-2000:])
        return Measurement(config=cfg.to_dict(), outcome=failure.outcome, global_batch=cfg.global_batch,
                           outcome_detail=failure.detail, environment=env)
