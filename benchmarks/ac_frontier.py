"""`batchlab fit --ac auto`: the per-layer activation-checkpointing plan against a real run and the presets.

For each model (batchlab's GPT, Hugging Face Llama, GPT-2 and GPT-NeoX built offline from their configs, two
vision factories) and budgets spread between the all-full-AC and the no-AC predicted peaks: plan (micro-batch
held, margin 0), measure the plan in an isolated process (allocator peak, one update after one warm-up), and
put its predicted update time beside the best preset that fits the same budget (none, full, every:K and the
selective policies, predicted the same way).  For a few cases a real `batchlab compare` (interleaved rounds,
each side in a process of its own) of that preset against the plan gives the measured time verdict.

    PYTHONPATH=src:. .venv/bin/python benchmarks/ac_frontier.py > docs/accuracy/ac_frontier.md
    PYTHONPATH=src:. .venv/bin/python benchmarks/ac_frontier.py --only HF     # the Hugging Face rows alone
    # rerun some models and keep the table's other rows
    PYTHONPATH=src:. .venv/bin/python benchmarks/ac_frontier.py --only "GPT|llama" --into docs/accuracy/ac_frontier.md

Markdown on stdout, progress on stderr.  Run it on a quiet machine: the compare verdicts are wall-clock.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys

from batchlab.advise.acplan import plan_ac, uniform
from batchlab.advise.fit import isolated_measure
from batchlab.advise.plan import Goal
from batchlab.cache.calibrations import load_all
from batchlab.config import ACMode, RunConfig, preset
from batchlab.formula import estimate
from batchlab.util.units import fmt_bytes, fmt_seconds

FRACTIONS = (0.2, 0.4, 0.6, 0.8)  # budgets between the full-AC peak (0) and the no-AC peak (1)
HF_SHAPE = dict(layers=6, hidden=64, heads=4, ffn=256, vocab=256, seq=128, micro_batch=4, dp=1)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def hf(family: str, **extra) -> RunConfig:
    from batchlab.cli.common import build_config, with_layer_profile

    cfg = build_config(model=f"hf:{family}", **{**HF_SHAPE, **extra})
    return with_layer_profile(cfg, [cfg.replace(ac=a) for a in ("full", "selective")])


def factory(name: str, layers: int, micro_batch: int) -> RunConfig:
    return RunConfig(model=preset("tiny", layers=layers), model_source=f"tests.vision_models:{name}", seq=128,
                     micro_batch=micro_batch)


def cases() -> list[tuple[str, object, tuple[float, ...], bool]]:
    """(label, a function making the base config, budget fractions, compare one of them)."""
    return [
        ("batchlab GPT, 8 layers, fp32", lambda: RunConfig(model=preset("tiny", layers=8), seq=128, micro_batch=8),
         FRACTIONS, True),
        ("batchlab GPT, 6 layers, bf16-mixed, sdpa, seq 256",
         lambda: RunConfig(model=preset("tiny", layers=6, attention="sdpa", dropout=0.0), seq=256, micro_batch=4,
                           precision="bf16-mixed"), (0.3, 0.7), False),
        ("batchlab GPT, 4 layers, fp32, sdpa, seq 4096 (keep attention outputs pays)",
         lambda: RunConfig(model=preset("tiny", layers=4, attention="sdpa", dropout=0.0, max_positions=4096),
                           seq=4096, micro_batch=1), FRACTIONS, True),
        ("batchlab GPT, 8 layers, fp32, FSDP2 ZeRO-3 over 2 gloo ranks",
         lambda: RunConfig(model=preset("tiny", layers=8), seq=128, micro_batch=8, dp=2, zero=3), (0.3, 0.6), True),
        ("HF llama (6 layers, h 64)", lambda: hf("llama"), FRACTIONS[1:], True),
        ("HF llama (6 layers, h 64), FSDP2 ZeRO-2 over 2 gloo ranks",
         lambda: hf("llama").replace(dp=2, zero=2), (0.5,), False),
        ("HF gpt2 (6 layers, h 64)", lambda: hf("gpt2"), FRACTIONS[1:], False),
        ("HF gpt_neox (6 layers, h 64)", lambda: hf("gpt_neox", kv_heads=4), (0.5,), False),
        ("vision factory ViT (2 blocks)", lambda: factory("vit", 2, 32), (0.5,), True),
        ("vision factory CNN (3 blocks)", lambda: factory("cnn", 3, 32), (0.5,), False),
    ]


def peak(cfg: RunConfig, ac, cals) -> int:
    if cfg.model_kind.value == "factory":
        from batchlab.advise.acplan_trace import traced

        t = traced(cfg.replace(ac=ac), cals)
        return t.memory.peak_bytes + t.memory.margin_bytes
    return estimate(cfg.replace(ac=ac), cals).memory.peak_bytes


def compare(cfg: RunConfig, a: str, b: str) -> str:
    """A real `batchlab compare --change ac=A->B` (the usual protocol); its update-time verdict."""
    args = [sys.executable, "-m", "batchlab", "compare", "--change", f"ac={a}->{b}", "--json", "--no-calibrate",
            "--config", _toml(cfg)]
    log(f"  compare {a} -> {b} ...")
    r = subprocess.run(args, capture_output=True, text=True, timeout=1800, env=dict(os.environ))
    if r.returncode not in (0, 1):
        return f"failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"
    t = json.loads(r.stdout)["metrics"]["update_time"]
    lo, hi = t["band"] or (None, None)
    slower = t["observed"] == "up"
    return (f"plan/preset {t['ratio']:.3f} [{lo:.3f}, {hi:.3f}]: {t['observed'] or 'no verdict (noise)'}"
            + (" (plan slower)" if slower else ""))


def _toml(cfg: RunConfig) -> str:
    from batchlab.advise import config_toml

    path = f"/tmp/ac_frontier_{os.getpid()}.toml"
    with open(path, "w") as f:
        f.write(config_toml(cfg))
    return path


def run_case(label: str, base: RunConfig, fractions, with_compare: bool, cals) -> list[list[str]]:
    n = base.model.layers
    if base.model_kind.value == "factory":
        from batchlab.advise.acplan_trace import trace_layer_model

        n = trace_layer_model(base, cals).layers
    lo, hi = peak(base, uniform(ACMode.FULL, n), cals), peak(base, uniform(ACMode.NONE, n), cals)
    rows = []
    for k, f in enumerate(fractions):
        budget = int(lo + (hi - lo) * f)
        log(f"{label}: budget {fmt_bytes(budget)} ({f:.0%} of the way from full-AC {fmt_bytes(lo)} to none "
            f"{fmt_bytes(hi)})")
        goal = Goal(base.replace(memory_budget=budget), margin=0.0, held=frozenset({"micro_batch"}))
        p = plan_ac(goal, budget)
        c, best = p.chosen, p.best_preset
        if c is None:
            rows.append([label, fmt_bytes(budget), "none fits", "", "", "", "", "", ""])
            continue
        t = isolated_measure(budget)(p.config)
        err = (c.peak_bytes - t.peak_bytes) / t.peak_bytes if t.peak_bytes else None
        ok = t.fits and t.peak_bytes is not None and t.peak_bytes <= budget and err is not None and abs(err) <= 0.03
        vs = "-" if best is None else f"{fmt_seconds(best.update_seconds)} ({best.ac})"
        better = best is None or c.update_seconds < best.update_seconds * (1 - 1e-9)
        verdict = ""
        if with_compare and k == len(fractions) // 2 and best is not None and best.ac != c.ac:
            verdict = compare(p.config, best.ac, c.ac)
        tie = "" if better else (f" (no plan is faster below {fmt_bytes(least_budget_beating(p, hi, cals))} "
                                 f"[{p.provenance}])")
        rows.append([label, fmt_bytes(budget), f"`{c.ac}`", fmt_bytes(c.peak_bytes),
                     f"{fmt_bytes(t.peak_bytes) if t.peak_bytes else t.outcome}" + ("" if ok else " **(fails)**"),
                     f"{err:+.2%}" if err is not None else "-", f"{fmt_seconds(c.update_seconds)}", vs,
                     ("strictly better" if better else "equal" + tie) + (f"; {verdict}" if verdict else "")])
    return rows


def least_budget_beating(p, hi: int, cals) -> int:
    """Where the plan ties the best preset: the least budget (to 0.1%) at which the planner's exact optimum is
    strictly faster than that preset -- what a plan between the presets would need."""
    from batchlab.advise.acplan import model_at, plan_within

    lm = model_at(p.config.replace(ac="none"), cals)
    target = p.best_preset.update_seconds * (1 - 1e-9)
    lo, top = p.budget_bytes, max(hi, p.budget_bytes)
    while top - lo > max(top // 1000, 1):
        mid = (lo + top) // 2
        q = plan_within(lm, mid, cals)
        lo, top = (lo, mid) if q is not None and q.update_seconds < target else (mid, top)
    return top


def main() -> None:
    import argparse

    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="run only the models whose label holds one of these "
                                                   "|-separated texts")
    parser.add_argument("--into", default=None, help="a table this script wrote: keep its rows of the models "
                                                     "not run, replace the others; print the merged table")
    args = parser.parse_args()
    only = args.only.split("|")
    cals = load_all()
    head = ["model", "budget", "plan", "predicted peak", "measured peak", "error", "predicted update (plan)",
            "best fitting preset (predicted)", "plan vs preset; compare verdict"]
    rows = []
    for label, make, fractions, with_compare in cases():
        if not any(o in label for o in only):
            continue
        try:
            rows += run_case(label, make(), fractions, with_compare, cals)
        except Exception as e:  # noqa: BLE001 — one model's failure is a row, not the end of the table
            log(f"{label}: {type(e).__name__}: {e}")
            rows.append([label, "-", f"error: {type(e).__name__}: {e}", "", "", "", "", "", ""])
    ran = {r[0] for r in rows}
    kept = [r for r in _table_rows(args.into) if r[0] not in ran] if args.into else []
    order = [c[0] for c in cases()]
    rows = sorted(rows + kept, key=lambda r: order.index(r[0]) if r[0] in order else len(order))
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print("# Activation-checkpointing plans: predicted vs measured, and against the presets\n")
    print(f"{datetime.date.today().isoformat()}, {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, CPU "
          "(allocator peak = live tensor bytes).\n")
    print("Reproduce: `PYTHONPATH=src:. python benchmarks/ac_frontier.py > docs/accuracy/ac_frontier.md`\n")
    print("Each row: `batchlab fit --ac auto` at that budget (micro-batch held, margin 0); the plan measured once "
          "in an isolated process; error = (predicted - measured) / measured; the best preset is the fastest of "
          "none, full, every:K and the selective policies whose predicted peak fits the budget, by the same "
          "predictor (formula; trace for the factories).  The compare verdict is a real `batchlab compare --change "
          "ac=PRESET->PLAN` (wall-clock, interleaved rounds): the plan is slower only when the verdict says so.\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()
    if kept:
        print(f"Rows of {', '.join(sorted({r[0] for r in kept}))} are kept from the earlier run of this table "
              f"(`--into`); the others are this run's.\n")
    print(summary(rows))


def _table_rows(path: str) -> list[list[str]]:
    """The data rows of a Markdown table this script printed."""
    out = []
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 9 and cells[0] != "model":
            out.append(cells)
    return out


def summary(rows: list[list[str]]) -> str:
    """Counts read off the table: fits, worst error, strictly better / equal, compare verdicts."""
    done = [r for r in rows if r[5] not in ("", "-")]
    worst = max((abs(float(r[5].rstrip("%"))) for r in done), default=0.0)
    fails = sum("(fails)" in r[4] for r in done)
    better = sum(r[8].startswith("strictly better") for r in done)
    verdicts = [r[8] for r in done if "plan/preset" in r[8]]
    slower = sum("(plan slower)" in v for v in verdicts)
    return (f"Reading it: {len(done)} budgets; the measured peak outside the budget or beyond 3% of the plan's at "
            f"{fails}; largest |error| {worst:.2f}%.  The plan's predicted update time is strictly below the best "
            f"fitting preset's at {better} of {len(done)} budgets and equal at the others (never above: fit takes "
            f"the preset when it is faster).  {len(verdicts)} real compares; the plan slower beyond the noise band "
            f"in {slower}.")


if __name__ == "__main__":
    main()
