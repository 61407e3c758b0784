"""Rendering of experiment records: Markdown / HTML documents (``document``), their plots (``plots``,
matplotlib imported only when drawing) and the notebook's exports (``export``: JSON, CSV, Markdown)."""
from batchlab.report.document import format_value, notebook_markdown, write_report
from batchlab.report.export import ExportFormat, export

__all__ = ["ExportFormat", "export", "format_value", "notebook_markdown", "write_report"]
