"""The memory timeline: tensor bytes live over one steady-state update, by category, with its phases.

    from batchlab.timeline.data import Timeline          # torch-free record (to_dict / from_dict)
    from batchlab.measure.timeline_update import record        # a real update on this machine (tracker / allocator)
    from batchlab.trace.run import estimate               # estimate(cfg, timeline=True).timeline: the trace's
    from batchlab.timeline.output import write           # FILE.png | FILE.html | FILE.json

Importing this package imports neither torch nor matplotlib.
"""
from __future__ import annotations

from batchlab.timeline.data import CATEGORIES, Timeline

__all__ = ["CATEGORIES", "Timeline"]
