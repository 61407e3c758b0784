"""``--timeline FILE``: the timeline written by the file's suffix (.png, .html, .json)."""
from __future__ import annotations

import json
from pathlib import Path

from batchlab.config import ConfigError
from batchlab.timeline.data import Timeline

SUFFIXES = (".png", ".html", ".json")


def check_path(path: str | Path) -> Path:
    p = Path(path)
    if p.suffix.lower() not in SUFFIXES:
        raise ConfigError("timeline", f"{path!r}: FILE must end in .png, .html or .json")
    return p


def write(t: Timeline, path: str | Path) -> Path:
    p = check_path(path)
    suffix = p.suffix.lower()
    if suffix == ".json":
        p.write_text(json.dumps(t.to_dict()))
    elif suffix == ".png":
        from batchlab.timeline.png import write_png

        write_png(t, p)
    else:
        from batchlab.timeline.html import render_html

        p.write_text(render_html(t), encoding="utf-8")
    return p


def load(path: str | Path) -> Timeline:
    return Timeline.from_dict(json.loads(Path(path).read_text()))
