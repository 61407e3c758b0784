"""Replay a Hugging Face BERT training step's allocations through the CUDA caching allocator's rules, on CPU.

What it answers: how far can max_memory_reserved exceed max_memory_allocated for this model and batch, from
block rounding, segment sizes and best-fit splitting alone (no GPU needed)?  The step runs on fake tensors
(nothing allocated) with CUDA's dropout kernel (native_dropout: a bool mask), under batchlab's StorageTracker,
whose listener records every storage created and freed, in order; the replay then applies the rules of
pytorch c10/cuda/CUDACachingAllocator.cpp: sizes round up to 512 B; requests <= 1 MiB come from 2 MiB
segments, 1-10 MiB from 20 MiB segments, larger ones get their own segment rounded up to 2 MiB; the smallest
free block that fits is used and split when more than 512 B (small pool) or 1 MiB (large pool) would remain;
adjacent free blocks of a segment merge; nothing is returned to the device.  One stream (no FSDP pools).

    PYTHONPATH=src python benchmarks/allocator_replay.py --batch 4 --steps 3 --zero-grad in-place
    # BERT-large, b 4, s 512, fp32, AdamW, zeroed gradients kept: per update (allocated, reserved) GiB
"""
from __future__ import annotations

import argparse
import sys

MiB = 2**20
SMALL, LARGE_ALLOC, SMALL_SEGMENT, LARGE_SEGMENT, ROUND_LARGE = MiB, 10 * MiB, 2 * MiB, 20 * MiB, 2 * MiB


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


class CachingAllocator:
    """The block rules above; ``allocated`` and ``reserved`` with their peaks."""

    def __init__(self):
        self.segments: dict[str, list[list[list]]] = {"small": [], "large": []}  # blocks: [size, key|None]
        self.where: dict[int, tuple[list, int]] = {}
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def malloc(self, key: int, nbytes: int) -> None:
        size = max(512, -(-nbytes // 512) * 512)
        pool = "small" if size <= SMALL else "large"
        best = None
        for seg in self.segments[pool]:
            for i, (bsize, owner) in enumerate(seg):
                if owner is None and bsize >= size and (best is None or bsize < best[0][best[1]][0]):
                    best = (seg, i)
        if best is None:
            seg_size = (SMALL_SEGMENT if pool == "small" else LARGE_SEGMENT if size < LARGE_ALLOC
                        else -(-size // ROUND_LARGE) * ROUND_LARGE)
            seg = [[seg_size, None]]
            self.segments[pool].append(seg)
            self.reserved += seg_size
            best = (seg, 0)
        seg, i = best
        rest = seg[i][0] - size
        if rest > (512 if pool == "small" else SMALL):
            seg[i:i + 1] = [[size, key], [rest, None]]
        else:
            seg[i][1], size = key, seg[i][0]
        self.where[key] = (seg, size)
        self.allocated += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, key: int) -> None:
        if key not in self.where:
            return
        seg, size = self.where.pop(key)
        self.allocated -= size
        merged: list[list] = []
        for block in seg:
            if block[1] == key:
                block[1] = None
            if merged and merged[-1][1] is None and block[1] is None:
                merged[-1][0] += block[0]
            else:
                merged.append(block)
        seg[:] = merged


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--zero-grad", choices=("none", "in-place"), default="in-place",
                   help="zero_grad(set_to_none=True) or False (PyTorch 1.x's default, the 2022 HF Trainer)")
    a = p.parse_args(argv)
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

    page.publish(main, "allocator_replay", "The caching allocator replayed on a BERT step", fence=True)
