"""Replay a Hugging Face BERT training step's allocations through the CUDA caching allocator's rules, on CPU.

What it answers: how far can max_memory_reserved exceed max_memory_allocated for this model and batch, from
block rounding, segment sizes and best-fit splitting alone (no GPU needed)?  The step runs on fake tensors
(nothing allocated) with CUDA's dropout kernel (native_dropout: a bool mask), under batchlab's StorageTracker,
whose listener records every storage created and freed, in order; the replay then applies the rules of
pytorch c10/cuda/CUDACachingAllocator.cpp: sizes round up to 512 B; requests <= 1 MiB come from 2 MiB
segments, 1-10 MiB from 20 MiB segments, larger ones get their own segment rounded up to 2 MiB; the smallest
free block that fits is used and split when at least 512 B (small pool) or more than 1 MiB (large pool) would remain;
adjacent free blocks of a segment merge; nothing is returned to the device.  One stream (no FSDP pools).

    PYTHONPATH=src python benchmarks/allocator_replay.py --batch 4 --steps 3 --zero-grad in-place
    # BERT-large, b 4, s 512, fp32, AdamW, zeroed gradients kept: per update (allocated, reserved) GiB

With ``--command``, a batchlab config's own trace instead (``batchlab estimate --trace`` on a CUDA device replays it
the same way, trace/replay.py: FSDP2's streams as pools, the first update replayed too): its tensor peak, the
replay's reserved and what sits cached and empty at the peak, beside the formula's allocator model.

    PYTHONPATH=src python benchmarks/allocator_replay.py --command "--model llama-3-70b --impl batchlab ..."
"""
from __future__ import annotations

import argparse
import shlex
import sys

from batchlab.trace.replay import CachingAllocator


class Events:
    """A StorageListener that keeps the order of creations and frees."""

    def __init__(self):
        self.log: list[tuple[str, int, int]] = []

    def added(self, key, nbytes, category):
        self.log.append(("alloc", key, nbytes))

    def freed(self, key):
        self.log.append(("free", key, 0))

    def relabelled(self, key, category):
        pass

    def op_done(self, func, args):
        pass


def record(layers: int, batch: int, seq: int, steps: int, set_to_none: bool) -> tuple[list, list[int]]:
    """The storage events of ``steps`` updates of BertForSequenceClassification (fp32, AdamW), and the event
    index where each update ends."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import BertConfig, BertForSequenceClassification

    from batchlab.measure.memory import StorageTracker

    def cuda_dropout(x, p=0.5, training=True, inplace=False):  # CUDA's kernel: output and a bool mask
        return torch.ops.aten.native_dropout.default(x, p, True)[0] if training and p > 0 else x

    F.dropout = torch.nn.modules.dropout.F.dropout = cuda_dropout
    events = Events()
    ends = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        cfg = BertConfig(num_hidden_layers=layers, hidden_size=1024, num_attention_heads=16, intermediate_size=4096,
                         vocab_size=30522, max_position_embeddings=512, attn_implementation="eager")
        model = BertForSequenceClassification(cfg).train()
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=5e-5, foreach=False)  # state created at the first step
        tracker = StorageTracker(listener=events)
        tracker.register(params, "parameters")
        with tracker:
            for _ in range(steps):
                x, y = torch.randint(100, 30000, (batch, seq)), torch.randint(0, 2, (batch,))
                model(input_ids=x, labels=y).loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
                ends.append(len(events.log))
    return events.log, ends


def replay_config(command: str, published: str | None = None) -> None:
    """The trace of ``batchlab estimate COMMAND`` with its replay, beside the formula's allocator model (and a
    published measurement of the run the command stands in for, as text)."""
    from batchlab.cli.common import config_from_command
    from batchlab.formula import estimate as formula
    from batchlab.trace import estimate as trace

    GiB = 2**30
    cfg = config_from_command(["estimate", *shlex.split(command)])
    t, f = trace(cfg), formula(cfg).memory
    m = t.memory
    print(f"`batchlab estimate {command}`\n")
    print("| | trace + replay | formula |\n|---|---|---|")
    print(f"| allocated (tensor bytes at the peak) | {m.peak_bytes / GiB:.2f} GiB | {f.peak_tensor_bytes / GiB:.2f} GiB |")
    print(f"| reserved - allocated | {m.margin_bytes / GiB:.2f} GiB ({m.margin_source}) | "
          f"{f.margin_bytes / GiB:.2f} GiB (formula/allocator.py) |")
    print(f"| reserved | {(m.peak_bytes + m.margin_bytes) / GiB:.2f} GiB | {f.peak_bytes / GiB:.2f} GiB |\n")
    print(*[f"- {n}" for n in t.notes if n.startswith("reserved:")], sep="\n")
    print("- formula's reserved - allocated, by mechanism (formula/allocator.py): " + "; ".join(
        f"{k} {v / GiB:.2f} GiB" for k, v in f.reserved_parts.items() if v))
    print(f"- traced in {t.trace_seconds:.0f} s")
    if published:
        print(f"- published: {published}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--command", help="a batchlab estimate command's flags: replay that config's trace instead")
    p.add_argument("--published", help="with --command: the measured figure of the run it stands in for (text)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--zero-grad", choices=("none", "in-place"), default="in-place",
                   help="zero_grad(set_to_none=True) or False (PyTorch 1.x's default, the 2022 HF Trainer)")
    a = p.parse_args(argv)
    if a.command:
        from batchlab.config import ConfigError

        try:
            replay_config(a.command, a.published)
        except (ValueError, ConfigError) as e:  # shlex's unclosed quote, a flag the CLI refuses
            print(f"--command: {e}", file=sys.stderr)
            return 2
        return 0
    log, ends = record(a.layers, a.batch, a.seq, a.steps, a.zero_grad == "none")
    alloc = CachingAllocator()
    print(f"BERT ({a.layers} layers) fp32, micro-batch {a.batch}, seq {a.seq}, zero_grad {a.zero_grad}: "
          "peak allocated / reserved after each update (GiB)")
    for i, (kind, key, nbytes) in enumerate(log, 1):
        alloc.malloc(key, nbytes) if kind == "alloc" else alloc.free(key)
        if i in ends:
            print(f"  update {ends.index(i) + 1}: {alloc.peak_allocated / 2**30:.2f} / {alloc.peak_reserved / 2**30:.2f}"
                  f" (+{(alloc.peak_reserved - alloc.peak_allocated) / 2**30:.2f})")
    return 0


if __name__ == "__main__":
    import page  # benchmarks/page.py: this script's page of the docs

    if "--command" in sys.argv:
        page.publish(main, "allocator_replay", "The caching allocator replayed on a trace", fence=False)
    else:  # the BERT sequence: its own page, never over the traced config's
        page.publish(main, "allocator_replay_bert", "The caching allocator replayed on BERT's step", fence=True)
