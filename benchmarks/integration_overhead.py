"""What the BatchlabCallback costs a Hugging Face Trainer and a Lightning Trainer: update time with and without it.

Both runs carry the same bare timer (perf_counter at the first callback's step begin and the last callback's
step end), so the difference is the BatchlabCallback alone.  Rounds alternate (without, with, without, ...)
in one process; per round, the median update time over the updates the callback times (after its warmup
and its one memory update).  overhead = median over rounds of with / without - 1 (target <= 2%).  The one
memory update (live-storage tracker on CPU, allocator statistics on CUDA) is reported on its own: it is
paid once per run, not per update.

    .venv/bin/python benchmarks/integration_overhead.py                 # GPT-2 4 x 256, seq 256, 30 updates, 5 rounds
    .venv/bin/python benchmarks/integration_overhead.py --tiny          # smoke run (seconds)
    .venv/bin/python benchmarks/integration_overhead.py --framework lightning
Prints Markdown on stdout.  Figures from a loaded machine are not worth quoting.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch.utils.data import DataLoader, Dataset

WARMUP = 2  # BatchlabCallback's default; update WARMUP is the memory update, then WARMUP - 1 more untimed


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


def run_hf(a, with_callback: bool) -> list[float]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from batchlab.integrations.transformers import BatchlabCallback

    times: list[float] = []

    class Start(TrainerCallback):
        def on_step_begin(self, *args, **kw):
            self.t0 = time.perf_counter()

    class Stop(TrainerCallback):
        def on_step_end(self, *args, **kw):
            times.append(time.perf_counter() - start.t0)

    start = Start()
    callbacks = [start] + ([BatchlabCallback(warmup=WARMUP)] if with_callback else []) + [Stop()]
    with tempfile.TemporaryDirectory() as d:
        args = TrainingArguments(output_dir=d, per_device_train_batch_size=a.micro, gradient_accumulation_steps=a.accum,
                                 max_steps=a.steps, report_to=[], save_strategy="no", use_cpu=not torch.cuda.is_available(),
                                 disable_tqdm=True, logging_strategy="no")
        Trainer(_gpt2(a), args, train_dataset=Tokens(a.micro * a.accum * a.steps, a.seq, a.vocab),
                callbacks=callbacks).train()
    return times


def run_lightning(a, with_callback: bool) -> list[float]:
    import lightning as L

    from batchlab.integrations.lightning import BatchlabCallback

    times: list[float] = []

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
                self.t0 = time.perf_counter()

    class Stop(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if (batch_idx + 1) % a.accum == 0:
                times.append(time.perf_counter() - start.t0)

    start = Start()
    callbacks = [start] + ([BatchlabCallback(warmup=WARMUP)] if with_callback else []) + [Stop()]
    trainer = L.Trainer(max_steps=a.steps, accumulate_grad_batches=a.accum, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        devices=1)
    trainer.fit(Module(), DataLoader(Tokens(a.micro * a.accum * a.steps, a.seq, a.vocab), batch_size=a.micro))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=("hf", "lightning"), default="hf")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="smoke run: 2 layers x 64, seq 32, 8 updates, 2 rounds")
    a = p.parse_args()
    if a.tiny:
        a.layers, a.hidden, a.seq, a.vocab, a.steps, a.rounds = 2, 64, 32, 128, 8, 2
    run = run_hf if a.framework == "hf" else run_lightning
    first_timed = WARMUP + 1  # index of the first update the callback times
    steady, memory_update = [], []
    for _ in range(a.rounds):
        bare, watched = run(a, False), run(a, True)
        steady.append(statistics.median(watched[first_timed:]) / statistics.median(bare[first_timed:]))
        memory_update.append(watched[1] / statistics.median(bare[first_timed:]))  # update 2: the memory update
        base = statistics.median(bare[first_timed:])
    print(f"## BatchlabCallback overhead ({a.framework}, {'cuda' if torch.cuda.is_available() else 'cpu'}, "
          f"torch {torch.__version__})\n")
    print(f"GPT-2 {a.layers} layers x {a.hidden}, seq {a.seq}; micro-batch {a.micro} x accum {a.accum}; "
          f"{a.steps} updates per run, {a.rounds} rounds; bare update time (last round) {base * 1e3:.1f} ms\n")
    print("| figure | median over rounds | range |\n|---|---|---|")
    over = [r - 1 for r in steady]
    print(f"| timed updates: with / without - 1 (target <= 2%) | {statistics.median(over):+.2%} | "
          f"{min(over):+.2%} .. {max(over):+.2%} |")
    print(f"| the one memory update / bare update | {statistics.median(memory_update):.2f}x | "
          f"{min(memory_update):.2f}x .. {max(memory_update):.2f}x |")


if __name__ == "__main__":
    main()
