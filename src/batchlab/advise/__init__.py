"""The advisor: pick micro-batch, accumulation and activation checkpointing for a fixed global batch
(formula first, measurement to confirm), and turn an out-of-memory into ordered advice.

    from batchlab.advise import Goal, fit
    report = fit(Goal(cfg, margin=0.1), verify=False)   # cfg's global batch is the target

Torch is imported only when a measurement runs.
"""
from __future__ import annotations

from batchlab.advise.fit import FitReport, fit, isolated_measure
from batchlab.advise.after_oom import Advice, Remedy, oom_advice, what_would_fit
from batchlab.advise.plan import Candidate, Goal, FitPlan, divisors, plan
from batchlab.advise.search import SearchResult, Trial, exhaustive, max_trials, search_largest, trial_from_measurement
from batchlab.advise.snippets import all_snippets, config_toml
from batchlab.config import load_config_toml

__all__ = ["Advice", "Candidate", "FitReport", "Goal", "FitPlan", "Remedy", "SearchResult", "Trial", "all_snippets",
           "config_toml", "divisors", "exhaustive", "fit", "isolated_measure", "load_config_toml", "max_trials",
           "oom_advice", "plan", "search_largest", "trial_from_measurement", "what_would_fit"]
