"""Observed runs in the notebook's Markdown export (records as stored: dicts).  Torch-free."""
from __future__ import annotations

from typing import Any

from batchlab.text import for_markdown
from batchlab.units import fmt_bytes, fmt_seconds


def markdown(records: list[dict[str, Any]]) -> str:
    """Observed runs as one Markdown table (``notebook export --format md``): figures with their provenance."""
    if not records:
        return ""
    lines = ["## Observed runs (nothing controlled)", "",
             "| id | source | model | global batch | peak memory (allocator) | formula | update time (wall-clock) |",
             "|---|---|---|---|---|---|---|"]
    for d in records:
        figs = {f["name"]: f for f in d["figures"]}
        mem, t = figs.get("peak memory", {}), figs.get("update time (median)", {})
        cells = (for_markdown(x) for x in (d["source"], d["settings"]["model"], d["global_batch_text"]))
        lines.append(f"| {d.get('notebook_id')} | {' | '.join(cells)} "
                     f"| {fmt_bytes(mem.get('observed'))} | {fmt_bytes(mem.get('predicted'))} "
                     f"| {fmt_seconds(t.get('observed'))} |")
    return "\n".join(lines) + "\n"
