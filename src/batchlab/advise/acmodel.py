"""The activation-checkpointing planner's model at one micro-batch: per layer and policy the bytes it holds and
the seconds it adds, and the constants of the peak walk (advise/acplan.py explains the model)."""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.advise import knapsack
from batchlab.config import ACMode, RunConfig

MODEL_TEXT = ("peak = max(forward end + every layer's kept, each layer's backward: the layers below keep theirs "
              "while it is rebuilt whole, optimizer step) in allocated tensor bytes (formula); costs: the per-op "
              "time model's recompute seconds per layer policy; exact by dynamic programming over the budget in "
              f"1/{knapsack.UNITS} steps (beyond {knapsack.DP_LAYERS} alike layers: counts per policy in exact "
              "bytes), checked by the formula's full estimate of the plan")


@dataclass(frozen=True)
class LayerModel:
    """The planner's model at one micro-batch (bytes, seconds); options in ``modes`` order."""

    cfg: RunConfig
    modes: tuple[ACMode, ...]
    held: tuple[tuple[int, ...], ...]  # per layer, per option: what it holds below the layers still in backward
    seconds: tuple[tuple[float, ...], ...]  # per layer, per option: update seconds it adds over no recompute
    walk: tuple[int, ...]  # B_i, bottom layer first
    forward: int  # F: the total constraint's constant (the backward's start; the forward too where kept is None)
    optimizer: int  # O
    solved: str = MODEL_TEXT  # which peak and which costs, for the output
    provenance: str = "formula"
    # under autocast the forward holds every layer's weight copies whatever the plan: its total counts only what
    # the layers keep (per layer, per option) above ``forward_kept``; None: the held bytes count there too
    kept: tuple[tuple[int, ...], ...] | None = None
    forward_kept: int = 0

    @property
    def layers(self) -> int:
        return len(self.walk)

    def peak(self, choice: tuple[int, ...]) -> int:
        prefix, worst = 0, self.optimizer
        for i, j in enumerate(choice):
            worst = max(worst, self.walk[i] + prefix)
            prefix += self.held[i][j]
        if self.kept is not None:
            worst = max(worst, self.forward_kept + sum(self.kept[i][j] for i, j in enumerate(choice)))
        return max(worst, self.forward + prefix)


