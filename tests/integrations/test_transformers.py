"""A real Hugging Face Trainer (tiny GPT-2, CPU, 6 updates of 2 x 2) watched by BatchlabCallback.

transformers' Trainer (~2 s of CPU to import, accelerate with it) is imported by the ``hf`` fixture, not at
collection: every pytest-xdist worker collects this file, one runs it."""
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import Dataset

from batchlab.experiment.notebook import Notebook

SEQ, MICRO, ACCUM, STEPS = 32, 2, 2, 6


class Tokens(Dataset):
    def __init__(self, n=MICRO * ACCUM * STEPS):
        self.x = torch.randint(0, 128, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "attention_mask": torch.ones_like(self.x[i]), "labels": self.x[i]}


@pytest.fixture(scope="module")
def hf():
    """transformers' Trainer pieces, BatchlabCallback, this file's reference callback and ``train``."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from batchlab.integrations.transformers import BatchlabCallback

    class Reference(TrainerCallback):
        """PyTorch's MemTracker around the update batchlab measures for memory (the second); listed first, so its
        dispatch mode is the outer one."""

        def __init__(self):
            self.tracker, self.peak = None, None

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == 1:
                self.tracker = MemTracker()
                self.tracker.track_external(model, optimizer.optimizer)
                self.tracker.__enter__()

        def on_substep_end(self, args, state, control, **kw):
            if self.tracker is not None and self.peak is None:
                self.tracker.reset_mod_stats()  # MemTracker refuses a module's second forward otherwise

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                self.tracker.__exit__(None, None, None)
                self.peak = self.tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    def train(tmp_path, callbacks, **extra):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
                                           bos_token_id=0, eos_token_id=0))
        args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=MICRO,
                                 gradient_accumulation_steps=ACCUM, max_steps=STEPS, report_to=[], save_strategy="no",
                                 logging_steps=1, use_cpu=True, seed=0, disable_tqdm=True, **extra)
        trainer = Trainer(model, args, train_dataset=Tokens(), callbacks=callbacks)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    return SimpleNamespace(Reference=Reference, BatchlabCallback=BatchlabCallback, train=train,
                           TrainingArguments=TrainingArguments)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf):
    tmp = tmp_path_factory.mktemp("hf")
    ref, cb = hf.Reference(), hf.BatchlabCallback(notebook=tmp / "lab.sqlite")
    watched = hf.train(tmp, [ref, cb])
    plain = hf.train(tmp, [])
    return tmp, ref, cb, watched, plain


def test_no_effect_on_training(runs):
    _, _, _, watched, plain = runs
    assert len(watched) == STEPS and watched == plain


def test_one_observed_record_with_the_trainer_settings(runs):
    tmp, _, cb, _, _ = runs
    rows = Notebook(tmp / "lab.sqlite").list()
    assert [r["kind"] for r in rows] == ["observed"] and rows[0]["id"] == cb.notebook_id
    rec = Notebook(tmp / "lab.sqlite").get(cb.notebook_id)
    s = rec.settings
    assert (s.micro_batch, s.accum, s.world_size, s.seq, s.precision) == (MICRO, ACCUM, 1, SEQ, "fp32")
    assert rec.global_batch == 4 and "2 x 2 x 1 = 4" in rec.to_dict()["global_batch_text"]
    assert rec.run_config is not None and rec.run_config.global_batch == 4 and rec.run_config.model.layers == 2
    # every token is useful (all-ones mask): 2 x 2 x 32 per update, by hand
    assert rec.measurement.useful_tokens_per_update == MICRO * ACCUM * SEQ


def test_memory_matches_pytorch_mem_tracker(runs):
    _, ref, cb, _, _ = runs
    mem = cb.record.figure("peak memory")
    assert mem.provenance == "allocator" and mem.predicted is not None  # the formula's value stands beside it
    # the same update: equal but for AdamW's 0-dim step counters, which MemTracker counts (docs/accuracy/tracker.md)
    assert abs(mem.observed - ref.peak) / ref.peak <= 0.005


def test_phases_and_timed_updates(runs):
    _, _, cb, _, _ = runs
    t = cb.record.measurement.time
    assert len(t.samples) == STEPS - 3  # update 1 warmup, 2 memory, 3 warmup (warmup=2)
    assert {"forward", "backward", "optimizer"} <= set(t.phase_seconds)
    assert sum(t.phase_seconds.values()) <= t.update_seconds_median * 1.5


@pytest.mark.slow
def test_activation_checkpointing_is_read_and_measured(tmp_path, hf):
    # transformers 5: activation_checkpointing (gradient_checkpointing is its alias); every_n_layers=2 of 2 layers
    name = "activation_checkpointing" if hasattr(hf.TrainingArguments, "activation_checkpointing") else "gradient_checkpointing"
    ref, cb = hf.Reference(), hf.BatchlabCallback(notebook=tmp_path / "lab.sqlite")
    hf.train(tmp_path, [ref, cb], **{name: True, f"{name}_kwargs": {"use_reentrant": False, "every_n_layers": 2}})
    rec = cb.record
    assert rec.settings.gradient_checkpointing is True and rec.settings.checkpoint_every == 2
    assert str(rec.run_config.ac) == "every:2"
    assert abs(rec.figure("peak memory").observed - ref.peak) / ref.peak <= 0.005
