"""A real Lightning Trainer (small MLP, CPU, accumulation 2, 6 updates) watched by BatchlabCallback.

Lightning (~3.5 s of CPU to import) is imported by the ``pl`` fixture, not at collection: every pytest-xdist
worker collects this file, one runs it."""
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from batchlab.experiment.notebook import Notebook

MICRO, ACCUM, STEPS = 4, 2, 6


@pytest.fixture(scope="module")
def pl():
    """lightning, BatchlabCallback and this file's LightningModule and reference callback."""
    L = pytest.importorskip("lightning")
    from torch.distributed._tools.mem_tracker import MemTracker

    from batchlab.integrations.lightning import BatchlabCallback

    class MLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
            self.losses = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Reference(L.Callback):
        """PyTorch's MemTracker around the update batchlab measures for memory (micro-batches 2 and 3); listed
        first, so its dispatch mode is the outer one."""

        def __init__(self):
            self.tracker, self.peak = None, None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == ACCUM:
                self.tracker = MemTracker()
                self.tracker.track_external(module, trainer.optimizers[0])
                self.tracker.__enter__()
            elif batch_idx == ACCUM + 1:
                self.tracker.reset_mod_stats()  # MemTracker refuses a module's second forward otherwise

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 2 * ACCUM - 1:
                self.tracker.__exit__(None, None, None)
                self.peak = self.tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    return SimpleNamespace(L=L, MLP=MLP, Reference=Reference, BatchlabCallback=BatchlabCallback)


def fit(pl, callbacks):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(MICRO * ACCUM * STEPS, 64, generator=g), torch.randint(0, 8, (MICRO * ACCUM * STEPS,), generator=g))
    module = pl.MLP()
    trainer = pl.L.Trainer(max_steps=STEPS, accumulate_grad_batches=ACCUM, accelerator="cpu", devices=1,
                        callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, DataLoader(data, batch_size=MICRO))
    return module.losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pl):
    tmp = tmp_path_factory.mktemp("pl")
    ref, cb = pl.Reference(), pl.BatchlabCallback(notebook=tmp / "lab.sqlite")
    return tmp, ref, cb, fit(pl, [ref, cb]), fit(pl, [])


def test_no_effect_on_training(runs):
    *_, watched, plain = runs
    assert len(watched) == ACCUM * STEPS and watched == plain


def test_one_observed_record_global_batch_and_unmapped(runs):
    tmp, _, cb, _, _ = runs
    rows = Notebook(tmp / "lab.sqlite").list()
    assert [r["kind"] for r in rows] == ["observed"] and rows[0]["id"] == cb.notebook_id
    rec = cb.record
    assert (rec.settings.micro_batch, rec.settings.accum, rec.settings.world_size) == (MICRO, ACCUM, 1)
    assert rec.global_batch == 8 and rec.settings.precision == "32-true"
    # a plain module has no shape the formula reads: no RunConfig, and the record says why
    assert rec.run_config is None and any(u.startswith("model:") for u in rec.unmapped)
    assert rec.figure("samples/s").observed == pytest.approx(8 / rec.measurement.time.update_seconds_median)


def test_memory_matches_pytorch_mem_tracker(runs):
    _, ref, cb, _, _ = runs
    mem = cb.record.figure("peak memory")
    assert mem.provenance == "allocator" and mem.predicted is None
    # the same update: equal but for AdamW's 0-dim step counters, which MemTracker counts (docs/accuracy/tracker.md)
    assert abs(mem.observed - ref.peak) / ref.peak <= 0.005


@pytest.mark.slow
def test_hugging_face_model_inside_a_lightning_module_maps_to_a_run_config(pl):
    transformers = pytest.importorskip("transformers")

    class GPT2Module(pl.L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
                n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0))

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    ids = torch.randint(0, 128, (MICRO * ACCUM * STEPS, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, -8:] = 0  # 8 padding positions per sequence: not useful tokens
    data = [{"input_ids": i, "attention_mask": m, "labels": i} for i, m in zip(ids, mask)]
    torch.manual_seed(0)
    ref, cb = pl.Reference(), pl.BatchlabCallback()
    pl.L.Trainer(max_steps=STEPS, accumulate_grad_batches=ACCUM, accelerator="cpu", devices=1, callbacks=[ref, cb],
              logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(GPT2Module(), DataLoader(data, batch_size=MICRO))
    rec = cb.record
    assert rec.run_config is not None and rec.run_config.seq == 32 and rec.run_config.global_batch == 8
    assert rec.measurement.useful_tokens_per_update == MICRO * ACCUM * (32 - 8)  # by hand
    assert rec.figure("peak memory").predicted is not None
    assert abs(rec.figure("peak memory").observed - ref.peak) / ref.peak <= 0.005
