"""What the BatchlabCallback costs a Hugging Face Trainer and a Lightning Trainer: update time with and without it.

Both runs carry the same bare timer (perf_counter at the first callback's step begin and the last callback's
step end, the device synchronised at both on CUDA as the callback does), so the difference is the
BatchlabCallback alone.  A timed update holds all its micro-batches' forward and backward, gradient clipping
(HF), the optimizer step and zero_grad where the framework puts it; HF fetches the update's batches before
its step begin, Lightning fetches each micro-batch inside the update.

Design: ``--rounds`` pairs of training processes (fresh interpreters: the callback cannot leave state in the
process that trains without it), the two processes of a pair started together and taking turns update by
update (a pair of semaphores: exactly one of them computes at any time, the other waits blocked; which one
goes first alternates between pairs), so a timed update of one run and the same update of the other are
seconds apart and a shared machine's drift (minutes) cancels inside the pair.  Per pair, the median over the
updates the callback times (after its warmup and its one memory update, and before the last, which overlaps
the other process's teardown) of the per-update ratio with / without - 1.  Overhead = median over pairs, with
the interquartile range and a distribution-free 95% interval of that median; the target (<= 2%) is met when
the interval's upper end is.  Beside it: the same ratio of process CPU time (all threads: a sampling thread
would show here); minor page faults per timed update in each run (a fault maps a fresh zeroed page: glibc
hands freed activation memory back to the OS and the next update faults it in again, ~15 us a fault on this
VM, so a callback that changed the allocator's state would show here); the callback's own code per timed
update, timed inside the run by wrapping its hooks (its direct cost, free of run-to-run noise); and the one
memory update (live-storage tracker on CPU, allocator statistics on CUDA), paid once per run, not per update.
On CUDA both runs synchronise at update boundaries, so what that costs a host-bound run (the host no longer
queues the next update while the device finishes) is not in these figures.  ``--variant`` bisects the
callback (the memory update off, the /proc sampling off, hooks only) to find where a cost comes from.

    .venv/bin/python benchmarks/integration_overhead.py --threads 1     # GPT-2 4 x 256, seq 256, 16 pairs
    .venv/bin/python benchmarks/integration_overhead.py --tiny          # smoke run (seconds)
    .venv/bin/python benchmarks/integration_overhead.py --framework lightning
Prints Markdown on stdout.  Figures from a loaded machine are not worth quoting.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader, Dataset

WARMUP = 2  # BatchlabCallback's default; update WARMUP is the memory update, then WARMUP - 1 more untimed
FIRST_TIMED = WARMUP + 1  # index of the first update the callback times
TARGET = 0.02  # the target: overhead <= 2% of update time
HF_HOOKS = ("on_step_begin", "on_pre_optimizer_step", "on_step_end", "_pre_forward", "_post_forward")
LIGHTNING_HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")
VARIANTS = ("full", "no-memory", "no-factors", "hooks-only")
# --malloc steady: glibc keeps freed memory (no trim, no mmap for large blocks), so no update faults pages in
# again; set for both processes of every pair (the benchmark's environment, never the callback's)
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "68719476736",
                 "MALLOC_TOP_PAD_": "268435456"}


def _sync() -> None:
    # the callback synchronises the device around each timed update; the bare timer must too, or on CUDA it
    # would compare kernel launches (without) with finished work (with)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Baton:
    """Two processes taking turns: ``turn()`` at each update's start hands the turn to the other process (once
    this one has had it) and waits for it back; ``done()`` after this process's last update hands it over for
    good.  Whatever a process does between two of its updates (fetching batches, its hooks) runs in its turn."""

    def __init__(self, mine, other):
        self.mine, self.other, self.held = mine, other, False

    def turn(self) -> None:
        if self.held:
            self.other.release()
        self.mine.acquire()
        self.held = True

    def done(self) -> None:
        if self.held:
            self.other.release()
            self.held = False


class Run:
    """One training run's per-update wall and process CPU times, minor page faults, and the callback's own
    time inside each."""

    def __init__(self, baton: Baton | None = None, updates: int = 0):
        self.baton, self.updates = baton, updates
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.faults: list[int] = []  # minor page faults per update (the kernel maps a fresh zeroed page)
        self.own: list[float] = []
        self._own = 0.0

    def timed_hooks(self, cb, names) -> None:
        """Wrap ``cb``'s hooks (instance attributes: the frameworks look them up there) with a timer."""
        for name in names:
            fn = getattr(cb, name)

            def wrapped(*args, _fn=fn, **kw):
                t = time.perf_counter()
                try:
                    return _fn(*args, **kw)
                finally:
                    self._own += time.perf_counter() - t
            setattr(cb, name, wrapped)

    def begin(self) -> None:
        if self.baton is not None:
            self.baton.turn()
        _sync()
        self._f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self._own, self._t0, self._c0 = 0.0, time.perf_counter(), time.process_time()

    def end(self) -> None:
        _sync()
        self.wall.append(time.perf_counter() - self._t0)
        self.cpu.append(time.process_time() - self._c0)
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self._f0)
        self.own.append(self._own)
        if self.baton is not None and len(self.wall) == self.updates:
            self.baton.done()

    def lists(self) -> dict[str, list]:
        return {"wall": self.wall, "cpu": self.cpu, "faults": self.faults, "own": self.own}


class Tokens(Dataset):
    def __init__(self, n: int, seq: int, vocab: int):
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "attention_mask": torch.ones_like(self.x[i]), "labels": self.x[i]}


def _gpt2(a):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=a.layers, n_embd=a.hidden, n_head=max(1, a.hidden // 64),
                                      vocab_size=a.vocab, n_positions=a.seq, bos_token_id=0, eos_token_id=0))


def run_hf(a, with_callback: bool, baton: Baton | None = None) -> Run:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from batchlab.integrations.transformers import BatchlabCallback

    run = Run(baton, a.steps)

    class Start(TrainerCallback):
        def on_step_begin(self, *args, **kw):
            run.begin()

    class Stop(TrainerCallback):
        def on_step_end(self, *args, **kw):
            run.end()

    watched = [BatchlabCallback(warmup=WARMUP)] if with_callback else []
    for cb in watched:
        run.timed_hooks(cb, HF_HOOKS)
    callbacks = [Start()] + watched + [Stop()]
    with tempfile.TemporaryDirectory() as d:
        args = TrainingArguments(output_dir=d, per_device_train_batch_size=a.micro, gradient_accumulation_steps=a.accum,
                                 max_steps=a.steps, report_to=[], save_strategy="no", use_cpu=not torch.cuda.is_available(),
                                 disable_tqdm=True, logging_strategy="no")
        Trainer(_gpt2(a), args, train_dataset=Tokens(a.micro * a.accum * a.steps, a.seq, a.vocab),
                callbacks=callbacks).train()
    return run


def run_lightning(a, with_callback: bool, baton: Baton | None = None) -> Run:
    import lightning as L

    from batchlab.integrations.lightning import BatchlabCallback

    run = Run(baton, a.steps)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _gpt2(a)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Start(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx % a.accum == 0:
                run.begin()

    class Stop(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if (batch_idx + 1) % a.accum == 0:
                run.end()

    watched = [BatchlabCallback(warmup=WARMUP)] if with_callback else []
    for cb in watched:
        run.timed_hooks(cb, LIGHTNING_HOOKS)
    callbacks = [Start()] + watched + [Stop()]
    trainer = L.Trainer(max_steps=a.steps, accumulate_grad_batches=a.accum, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        devices=1)
    trainer.fit(Module(), DataLoader(Tokens(a.micro * a.accum * a.steps, a.seq, a.vocab), batch_size=a.micro))
    return run


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return q1, q2, q3


def median_ci(xs: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free confidence interval of the median: order statistics x_(k) .. x_(n-k+1) with k the
    largest such that P(Binomial(n, 1/2) < k) <= (1 - level) / 2 (None when n is too small for any)."""
    n, xs = len(xs), sorted(xs)
    below, k = 0.0, 0
    for j in range(n):
        below += math.comb(n, j) / 2 ** n  # P(B <= j)
        if below > (1 - level) / 2:
            break
        k = j + 1
    return (xs[k - 1], xs[n - k]) if k >= 1 else None


def bisect(variant: str) -> None:
    """Switch part of the callback off in this process (``--variant``; the product is unchanged)."""
    from batchlab.host.load import LoadSampler
    from batchlab.integrations import observe, watch

    if variant in ("no-memory", "hooks-only"):
        observe.Observer._is_memory_update = lambda self, index: False
    if variant in ("no-factors", "hooks-only"):
        LoadSampler.poll = lambda self: None
    if variant == "hooks-only":  # the framework hooks run; they reach no Observer
        watch.Watch.begin = watch.Watch.end = lambda self: None


def worker(a, with_callback: bool, mine, other, conn) -> None:
    """One training process of a pair: its run's per-update lists go back through ``conn``."""
    sys.stdout = sys.stderr  # the trainers' own prints stay out of the Markdown
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    if with_callback:
        bisect(a.variant)
    run = (run_hf if a.framework == "hf" else run_lightning)(a, with_callback, Baton(mine, other))
    conn.send(run.lists())
    conn.close()


def pair(a, with_first: bool) -> dict[bool, dict[str, list]]:
    """Two processes (with and without the callback) started together, taking turns update by update."""
    ctx = multiprocessing.get_context("spawn")
    sems = {True: ctx.Semaphore(1 if with_first else 0), False: ctx.Semaphore(0 if with_first else 1)}
    procs, pipes = {}, {}
    for w in (True, False):
        pipes[w], child = ctx.Pipe(duplex=False)
        procs[w] = ctx.Process(target=worker, args=(a, w, sems[w], sems[not w], child))
        procs[w].start()
        child.close()
    out = {w: pipes[w].recv() for w in (True, False)}
    for p in procs.values():
        p.join()
        assert p.exitcode == 0, f"a training process failed (exit {p.exitcode})"
    return out


def paired(a) -> dict[str, list[float]]:
    """Per pair: the median over timed updates of with / without - 1, the faults, the callback's own share,
    the memory update ratio."""
    out: dict[str, list[float]] = {k: [] for k in ("overhead", "cpu", "own", "own_ms", "memory", "bare_ms",
                                                   "faults_with", "faults_without")}
    timed = slice(FIRST_TIMED, a.steps - 1)  # the last update overlaps the other process's teardown
    for r in range(a.rounds):
        runs = pair(a, with_first=r % 2 == 1)
        w, b = runs[True], runs[False]
        out["overhead"].append(statistics.median(x / y - 1 for x, y in zip(w["wall"][timed], b["wall"][timed])))
        out["cpu"].append(statistics.median(x / y - 1 for x, y in zip(w["cpu"][timed], b["cpu"][timed])))
        bare = statistics.median(b["wall"][timed])
        out["own"].append(statistics.median(w["own"][timed]) / bare)
        out["own_ms"].append(statistics.median(w["own"][timed]) * 1e3)
        out["memory"].append(w["wall"][WARMUP - 1] / bare)  # update WARMUP: the memory update
        out["bare_ms"].append(bare * 1e3)
        out["faults_with"].append(statistics.fmean(w["faults"][timed]))
        out["faults_without"].append(statistics.fmean(b["faults"][timed]))
        print(f"pair {r + 1}: {out['overhead'][-1]:+.2%}, faults per timed update {out['faults_with'][-1]:.0f} with, "
              f"{out['faults_without'][-1]:.0f} without", file=sys.stderr, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=("hf", "lightning"), default="hf")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=16,
                   help="updates per run (the first %d and the last untimed)" % FIRST_TIMED)
    p.add_argument("--rounds", type=int, default=16, help="pairs of processes (with/without, who starts alternating)")
    p.add_argument("--malloc", choices=("default", "steady"), default="default",
                   help="steady: glibc settings under which no update faults pages in (both processes)")
    p.add_argument("--variant", choices=VARIANTS, default="full",
                   help="bisect: the callback with its memory update off, its /proc sampling off, or hooks only")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default torch's; 1 keeps a shared machine's stalls out of the ratio)")
    p.add_argument("--tiny", action="store_true", help="smoke run: 2 layers x 64, seq 32, 7 updates, 2 pairs")
    a = p.parse_args()
    if a.tiny:
        a.layers, a.hidden, a.seq, a.vocab, a.steps, a.rounds = 2, 64, 32, 128, 7, 2
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    if a.steps <= FIRST_TIMED + 1:
        p.error(f"--steps must be > {FIRST_TIMED + 1} (warmup, the memory update and the last are never timed)")
    if a.malloc == "steady":
        os.environ.update(STEADY_MALLOC)  # inherited by the spawned training processes
    load0 = os.getloadavg()[0]
    r = paired(a)
    timed = a.steps - FIRST_TIMED - 1
    print(f"## BatchlabCallback overhead ({a.framework}, {'cuda' if torch.cuda.is_available() else 'cpu'}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads"
          f"{'' if a.variant == 'full' else ', callback variant ' + a.variant}"
          f"{', glibc malloc ' + ' '.join(f'{k}={v}' for k, v in STEADY_MALLOC.items()) if a.malloc == 'steady' else ''})\n")
    print(f"GPT-2 {a.layers} layers x {a.hidden}, seq {a.seq}; micro-batch {a.micro} x accum {a.accum}; "
          f"{a.steps} updates per run, of which {timed} timed (updates {FIRST_TIMED + 1}..{a.steps - 1}); "
          f"{a.rounds} pairs of processes taking turns update by update; bare update "
          f"{statistics.median(r['bare_ms']):.1f} ms (median over pairs); load average (1 min) "
          f"{load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end\n")
    print("| figure (per pair, then over pairs) | median | IQR | range |\n|---|---|---|---|")
    for label, key, fmt in (("timed updates: with / without - 1 (target <= 2%)", "overhead", "{:+.2%}"),
                            ("process CPU time per timed update: with / without - 1", "cpu", "{:+.2%}"),
                            ("minor page faults per timed update, with the callback", "faults_with", "{:,.0f}"),
                            ("minor page faults per timed update, without", "faults_without", "{:,.0f}"),
                            ("callback's own code per timed update / bare update", "own", "{:.3%}"),
                            ("callback's own code per timed update (ms)", "own_ms", "{:.3f}"),
                            ("the one memory update / bare update", "memory", "{:.2f}x")):
        q1, q2, q3 = quartiles(r[key])
        print(f"| {label} | {fmt.format(q2)} | {fmt.format(q1)} .. {fmt.format(q3)} | "
              f"{fmt.format(min(r[key]))} .. {fmt.format(max(r[key]))} |")
    ci = median_ci(r["overhead"])
    if ci is None:
        print(f"\n{a.rounds} pairs are too few for a 95% interval of the median overhead (6 at least).")
    else:
        verdict = ("within the 2% target" if ci[1] <= TARGET else
                   "not shown within 2% (the interval's upper end is above it)")
        print(f"\n95% interval of the median overhead (order statistics of {a.rounds} pairs): "
              f"{ci[0]:+.2%} .. {ci[1]:+.2%}: {verdict}.")


if __name__ == "__main__":
    import page  # benchmarks/page.py: this script's page of the docs

    page.publish(main, page.variant("integration_overhead", {"--framework=": "", "--malloc=": ""}), "What the training callbacks cost")
