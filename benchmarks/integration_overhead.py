"""What the BatchlabCallback costs a Hugging Face Trainer and a Lightning Trainer: update time with and without it.

Both runs carry the same bare timer (perf_counter at the first callback's step begin and the last callback's
step end, the device synchronised at both on CUDA as the callback does), so the difference is the
BatchlabCallback alone.  A timed update holds all its micro-batches' forward and backward, gradient clipping
(HF), the optimizer step and zero_grad where the framework puts it; HF fetches the update's batches before
its step begin, Lightning fetches each micro-batch inside the update.

Design: one discarded warm-up run, then ``--rounds`` pairs of short runs in this process, the order inside
each pair alternating (without, with / with, without) so that drift cancels.  Per run, the median over the
updates the callback times (after its warmup and its one memory update; the same update indices in both
runs).  Overhead = median over pairs of with / without - 1, with the interquartile range and a
distribution-free 95% interval of that median; the target (<= 2%) is met when the interval's upper end is.
Beside it, the same ratio of process CPU time (all threads: a sampling thread would show here), the
callback's own code per timed update, timed inside the run by wrapping its hooks (its direct
cost, free of run-to-run noise); and the one memory update (live-storage tracker on CPU, allocator
statistics on CUDA), paid once per run, not per update.  On CUDA both runs synchronise at update boundaries,
so what that costs a host-bound run (the host no longer queues the next update while the device finishes) is
not in these figures.

    .venv/bin/python benchmarks/integration_overhead.py                 # GPT-2 4 x 256, seq 256, 10 updates, 16 pairs
    .venv/bin/python benchmarks/integration_overhead.py --tiny          # smoke run (seconds)
    .venv/bin/python benchmarks/integration_overhead.py --framework lightning
Prints Markdown on stdout.  Figures from a loaded machine are not worth quoting.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import tempfile
import time

import torch
from torch.utils.data import DataLoader, Dataset

WARMUP = 2  # BatchlabCallback's default; update WARMUP is the memory update, then WARMUP - 1 more untimed
FIRST_TIMED = WARMUP + 1  # index of the first update the callback times
TARGET = 0.02  # issue 17: overhead <= 2% of update time
HF_HOOKS = ("on_step_begin", "on_pre_optimizer_step", "on_step_end", "_pre_forward", "_post_forward")
LIGHTNING_HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")


def _sync() -> None:
    # the callback synchronises the device around each timed update; the bare timer must too, or on CUDA it
    # would compare kernel launches (without) with finished work (with)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Run:
    """One training run's per-update wall and process CPU times, and the callback's own time inside each."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []
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
        _sync()
        self._own, self._t0, self._c0 = 0.0, time.perf_counter(), time.process_time()

    def end(self) -> None:
        _sync()
        self.wall.append(time.perf_counter() - self._t0)
        self.cpu.append(time.process_time() - self._c0)
        self.own.append(self._own)

    def timed(self, values: list[float]) -> float:
        return statistics.median(values[FIRST_TIMED:])


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


def run_hf(a, with_callback: bool) -> Run:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from batchlab.integrations.transformers import BatchlabCallback

    run = Run()

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


def run_lightning(a, with_callback: bool) -> Run:
    import lightning as L

    from batchlab.integrations.lightning import BatchlabCallback

    run = Run()

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


def paired(a, run) -> dict[str, list[float]]:
    """Per pair: with / without - 1 of the timed medians, the callback's own share, the memory update ratio."""
    run(a, False)  # warm-up run, discarded: first-run costs (imports, allocator growth, lazy inits)
    out: dict[str, list[float]] = {"overhead": [], "cpu": [], "own": [], "own_ms": [], "memory": [], "bare_ms": []}
    for r in range(a.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        runs = {}
        for with_callback in order:
            gc.collect()
            runs[with_callback] = run(a, with_callback)
        bare, watched = runs[False].timed(runs[False].wall), runs[True]
        out["overhead"].append(watched.timed(watched.wall) / bare - 1)
        out["cpu"].append(watched.timed(watched.cpu) / runs[False].timed(runs[False].cpu) - 1)
        out["own"].append(watched.timed(watched.own) / bare)
        out["own_ms"].append(watched.timed(watched.own) * 1e3)
        out["memory"].append(watched.wall[WARMUP - 1] / bare)  # update WARMUP: the memory update
        out["bare_ms"].append(bare * 1e3)
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
    p.add_argument("--steps", type=int, default=10, help="updates per run (the first %d untimed)" % FIRST_TIMED)
    p.add_argument("--rounds", type=int, default=16, help="pairs of runs (without/with, order alternating)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default torch's; 1 keeps a shared machine's stalls out of the ratio)")
    p.add_argument("--tiny", action="store_true", help="smoke run: 2 layers x 64, seq 32, 6 updates, 2 pairs")
    a = p.parse_args()
    if a.tiny:
        a.layers, a.hidden, a.seq, a.vocab, a.steps, a.rounds = 2, 64, 32, 128, 6, 2
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    if a.steps <= FIRST_TIMED:
        p.error(f"--steps must be > {FIRST_TIMED} (warmup and the memory update are never timed)")
    r = paired(a, run_hf if a.framework == "hf" else run_lightning)
    timed = a.steps - FIRST_TIMED
    print(f"## BatchlabCallback overhead ({a.framework}, {'cuda' if torch.cuda.is_available() else 'cpu'}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads)\n")
    print(f"GPT-2 {a.layers} layers x {a.hidden}, seq {a.seq}; micro-batch {a.micro} x accum {a.accum}; "
          f"{a.steps} updates per run, of which {timed} timed (updates {FIRST_TIMED + 1}..{a.steps}); "
          f"{a.rounds} pairs after one discarded warm-up run; bare update {statistics.median(r['bare_ms']):.1f} ms "
          f"(median over pairs); load average (1 min) at the end {os.getloadavg()[0]:.2f}\n")
    print("| figure (per pair, then over pairs) | median | IQR | range |\n|---|---|---|---|")
    for label, key, fmt in (("timed updates: with / without - 1 (target <= 2%)", "overhead", "{:+.2%}"),
                            ("process CPU time per timed update: with / without - 1", "cpu", "{:+.2%}"),
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
    main()
