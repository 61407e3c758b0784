"""batchlab's live-storage tracker against PyTorch's MemTracker and the allocator, on every model family.

One steady-state update per row (AdamW's state exists), watched at once by batchlab's tracker (what both
`batchlab measure` and `batchlab estimate --trace` read), `torch.distributed._tools.mem_tracker.MemTracker`
and the profiler's CPU allocator events (tests/memory_refs.py says how each counts).  The families: the
any-model grid of benchmarks/accuracy.py (built-in tiny and small, transformers' GPT-2 and Llama, every
family in its HF_FAMILIES), the CNN and ViT factories of tests/vision_models.py, and transformers families
that no grid of batchlab's names; each in fp32 without activation checkpointing, and a few with full and
selective checkpointing and bf16 autocast.  A second table: a few families' update with the model's use_cache
turned on (transformers' default; batchlab builds with it off), where what the update keeps changes.

    PYTHONPATH=src python benchmarks/tracker_vs_memtracker.py            # writes docs/accuracy/tracker.md
    PYTHONPATH=src python benchmarks/tracker_vs_memtracker.py --quick    # three rows, printed only
    PYTHONPATH=src python benchmarks/tracker_vs_memtracker.py --cache    # the use_cache table, printed only

difference = (batchlab - MemTracker) / MemTracker; "to the byte" compares batchlab with MemTracker less
AdamW's 0-dim step counters, which MemTracker counts and batchlab leaves out (on CUDA they are host memory).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).resolve().parent)]  # memory_refs, vision_models, accuracy

import torch  # noqa: E402

from accuracy import MODELS  # noqa: E402
from batchlab.config import RunConfig, resolve_model  # noqa: E402
from batchlab.host import cpu_hardware  # noqa: E402
from batchlab.measure.harness import Trainer  # noqa: E402
from memory_refs import read_trace, read_update  # noqa: E402

SEQ, MICRO_BATCH = 128, 2
# transformers families outside every grid batchlab has (2 layers, h 128, 4 heads), built from a config.json
UNSEEN = {
    "codegen": dict(n_layer=2, n_embd=128, n_head=4, rotary_dim=16, vocab_size=1024, n_positions=512),
    "gpt_bigcode": dict(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=512),  # multi-query
    "phi": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=256,
                vocab_size=512, partial_rotary_factor=0.5),
    "mpt": dict(n_layers=2, d_model=128, n_heads=4, expansion_ratio=2, vocab_size=512, max_seq_len=512),  # ALiBi
    "gpt_neo": dict(num_layers=2, hidden_size=128, num_heads=4, vocab_size=512, max_position_embeddings=512,
                    attention_types=[[["global", "local"], 1]], window_size=64),
    "biogpt": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=256,
                   vocab_size=512),
    "olmo": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=256,
                 vocab_size=512),
}
VISION = ("cnn", "vit")
# checkpointing and autocast on a few families (full: recompute in backward; selective: the SAC cache)
VARIANTS = [("tiny", "full", "fp32"), ("tiny", "selective", "fp32"), ("hf llama", "full", "bf16-mixed"),
            ("hf llama", "selective", "fp32"), ("hf mistral", "selective", "bf16-mixed"), ("hf gpt2", "full", "fp32"),
            ("codegen", "full", "fp32"), ("vit", "full", "fp32")]
# each family with use_cache forced off, then on (batchlab builds with the config's own, on by default)
CACHE = ("codegen", "hf gpt_neox", "hf falcon", "hf gpt2", "hf llama")
QUICK = [("tiny", "none", "fp32"), ("codegen", "none", "fp32"), ("cnn", "none", "fp32")]


def _unseen(family: str) -> tuple:
    folder = Path(tempfile.gettempdir()) / f"batchlab-tracker-{family}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(UNSEEN[family], model_type=family)))
    return resolve_model(f"hf:{folder}")


def config(name: str, ac: str, precision: str) -> RunConfig:
    common = dict(micro_batch=MICRO_BATCH, ac=ac, precision=precision)
    if name in VISION:
        return RunConfig(model_source=f"vision_models:{name}", seq=3072, **common)
    spec, source = _unseen(name) if name in UNSEEN else MODELS[name]()
    return RunConfig(model=spec, model_source=source, seq=SEQ, **common)


def _exact(r) -> str:
    gap = r.batchlab - (r.memtracker - r.steps)
    return "yes" if gap == 0 else f"{gap:+,} B"


def row(name: str, ac: str, precision: str) -> tuple[str, ...]:
    cfg = config(name, ac, precision)
    torch.manual_seed(0)
    r = read_update(Trainer(cfg, "cpu"))
    t = read_trace(cfg)
    trace = f"{t.batchlab:,}" + ("" if t.batchlab == r.batchlab else " (differs)")
    return (name, ac, precision, f"{r.batchlab:,}", trace, f"{r.memtracker:,}", f"{r.allocator:,}",
            f"{r.difference:+.3%}", f"{_exact(r)}, {_exact(t)}", r.phase,
            f"`--only '{name}' --ac {ac} --precision {precision}`")


HEADER = ("family", "AC", "precision", "measure (B)", "estimate --trace (B)", "MemTracker (B)", "allocator (B)",
          "difference", "to the byte (measure, trace)", "peak phase", "command (benchmark flags)")


def cache_row(name: str) -> tuple[str, ...]:
    """batchlab's update of ``name`` with the config's use_cache set to False, then to True."""
    reads = []
    for use_cache in (False, True):
        torch.manual_seed(0)
        trainer = Trainer(config(name, "none", "fp32"), "cpu")
        trainer.raw_model.config.use_cache = use_cache  # the forward reads it when the call does not pass it
        reads.append(read_update(trainer))
    off, on = reads
    return (name, f"{off.batchlab:,}", f"{off.memtracker:,}", f"{on.batchlab:,}", f"{on.memtracker:,}",
            f"{(on.batchlab - off.batchlab) / off.batchlab:+.2%}", f"{_exact(off)}, {_exact(on)}")


CACHE_HEADER = ("family", "use_cache=False: measure (B)", "MemTracker (B)", "use_cache=True: measure (B)",
                "MemTracker (B)", "change", "to the byte (False, True)")


def table(rows, header=HEADER) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def page(rows, cache, seconds: float, argv: list[str]) -> str:
    import transformers

    cmd = " ".join(["PYTHONPATH=src python benchmarks/tracker_vs_memtracker.py", *argv])
    return f"""# batchlab's tracker against PyTorch's MemTracker

The output of `benchmarks/tracker_vs_memtracker.py`, written {datetime.date.today().isoformat()} on
{cpu_hardware()} ({platform.machine()}, {os.cpu_count()} CPUs), torch {torch.__version__}, transformers
{transformers.__version__}, in {seconds:.0f} s.  Reproduce with:

    {cmd}

Each row is one steady-state optimizer update (AdamW, seq {SEQ} x micro-batch {MICRO_BATCH}; images 3x32x32 for
the CNN and ViT).  Columns:

- measure: batchlab's live-storage tracker (`batchlab.measure.memory`, what `batchlab measure` reads on CPU) on a
  real update;
- estimate --trace: the same tracker on the same update under FakeTensorMode (what `estimate --trace` reads);
- MemTracker: PyTorch's `torch.distributed._tools.mem_tracker.MemTracker` on the real update, at the same time
  as batchlab's tracker (it is the outer dispatch mode);
- allocator: the profiler's CPU memory events (every allocation and free c10's allocator reports, no dispatch
  mode involved) over the same update, added to the storages alive before it, each counted once;
- difference = (measure - MemTracker) / MemTracker;
- to the byte: measure and trace against MemTracker less AdamW's 0-dim step counters (4 B per parameter
  tensor; under the trace, MemTracker on the fake update).  MemTracker counts the counters, batchlab leaves them
  out on purpose: on CUDA they are host memory, and the formula's 8 B per parameter has no room for them.

The allocator reads a few bytes more without checkpointing (the step counters, and scalars a kernel allocates and
frees inside itself) and about 5 KB more per checkpointed region alive at the peak: `torch.utils.checkpoint`
keeps a copy of the CPU RNG state (5,056 B; `preserve_rng_state`) that no op returns, so neither tracker sees it;
on CUDA that copy is host memory too.

The families: the any-model grid of `benchmarks/accuracy.py`, the CNN and ViT of `tests/vision_models.py`, and
transformers families no grid of batchlab's names ({", ".join(UNSEEN)}), built from a config.json.  A row's
command is the benchmark with the flags in its last column.

{table(rows)}

## Training with transformers' default `use_cache=True`

batchlab builds a Hugging Face model with its config's `use_cache` (`src/batchlab/models/hf.py`; off under
activation checkpointing, as transformers does); a family's default config has `use_cache=True`, and then
transformers builds a `DynamicCache` in the training forward too.  Its
`torch.cat` copies each layer's k and v.  Where every view of a fused q/k/v projection's output went through such a
copy or a rotary embedding (CodeGen, GPT-NeoX, Falcon), the attention kernel saves new tensors and the fused output
(b·s·3h·4 B per layer in fp32, kept whole while any view of it is saved) is freed: the update keeps less.  Where q
stays a view of it (GPT-2), the fused output is kept anyway and the copies come on top: it keeps more.  Both
trackers see the same on either path.  A CodeGen loop outside batchlab's harness, built with the default
`use_cache=True`, is where a reading 2.8% below batchlab's once came from: the copies, not a storage batchlab
miscounts.  The same update as above with the model's `config.use_cache` set to False, then to True (`--cache` runs
only this table):

{table(cache, CACHE_HEADER)}
"""


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="three rows, printed, no page written")
    p.add_argument("--only", default="", help="comma-separated family names (e.g. 'codegen,hf opt')")
    p.add_argument("--ac", default="none")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--cache", action="store_true", help="only the use_cache=True table, printed")
    p.add_argument("--out", default=str(ROOT / "docs" / "accuracy" / "tracker.md"))
    a = p.parse_args(argv)
    if a.cache:
        print(table([cache_row(n) for n in CACHE], CACHE_HEADER))
        return
    if a.quick:
        cases = QUICK
    elif a.only:
        cases = [(n, a.ac, a.precision) for n in a.only.split(",")]
    else:
        cases = [(n, "none", "fp32") for n in [*MODELS, *VISION, *UNSEEN]] + VARIANTS
    start, rows = time.perf_counter(), []
    for case in cases:
        print(f"{' '.join(case)} ...", file=sys.stderr, flush=True)
        rows.append(row(*case))
        print("  " + " | ".join(rows[-1][3:-1]), file=sys.stderr, flush=True)
    print(table(rows))
    if not (a.quick or a.only):
        cache = [cache_row(n) for n in CACHE]
        print(table(cache, CACHE_HEADER))
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page(rows, cache, time.perf_counter() - start, argv))
        print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
