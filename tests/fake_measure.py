"""A measure function with known figures for the compare tests (the protocol calls it instead of a subprocess).

The figures are chosen by each test so that the paired ratios are known by hand.
"""
from __future__ import annotations

from batchlab.config import RunConfig
from batchlab.experiment.change import parse_change
from batchlab.experiment.compare import make_plan
from batchlab.experiment.predict import parse_predictions
from batchlab.measure.options import MeasureOptions
from batchlab.measure.result import MeasuredMemory, MeasuredTime, Measurement, Outcome
from batchlab.config.phase import Phase
from batchlab.timeline.data import CATEGORIES, PhaseSpan, Timeline

BASE = RunConfig(seq=16, micro_batch=2, accum=2)


def fake_timeline(peak: int, ops: int = 1200, params: int = 100) -> Timeline:
    """One update by hand: forward (first third) builds activations linearly up to ``peak - params`` at its
    last op, backward frees them while gradients grow to ``params``, the optimizer adds ``params`` of state.
    One sample per op, so the peak sample is op ``ops // 3 - 1`` and its total is exactly ``peak``."""
    third = ops // 3
    act = [round((peak - params) * (i + 1) / third) if i < third else
           round((peak - params) * (1 - (i - third + 1) / third)) if i < 2 * third else 0 for i in range(ops)]
    grad = [0 if i < third else min(params, round(params * (i - third + 1) / third)) for i in range(ops)]
    opt = [params if i >= 2 * third else 0 for i in range(ops)]
    parts = dict.fromkeys(CATEGORIES, (0,) * ops) | {"parameters": (params,) * ops, "activations": tuple(act),
                                                      "gradients": tuple(grad), "optimizer": tuple(opt)}
    spans = (PhaseSpan("forward 1", "forward", 0, third - 1), PhaseSpan("backward 1", "backward", third, 2 * third - 1),
             PhaseSpan("optimizer", "optimizer", 2 * third, ops - 1))
    return Timeline("allocator", "fake", "fake update", tuple(range(ops)),
                    tuple(0 if i < third else 1 if i < 2 * third else 2 for i in range(ops)), spans, parts,
                    ("aten.fake",) * ops, peak_bytes=peak, peak_sample=third - 1,
                    formula_phase_peaks={"forward": peak, "backward": peak - params})


class FakeMeasure:
    """Per side: peak bytes, and a median update time per round (5 samples around it); records the calls.

    ``fail``: {(side, round): Outcome} to return instead of a result; ``raise_at``: call number that raises.
    A call asking for a timeline (``options.timeline``) gets ``fake_timeline`` of that side's peak;
    ``timeline_asked`` records which calls asked.
    """

    def __init__(self, a_b, peak=(1000, 1000), times=((1.0, 1.0),) * 3, phase="backward", fail=None,
                 raise_at=None, exc=KeyboardInterrupt, data_share=0.0):
        self.a, self.b = a_b
        self.peak, self.times, self.phase = peak, times, phase
        self.fail, self.raise_at, self.exc = fail or {}, raise_at, exc
        self.data_share = data_share
        self.calls: list[tuple[str, int]] = []
        self.timeline_asked: list[tuple[str, int]] = []

    def __call__(self, cfg: RunConfig, options: MeasureOptions) -> Measurement:
        assert options.isolate, "compare must measure every side in a fresh process"
        side = "a" if cfg == self.a else "b"
        rnd = sum(1 for s, _ in self.calls if s == side)
        self.calls.append((side, rnd))
        if options.timeline:
            self.timeline_asked.append((side, rnd))
        if self.raise_at is not None and len(self.calls) == self.raise_at:
            raise self.exc()
        i = 0 if side == "a" else 1
        if (side, rnd) in self.fail:
            return Measurement(cfg.to_dict(), self.fail[(side, rnd)], cfg.global_batch, outcome_detail="fake")
        med = self.times[rnd][i]
        samples = [med * 0.98, med, med * 1.01, med, med * 1.02]
        phases = {"data": med * self.data_share, "forward": med * (1 - self.data_share) / 2,
                  "backward": med * (1 - self.data_share) / 2}
        tokens = cfg.global_batch * cfg.seq
        return Measurement(cfg.to_dict(), Outcome.OK, cfg.global_batch,
                           memory=MeasuredMemory(self.peak[i], self.peak[i] // 2, Phase(self.phase)),
                           time=MeasuredTime(samples=samples, phase_seconds=phases, warmup=options.warmup),
                           tokens_per_second=tokens / med, useful_tokens_per_update=tokens,
                           environment={"torch_device": "cpu"},
                           timeline=fake_timeline(self.peak[i]) if options.timeline else None)


def plan_for(change="micro_batch=1:2", predict=None, **kw):
    p = make_plan(BASE, [parse_change(change, BASE)], predictions=parse_predictions(predict), **kw)
    return p
