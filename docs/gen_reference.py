"""MkDocs hook: the reference pages that describe data are generated from the code at every build.

- reference/files.md: the TOML ``[config]`` table (RunConfig's, ModelSpec's and Assumptions' fields) and the
  experiment file's keys, from ``dataclasses.fields`` and the parsers' own lists of accepted keys;
- reference/python.md: RunConfig's fields, in a table under its docstring;
- reference/json.md: the JSON contracts, from the records' dataclasses (Estimate, Measurement, Record, Timeline)
  and one real ``estimate --json`` document of the default configuration (formula only, no torch).

Field descriptions are the comments written beside each field in the source, so the page says what the code says.
Nothing here is copied by hand; a renamed field changes the page at the next build.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
import typing
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))


def _comments(cls) -> dict[str, str]:
    """name -> the comment on a field's line, or on the comment lines right above it."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    out, above = {}, []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# ").strip())
            continue
        m = re.match(r"\s+(\w+)\s*:\s*[^=#]+(?:=[^#]*)?(?:#\s*(.*))?$", line)
        if m and not stripped.startswith(("def ", "return", "@")):
            text = " ".join([*above, m.group(2) or ""]).strip()
            if text:
                out[m.group(1)] = text
        above = []
    return out


def _hints(cls) -> dict[str, object]:
    try:
        return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    except Exception:  # noqa: BLE001 — names only imported under TYPE_CHECKING: fall back to the strings
        return {}


def _nested(hint) -> list[type]:
    """The dataclasses a field's type refers to (Optional, Mapping values, tuples included)."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return [hint]
    return [c for arg in typing.get_args(hint) for c in _nested(arg)]


def _type_text(f: dataclasses.Field) -> str:
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return text.replace("|", "or")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = getattr(f.default, "value", f.default)
        return f"`{value!r}`" if value is not None else "none"
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return "(built)"
    return "required"


def field_tables(cls, seen: set | None = None, level: int = 3) -> list[str]:
    """A Markdown table of ``cls``'s fields, then one for each dataclass its fields hold."""
    seen = set() if seen is None else seen
    if cls in seen:
        return []
    seen.add(cls)
    notes, hints = _comments(cls), _hints(cls)
    doc = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
    if doc.startswith(f"{cls.__name__}("):  # the signature dataclasses write when there is no docstring
        doc = ""
    out = [f"{'#' * level} `{cls.__name__}`", "", f"`{cls.__module__}.{cls.__name__}`" + (f": {doc}" if doc else ""),
           "", "| field | type | default | meaning (from the source) |", "|---|---|---|---|"]
    children = []
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue
        meaning = notes.get(f.name, "").replace("|", "\\|").replace("<", "&lt;")
        out.append(f"| `{f.name}` | `{_type_text(f)}` | {_default(f)} | {meaning} |")
        children += [c for c in _nested(hints.get(f.name)) if c not in seen and c not in children]
    out.append("")
    for c in children:
        out += field_tables(c, seen, level)
    return out


def _shape(value, indent: int = 0) -> list[str]:
    """The key tree of a JSON document: every key, with the type and the value for scalars."""
    pad, out = "  " * indent, []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                out.append(f"{pad}{k}:")
                out += _shape(v, indent + 1)
            else:
                out.append(f"{pad}{k}: {json.dumps(v)}")
    elif isinstance(value, list):
        out.append(f"{pad}- [{len(value)} items] e.g.")
        out += _shape(value[0], indent + 1) if isinstance(value[0], (dict, list)) else [f"{pad}  {json.dumps(value[0])}"]
    return out


def files_page() -> str:
    from batchlab.config import Assumptions, ModelSpec, RunConfig
    from batchlab.config import CHANGEABLE_FIELDS
    from batchlab.experiment import spec

    out = ["# Config and experiment files", "",
           "*Generated from the code at every build (`docs/gen_reference.py`): the field lists are the dataclasses'"
           " own, the meanings the comments beside each field in the source.*", "",
           "## The `[config]` table", "",
           "`--config FILE` reads a TOML file's `[config]` table; `batchlab fit` prints one; an experiment file's"
           " `[config]` is the same table. Keys are `RunConfig` field names. `model` is a preset name, `hf:...` or"
           " `package.module:factory`, or a `[config.model]` table of `ModelSpec` fields; model and assumption"
           " fields may also be given flat; `global_batch` re-derives `accum` (the micro-batch is the table's, else 1).",
           "", "Keys a table or a one-variable change (`--change`, `--vary`) accepts:", "",
           ", ".join(f"`{k}`" for k in ("model", "global_batch", *CHANGEABLE_FIELDS)), "",
           "```toml", "[config]", 'model = "llama-2-7b"', "seq = 4096", "micro_batch = 1", "global_batch = 512",
           "dp = 8", 'precision = "bf16-mixed"', "zero = 1", 'ac = "full"', 'device = "h100-sxm"', "```", ""]
    for cls in (RunConfig, ModelSpec, Assumptions):
        out += field_tables(cls, {c for c in (RunConfig, ModelSpec, Assumptions) if c is not cls})
    doc = (spec.__doc__ or "").strip()
    out += ["## Experiment files", "", "`batchlab compare --experiment FILE` (`-e`). Top-level keys: "
            + ", ".join(f"`{k}`" for k in spec.TOP_LEVEL) + ".", "",
            "From `batchlab.experiment.spec`'s docstring:", "", "```text", doc, "```", ""]
    return "\n".join(out)


def json_page() -> str:
    from batchlab.config import RunConfig
    from batchlab.experiment.record import Record
    from batchlab.config import Assumptions, ModelSpec
    from batchlab.formula import Estimate, estimate
    from batchlab.measure.result import Measurement
    from batchlab.timeline.data import Timeline

    example = json.loads(json.dumps(estimate(RunConfig()).to_dict(), default=str))
    out = ["# JSON contracts", "",
           "*Generated from the code at every build (`docs/gen_reference.py`).* Every command's `--json` prints"
           " the records below (`to_dict` of the dataclasses); sizes are bytes, times seconds, rates per second.",
           "", "## `batchlab estimate --json`", "",
           "The key tree of `batchlab estimate --json` for the default configuration (tiny model, formula, no"
           " calibration), computed at build time (the capacity and the time are the build machine's CPU):", "",
           "```yaml", *_shape(example), "```", "",
           "`estimate --vary ... --json` prints a list, one such row per value; `--trace --json` adds the trace's"
           " figures beside the formula's. The fields, from the dataclasses behind it (the config's are on"
           " [config and experiment files](files.md)):", ""]
    seen = {RunConfig, ModelSpec, Assumptions}  # each dataclass described once on the page
    out += field_tables(Estimate, seen)
    out += ["", "## `batchlab measure --json`", ""]
    out += field_tables(Measurement, seen)
    out += ["## `--timeline FILE.json`", "", "One update's memory over time (`estimate --trace --timeline`,"
            " `measure --timeline`, and each side of a compare record): the [`Timeline`](#timeline) record above."
            " `max(samples.total) == peak_bytes` holds to the byte.", ""]
    out += field_tables(Timeline, seen)
    out += ["## `batchlab compare --json` (the experiment record)", "",
            "The record the notebook stores; `schema` is its version (the notebook reads every older one). Each"
            " round holds both sides' measurements, as above.", ""]
    out += field_tables(Record, seen)
    return "\n".join(out)


def device_sections() -> str:
    """One section per catalogue device: its capacity and peak figures, and the sources the catalogue names."""
    from batchlab.config import DEVICES

    out = []
    for name, d in DEVICES.items():
        if name == "cpu":  # the build machine's own: not a catalogue entry
            continue
        out += [f"## {name}", "", "| | |", "|---|---|",
                f"| capacity | {d.memory_bytes / 2**30:.2f} GiB |"]
        if getattr(d, "peak_flops_bf16", None):
            out.append(f"| peak | {d.peak_flops_bf16 / 1e12:g} TFLOP/s bf16, {d.peak_flops_fp32 / 1e12:g} fp32 |")
        if getattr(d, "peak_low", ""):
            out.append(f"| peak known only as a range | down to {d.peak_low}'s: estimate prices both ends and shows "
                       "the low end's tokens/s (`--json`: `time_at_low_peak`) |")
        for label, attr in (("capacity source", "memory_source"), ("figures source", "source"),
                            ("context source", "context_source")):
            text = getattr(d, attr, "")
            if text:
                out.append(f"| {label} | {str(text).replace('|', '/')} |")
        out.append("")
    return "\n".join(out)


def run_config_fields() -> str:
    """RunConfig's fields (and those of the policies it holds) as tables, for the Python API page."""
    from batchlab.config import Assumptions, ModelSpec, RunConfig

    return "\n".join(["*`RunConfig`'s fields, from `dataclasses.fields(RunConfig)` at every build; the meanings are"
                      " the comments beside each field in the source. `ModelSpec`'s and `Assumptions`' fields are on"
                      " [config and experiment files](files.md).*", "",
                      *field_tables(RunConfig, {ModelSpec, Assumptions}, level=4)])


PAGES = {"reference/files.md": files_page, "reference/json.md": json_page}
MARKERS = {"sources.md": ("<!-- devices -->", device_sections),
           "reference/python.md": ("<!-- RunConfig fields -->", run_config_fields)}


def on_page_markdown(markdown, page, config, files):
    marker = MARKERS.get(page.file.src_uri)
    if marker and marker[0] in markdown:
        return markdown.replace(marker[0], marker[1]())
    return markdown


def on_files(files, config):
    for path, build in PAGES.items():
        files.append(File.generated(config, path, content=build()))
    return files
