"""Controlled single-variable experiments: ``batchlab compare`` as a library, and the lab notebook.

    from batchlab.experiment import make_plan, parse_change, run, Notebook
    plan = make_plan(cfg, [parse_change("ac=none:full", cfg)], predictions=parse_predictions("memory=down,time=up"))
    record = run(plan, Notebook("lab.sqlite"))

Importing this package does not import torch (the measurement runs in subprocesses; the gradient check
imports torch when it runs).
"""
from batchlab.experiment.change import Change, KeepMode, Sides, build_sides, parse_change
from batchlab.experiment.compare import DEFAULT_CHANGE, ExperimentPlan, make_plan, run
from batchlab.experiment.notebook import Notebook, default_path
from batchlab.experiment.predict import Direction, Metric, parse_predictions
from batchlab.experiment.record import Record
from batchlab.experiment.spec import load as load_experiment

__all__ = ["Change", "DEFAULT_CHANGE", "Direction", "ExperimentPlan", "KeepMode", "Metric", "Notebook", "Record",
           "Sides", "build_sides", "default_path", "load_experiment", "make_plan", "parse_change",
           "parse_predictions", "run"]
