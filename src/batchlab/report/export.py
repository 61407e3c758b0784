"""``notebook export``: every record as JSON (whole records), CSV (one row each) or Markdown.  Torch-free."""
from __future__ import annotations

import csv
import io
import json
from typing import Any

from batchlab.config import Choice
from batchlab.experiment.observed import ObservedRecord
from batchlab.experiment.record import Record
from batchlab.util.text import for_markdown
from batchlab.util.units import fmt_bytes, fmt_seconds


class ExportFormat(Choice):
    JSON = "json"
    CSV = "csv"
    MD = "md"


def export(records: list[Record | ObservedRecord], fmt: ExportFormat | str) -> str:
    fmt = ExportFormat.parse("format", fmt)
    if fmt is ExportFormat.JSON:
        return json.dumps([r.to_dict() for r in records], indent=2) + "\n"
    if fmt is ExportFormat.CSV:
        return _csv(records)
    from batchlab.report.document import notebook_markdown

    compared = [r for r in records if isinstance(r, Record)]
    observed = observed_markdown([r for r in records if isinstance(r, ObservedRecord)])
    return (notebook_markdown(compared) if compared or not observed else "") + observed


CSV_METRIC_FIELDS = ("observed", "ratio", "band_low", "band_high", "predicted_by_user", "predicted_by_formula",
                     "held_user", "held_formula")


def _v(d) -> str | None:
    return d.value if d is not None else None


def observed_csv_row(r: ObservedRecord) -> dict[str, Any]:
    row = {"id": r.notebook_id, "created_at": r.created_at, "kind": "observed",
           "variable": f"observed ({r.source.value})", "global_batch": r.global_batch}
    return row | {f"{f.name} ({f.provenance})": f.observed for f in r.figures}


def csv_row(r: Record | ObservedRecord) -> dict[str, Any]:
    if isinstance(r, ObservedRecord):
        return observed_csv_row(r)
    gb = r.change["global_batch"]
    row = {"id": r.notebook_id, "created_at": r.created_at, "status": _v(r.status), "kind": r.kind.value,
           "variable": r.change["variable"], "keep_mode": r.keep_mode.value, "global_batch_a": gb["a"],
           "global_batch_b": gb["b"], "note": r.note, "verdict": r.verdict or ""}
    for metric, m in r.metrics.items():
        band = m.band or (None, None)
        values = (_v(m.observed), m.ratio, band[0], band[1], _v(m.predicted_by_user), _v(m.predicted_by_formula),
                  m.held_user, m.held_formula)
        row.update({f"{metric.value}_{k}": v for k, v in zip(CSV_METRIC_FIELDS, values)})
    factors = r.factors or {}
    load = (factors.get("load_average") or {}).get("before")
    row["load_average_1m"] = load[0] if load else None
    row["busy_processes"] = (factors.get("busy_processes") or {}).get("count")
    return row


def _csv(records: list[Record | ObservedRecord]) -> str:
    rows = [csv_row(r) for r in records]
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns or ["id"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def observed_markdown(records: list[ObservedRecord]) -> str:
    """Observed runs as one Markdown table: each figure with the provenance it was obtained by."""
    if not records:
        return ""
    lines = ["## Observed runs (nothing controlled)", "",
             "| id | source | model | global batch | peak memory | formula | update time |", "|---|---|---|---|---|---|---|"]
    for r in records:
        mem, t = r.figure("peak memory"), r.figure("update time (median)")
        cells = " | ".join(for_markdown(x) for x in (r.source.value, r.settings.model, r.settings.global_batch_text()))
        lines.append(f"| {r.notebook_id} | {cells} "
                     f"| {_figure(mem, fmt_bytes)} | {fmt_bytes(mem.predicted) if mem else '-'} (formula) "
                     f"| {_figure(t, fmt_seconds)} |")
    return "\n".join(lines) + "\n"


def _figure(f, fmt) -> str:
    return f"{fmt(f.observed)} ({f.provenance})" if f is not None else "-"
