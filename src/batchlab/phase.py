"""The phases of one optimizer update, as the harness marks them and every report names them.  Torch-free.

``data`` (batch made), ``forward`` and ``backward`` (per micro-batch), ``optimizer`` (step and zero_grad);
``setup`` is before the first update (building the model), ``end`` the mark after an update's last phase.
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
