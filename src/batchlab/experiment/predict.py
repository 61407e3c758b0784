"""Predictions written down before anything runs: the person's (``--predict``) and the formula's.  Torch-free."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchlab.config import ConfigError, Choice
from batchlab.util.units import SAME_TOLERANCE


class Direction(Choice):
    UP = "up"
    DOWN = "down"
    SAME = "same"

    @property
    def symbol(self) -> str:
        return {"up": "↑", "down": "↓", "same": "≈"}[self.value]


class Metric(Choice):
    PEAK_MEMORY = "peak_memory"
    UPDATE_TIME = "update_time"
    TOKENS_PER_SECOND = "tokens_per_second"
    TIME_TO_BUDGET = "time_to_budget"
    OOM = "oom"

    @property
    def label(self) -> str:
        return {"peak_memory": "peak memory", "update_time": "update time", "tokens_per_second": "useful tokens/s",
                "time_to_budget": "time to token budget", "oom": "out of memory"}[self.value]

    def label_for(self, unit: str) -> str:
        """The label by the unit the record measured: a per-sample model's throughput is samples/s."""
        return f"useful {unit}" if self is Metric.TOKENS_PER_SECOND and unit.endswith("/s") else self.label

    @property
    def short(self) -> str:
        """One word, for one-line summaries."""
        return {"peak_memory": "memory", "update_time": "time", "tokens_per_second": "tokens/s",
                "time_to_budget": "budget", "oom": "oom"}[self.value]


METRIC_ALIASES = {
    "memory": Metric.PEAK_MEMORY, "mem": Metric.PEAK_MEMORY, "peak": Metric.PEAK_MEMORY,
    "time": Metric.UPDATE_TIME, "step_time": Metric.UPDATE_TIME,
    "tokens": Metric.TOKENS_PER_SECOND, "throughput": Metric.TOKENS_PER_SECOND, "tps": Metric.TOKENS_PER_SECOND,
    "budget": Metric.TIME_TO_BUDGET,
}
DIRECTION_ALIASES = {
    "↑": Direction.UP, "+": Direction.UP, "increase": Direction.UP, "higher": Direction.UP, "more": Direction.UP,
    "↓": Direction.DOWN, "-": Direction.DOWN, "decrease": Direction.DOWN, "lower": Direction.DOWN,
    "less": Direction.DOWN, "≈": Direction.SAME, "=": Direction.SAME, "unchanged": Direction.SAME,
}
_METRIC_HELP = "memory, time, tokens_per_second, time_to_budget, oom"


def parse_metric(text: str) -> Metric:
    key = text.strip().lower().replace("-", "_")
    if key in METRIC_ALIASES:
        return METRIC_ALIASES[key]
    try:
        return Metric(key)
    except ValueError:
        raise ConfigError("predict", f"unknown metric {text.strip()!r}; allowed: {_METRIC_HELP}") from None


def parse_direction(text: str, metric: str = "") -> Direction:
    key = text.strip().lower()
    if key in DIRECTION_ALIASES:
        return DIRECTION_ALIASES[key]
    try:
        return Direction(key)
    except ValueError:
        where = f" for {metric}" if metric else ""
        raise ConfigError("predict", f"{text.strip()!r}{where} is not up, down or same") from None


def parse_predictions(text: str | None) -> dict[Metric, Direction]:
    """``memory=up,time=down``; ``none`` or empty: no prediction."""
    if text is None or text.strip().lower() in ("", "none"):
        return {}
    out: dict[Metric, Direction] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise ConfigError("predict", f"{part!r} is not METRIC=DIRECTION (example: memory=up,time=down)")
        metric = parse_metric(name)
        if metric in out:
            raise ConfigError("predict", f"{metric.value} is predicted twice")
        out[metric] = parse_direction(value, metric.value)
    return out


def predictions_from_mapping(d: dict[str, Any]) -> dict[Metric, Direction]:
    """Experiment files: ``predict = {memory = "up", time = "down"}``."""
    return parse_predictions(",".join(f"{k}={v}" for k, v in d.items()))


# Formula figures are exact functions of the config: a change inside the shared "same" band is "same".
FORMULA_SAME_TOLERANCE = SAME_TOLERANCE


# A compile change's time is priced by a fusion rule on the op list (formula/fusion.py), not by the kernels
# inductor writes; a predicted difference inside this margin is within the rule's own error and the spread of
# timed CPU updates, so the formula gives no time direction for it.
COMPILED_TIME_MARGIN = 0.10
TIME_METRICS = ("update_time", "tokens_per_second", "time_to_budget")


def compiled_time_prediction(pred: dict) -> tuple[dict, str]:
    """A compile change's formula prediction: its time metrics kept where the predicted update time moves by more
    than COMPILED_TIME_MARGIN, else dropped, with the reason."""
    ratio = (pred.get(Metric.UPDATE_TIME) or {}).get("ratio")
    if ratio is not None and abs(ratio - 1.0) > COMPILED_TIME_MARGIN:
        return pred, ""
    kept = {m: p for m, p in pred.items() if m.value not in TIME_METRICS}
    shown = f"x{ratio:.2f}" if ratio is not None else "none"
    return kept, (f"no formula time prediction: the compiled update time it predicts ({shown}) is within "
                  f"{COMPILED_TIME_MARGIN:.0%} of eager's, inside the fusion rule's own error")


def direction_of(ratio: float | None, tolerance: float) -> Direction | None:
    if ratio is None or ratio != ratio:
        return None
    if abs(ratio - 1.0) < tolerance:
        return Direction.SAME
    return Direction.UP if ratio > 1.0 else Direction.DOWN


@dataclass(frozen=True)
class FormulaSide:
    """The formula's figures for one side (provenance ``formula``)."""

    peak_bytes: float
    update_seconds: float
    tokens_per_second: float
    fits: bool

    def value(self, metric: Metric, token_budget: float) -> float | bool:
        if metric is Metric.PEAK_MEMORY:
            return self.peak_bytes
        if metric is Metric.UPDATE_TIME:
            return self.update_seconds
        if metric is Metric.TOKENS_PER_SECOND:
            return self.tokens_per_second
        if metric is Metric.TIME_TO_BUDGET:
            return token_budget / self.tokens_per_second
        return not self.fits

    @classmethod
    def from_estimate(cls, est) -> "FormulaSide":
        return cls(est.memory.peak_bytes, est.time.update_seconds, est.time.tokens_per_second, bool(est.memory.fits))


def oom_direction(a_oom: bool, b_oom: bool) -> Direction:
    """OOM as a metric: ``up`` when side B runs out of memory and A does not."""
    if a_oom == b_oom:
        return Direction.SAME
    return Direction.UP if b_oom else Direction.DOWN


def formula_prediction(a: FormulaSide, b: FormulaSide, token_budget: float) -> dict[Metric, dict[str, Any]]:
    """Per metric: the formula's values for A and B, the ratio B/A and its direction."""
    out: dict[Metric, dict[str, Any]] = {}
    for metric in Metric:
        va, vb = a.value(metric, token_budget), b.value(metric, token_budget)
        if metric is Metric.OOM:
            out[metric] = {"a": va, "b": vb, "ratio": None, "direction": oom_direction(va, vb)}
            continue
        ratio = vb / va if va else None
        out[metric] = {"a": va, "b": vb, "ratio": ratio, "direction": direction_of(ratio, FORMULA_SAME_TOLERANCE)}
    return out
