"""The phases of one optimizer update, as the harness marks them and every report names them.  Torch-free.

``data`` (batch made), ``forward`` and ``backward`` (per micro-batch), ``optimizer`` (step and zero_grad);
``setup`` is before the first update (building the model), ``end`` the mark after an update's last phase.

Kept apart from config/choices.py on purpose: those are the closed sets a user chooses a run by (precision,
optimizer, ...); a phase is not chosen but observed — the harness marks it, the formula names where its peak
falls, the timeline and the reports label by it — so config does not own it, and the calculator,
measurement and reports import it from here without depending on each other.
"""
from __future__ import annotations

from batchlab.config import _Choice


class Phase(_Choice):
    SETUP = "setup"
    DATA = "data"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    END = "end"


UPDATE_PHASES = (Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
