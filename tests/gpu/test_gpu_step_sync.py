"""On a GPU the host queues the next training step while the GPU still runs this one.  A step that is not logged
must not make the host wait for the GPU (an .item(), a blocking copy, a synchronize): each such wait costs the
step's whole GPU time, and the small recipes are host-bound.  torch.cuda.set_sync_debug_mode("warn") reports every
synchronizing call; this runs train.py's own Trainer on the GPU recipe (its callbacks, logger, progress bar, the
max_time Timer and time-based schedule, Muon, regional compilation, bf16-mixed) and watches the steps between
logged ones.  Skipped without CUDA."""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch

import minigpt.cli.train as train_cli

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "shakespeare_char_gpu.yaml"
LOG_EVERY = 10


class SyncWatch(L.Callback):
    """Records the synchronizing CUDA calls made from one step's start to the next step's start, on the steps whose
    end is not logged (nor the step after a logged one, whose start may still read what was logged)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.watched = 0
        self._catcher: warnings.catch_warnings | None = None
        self._caught: list[warnings.WarningMessage] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._stop()
        step = trainer.global_step
        if step >= 2 and step % LOG_EVERY and (step + 1) % LOG_EVERY:
            self._catcher = warnings.catch_warnings(record=True)
            self._caught = self._catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            self.watched += 1

    def on_validation_start(self, trainer, pl_module) -> None:
        self._stop()  # validation reads its loss on the host: allowed

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._catcher is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        self.calls.update(f"{w.filename}:{w.lineno}" for w in self._caught if "synchroniz" in str(w.message))
        self._catcher.__exit__(None, None, None)
        self._catcher = None


def test_unlogged_training_steps_never_wait_for_the_gpu(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400)))
    watch, run_callbacks = SyncWatch(), train_cli.run_callbacks
    monkeypatch.setattr(train_cli, "run_callbacks", lambda *a, **k: [*run_callbacks(*a, **k), watch])
    argv = ["--config", str(RECIPE), "--data.source", str(corpus), "--data.data_root", str(tmp_path / "data")]
    argv += ["--out_dir", str(tmp_path / "run"), "--model.n_layer", "2", "--model.n_embd", "64"]
    argv += ["--model.n_head", "2", "--model.block_size", "64", "--data.batch_size", "8", "--data.val_batches", "2"]
    argv += ["--trainer.max_time", "00:00:10:00", "--trainer.max_steps", "40", "--trainer.val_check_interval", "1000"]
    argv += ["--trainer.log_every_n_steps", str(LOG_EVERY)]
    train_cli.main(argv)
    assert watch.watched >= 20
    assert not watch.calls, f"synchronizing CUDA calls in unlogged steps (site: count): {dict(watch.calls)}"
