"""The training-step semantics the harness promises, each checked on real updates of the tiny model.

Gradients are captured inside Trainer.update() at its "optimizer" mark: after accumulation, before
unscale/clip/step, i.e. exactly what the optimizer is about to use.
"""
from __future__ import annotations

import pytest
import torch

from batchlab.config import RunConfig, preset
from batchlab.measure.harness import Trainer

SEQ = 16


class GradCapture:
    """A phase listener that copies the accumulated gradients when the optimizer phase starts."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def mark(self, phase: str) -> None:
        if phase == "optimizer":
            self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}


def update_grads(trainer: Trainer, batches=None) -> dict[str, torch.Tensor]:
    if batches is not None:
        trainer.batches = lambda: batches
    cap = GradCapture(trainer.raw_model)
    trainer.update(listener=cap)
    return cap.grads


def max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in a)


def whole_batch(cfg: RunConfig, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    from batchlab.models import synthetic_tokens

    return synthetic_tokens(cfg.model.vocab, cfg.data)(torch.Generator().manual_seed(123), n, cfg.seq, torch.device("cpu"))


def reference_grads(cfg: RunConfig, tokens, targets) -> dict[str, torch.Tensor]:
    """Independent reference: one plain forward/backward of the whole batch, mean over useful tokens."""
    torch.manual_seed(cfg.seed)
    from batchlab.models.gpt import GPT

    model = GPT(cfg.model)
    model.train()
    logits_loss = model(tokens, targets)  # F.cross_entropy(..., ignore_index=-100, reduction="mean")
    logits_loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("data", ["fixed", "padded"])
def test_accumulation_equals_whole_batch(data):
    """micro 4 x accum 2 and micro 8 x accum 1 give the whole batch's gradient (fp32, rel <= 1e-5)."""
    base = RunConfig(model=preset("tiny", layers=2, dropout=0.0), seq=SEQ, data=data)
    tokens, targets = whole_batch(base, 8)
    if data == "padded":
        useful = (targets != -100).sum(dim=1)
        assert useful[:4].sum() != useful[4:].sum()  # unequal micro-batches: per-micro-batch means would differ

    acc = update_grads(Trainer(base.replace(micro_batch=4, accum=2)),
                       [(tokens[:4], targets[:4]), (tokens[4:], targets[4:])])
    one = update_grads(Trainer(base.replace(micro_batch=8, accum=1)), [(tokens, targets)])
    ref = reference_grads(base, tokens, targets)
    assert max_rel_diff(acc, one) <= 1e-5
    assert max_rel_diff(acc, ref) <= 1e-5


def test_padded_normalised_over_whole_update_not_per_micro_batch():
    """The naive per-micro-batch mean, averaged, is measurably different from what the harness computes."""
    cfg = RunConfig(model=preset("tiny", layers=2, dropout=0.0), seq=SEQ, data="padded", micro_batch=4, accum=2)
    tokens, targets = whole_batch(cfg, 8)
    harness = update_grads(Trainer(cfg), [(tokens[:4], targets[:4]), (tokens[4:], targets[4:])])
    torch.manual_seed(cfg.seed)
    from batchlab.models.gpt import GPT

    model = GPT(cfg.model)
    for sl in (slice(0, 4), slice(4, 8)):
        (model(tokens[sl], targets[sl]) / 2).backward()  # mean per micro-batch, averaged over accum
    naive = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert max_rel_diff(naive, harness) > 1e-3


def test_useful_tokens_exclude_padding():
    cfg = RunConfig(model=preset("tiny", layers=2, dropout=0.0), seq=SEQ, data="padded", micro_batch=4, accum=2)
    tr = Trainer(cfg)
    tokens, targets = whole_batch(cfg, 8)
    tr.batches = lambda: [(tokens[:4], targets[:4]), (tokens[4:], targets[4:])]
    result = tr.update()
    assert result.useful_tokens == int((targets != -100).sum()) < 8 * SEQ
    # the reported loss is the whole update's mean over useful tokens
    torch.manual_seed(cfg.seed)
    from batchlab.models.gpt import GPT

    expected = GPT(cfg.model)(tokens, targets).item()
    assert result.loss == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("ac", ["full", "every:2", "selective"])
def test_activation_checkpointing_bitwise_equal_with_dropout(ac):
    cfg = RunConfig(model=preset("tiny", layers=2), seq=SEQ, micro_batch=2)  # tiny has dropout 0.1
    assert cfg.model.dropout > 0
    plain = update_grads(Trainer(cfg))
    tr = Trainer(cfg.replace(ac=ac))
    assert tr.wrapped_layers  # the policy really wrapped layers
    # a wrapped block's parameters are named blocks.i.block.* (models/ac.py Checkpointed)
    checkpointed = {n.replace(".block.", "."): g for n, g in update_grads(tr).items()}
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        assert torch.equal(plain[name], checkpointed[name]), name


def test_dropout_really_changes_gradients():
    """Guards the test above: with a different dropout draw the gradients are not bitwise equal."""
    cfg = RunConfig(model=preset("tiny", layers=2), seq=SEQ, micro_batch=2)
    a = update_grads(Trainer(cfg))
    tr = Trainer(cfg)
    torch.manual_seed(999)  # a different dropout mask, same weights and data
    b = update_grads(tr)
    assert any(not torch.equal(a[n], b[n]) for n in a)


class Counter:
    def __init__(self):
        self.calls: dict[str, int] = {}

    def wrap(self, obj, name: str, key: str):
        original = getattr(obj, name)

        def counted(*args, **kwargs):
            self.calls[key] = self.calls.get(key, 0) + 1
            return original(*args, **kwargs)

        setattr(obj, name, counted)


@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed"])
def test_optimizer_scheduler_scaler_step_once_per_update(precision):
    cfg = RunConfig(model=preset("tiny", layers=2, dropout=0.0), seq=SEQ, micro_batch=2, accum=3, precision=precision)
    try:
        tr = Trainer(cfg)
        tr.update()
    except RuntimeError as e:  # fp16 autocast / GradScaler unsupported on this CPU build
        pytest.skip(f"{precision} not supported here: {e}")
    count = Counter()
    steps = []
    tr.optimizer.register_step_post_hook(lambda opt, args, kwargs: steps.append(1))
    for name in ("unscale_", "step", "update"):
        count.wrap(tr.scaler, name, f"scaler.{name}")
    backwards = []
    for p in tr.raw_model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: backwards.append(1))
    epoch0 = tr.scheduler.last_epoch
    n_params = sum(1 for p in tr.raw_model.parameters() if p.requires_grad)
    for _ in range(2):
        tr.update()
    assert len(steps) == 2  # the optimizer stepped once per update (fp16: unless an inf skipped it)
    assert tr.scheduler.last_epoch - epoch0 == 2
    assert count.calls == {"scaler.unscale_": 2, "scaler.step": 2, "scaler.update": 2}
    assert len(backwards) == 2 * 3 * n_params  # but gradients accumulated on every micro-batch
    assert tr.scaler.is_enabled() is (precision == "fp16-mixed")


def test_clipping_sees_the_accumulated_gradient():
    cfg = RunConfig(model=preset("tiny", layers=2, dropout=0.0), seq=SEQ, micro_batch=2, accum=3)
    tr = Trainer(cfg)
    cap = GradCapture(tr.raw_model)
    result = tr.update(listener=cap)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in cap.grads.values()]))
    assert result.grad_norm == pytest.approx(float(total), rel=1e-5)


def test_leaving_the_tracker_removes_its_gradient_hooks():
    from batchlab.config import RunConfig
    from batchlab.measure.harness import Trainer
    from batchlab.measure.memory import tracker_for

    trainer = Trainer(RunConfig(seq=16, micro_batch=2))
    trainer.update()
    p = next(trainer.raw_model.parameters())
    before = len(p._post_accumulate_grad_hooks or {})
    tracker = tracker_for(trainer)
    assert len(p._post_accumulate_grad_hooks) == before + 1
    with tracker:
        trainer.update(listener=tracker)
    assert len(p._post_accumulate_grad_hooks or {}) == before
    assert tracker.snapshot().peak_bytes > 0
