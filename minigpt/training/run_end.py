"""How a run ends, as train.py prints it: the last validation's estimate, the best checkpoint and its step, why
early stopping stopped it, the training time, and the full validation split's loss (eval_full)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import EarlyStopping, Timer
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason

from minigpt.core.checkpoint import read_checkpoint
from minigpt.core.errors import first_line
from minigpt.training.callbacks import HarnessTasks
from minigpt.training.objectives import checkpoint_split_loss, full_split_loss, split_report
from minigpt.training.run_dir import sigterm_ends_evaluation
from minigpt.training.trainer import BestCheckpoint


def best_checkpoint(trainer: Trainer, last: Path) -> tuple[Path, int, float] | None:
    """The run's best checkpoint (lowest val_loss), as (its path beside `last`, its step, its val_loss), or None
    before any validation."""
    best = next((c for c in trainer.callbacks if isinstance(c, BestCheckpoint)), None)
    if best is None or best.best_model_score is None or not Path(best.best_model_path).is_file():
        return None
    path = last.parent / Path(best.best_model_path).name  # as the user named out_dir
    # a run resumed from a checkpoint older than best_step: the step is in the file
    step = best.best_step if best.best_step is not None else read_checkpoint(path)["global_step"]
    return path, step, best.best_model_score.item()


def best_split_report(trainer: Trainer, last: Path, module: L.LightningModule, data: Any) -> str | None:
    """train.py's last line where the best checkpoint is not the final weights: the full split's loss of the best
    checkpoint (what the commands take), the module's final weights kept; None where it is the final weights."""
    if not (best := best_checkpoint(trainer, last)) or best[1] == trainer.global_step:
        return None
    return f"full val loss of {best[0].name} (step {best[1]}): {checkpoint_split_loss(module, data, best[0])}"


def full_split_end(trainer: Trainer, module: L.LightningModule, data: Any, last: Path) -> None:
    """train.py's full-split lines (eval_full): the final weights' loss over the whole validation split, and the best
    checkpoint's where that is another.  In one process only: under several, each holds a share of the split."""
    if trainer.world_size > 1:
        if trainer.is_global_zero:
            print(f"full val loss: not computed under {trainer.world_size} processes (it runs in one process)")
        return
    with sigterm_ends_evaluation():
        _full_split_end(trainer, module, data, last)


def _full_split_end(trainer: Trainer, module: L.LightningModule, data: Any, last: Path) -> None:
    start = time.perf_counter()
    # on the training device: Lightning's teardown has moved the model to the CPU (on an H200 the full split took
    # 5.8 s there)
    module.to(trainer.strategy.root_device)
    nats, n, unit, per_text, found = full_split_loss(module, data)
    trainer.callback_metrics.update({f"full_val_{k}": torch.tensor(v) for k, v in found.items()})
    trainer.callback_metrics["full_val_loss"] = torch.tensor(nats / n)
    print(f"full val loss {split_report(nats, n, unit, per_text, start)}")
    if report := best_split_report(trainer, last, module, data):  # it overfit, or stopped early
        print(report)


def end_of_run(trainer: Trainer, last: Path) -> None:
    """What train.py prints when a run ends (rank 0): the last validation's loss, the best one with its step and
    checkpoint (what a run directory resolves to), why early stopping ended it, and the training time."""
    val_loss = trainer.callback_metrics.get("val_loss")
    shown = f"{val_loss.item():.4f}" if val_loss is not None else "n/a"
    # the last validation's val_batches batches: an estimate (the full split's loss follows)
    data, batches = trainer.datamodule, trainer.datamodule.val_batches_read()
    at, step = trainer.lightning_module.validated_at, trainer.global_step
    after = f"after {step} steps" if val_loss is None or at in (None, step) else f"at step {at} (stopped at {step})"
    print(
        f"estimated val loss {shown} ({batches} batch{'es' * (batches != 1)} of {data.val_batch_size}) {after}; "
        f"checkpoint: {last}"
    )
    if best := best_checkpoint(trainer, last):
        path, step, score = best
        print(
            f"best val loss {score:.4f} at step {step}; checkpoint: {path} (what sample.py, "
            f"eval.py and export.py take from {last.parent.parent})"
        )
    stopper = next((c for c in trainer.callbacks if isinstance(c, EarlyStopping)), None)
    if stopper is not None and stopper.stopping_reason == EarlyStoppingReason.PATIENCE_EXHAUSTED:
        by = f" by more than {abs(stopper.min_delta):g}" if stopper.min_delta else ""  # Lightning negates it for min
        at, step = getattr(stopper, "stopped_step", None), trainer.global_step  # (a user's EarlyStopping: None)
        mins = (("min_steps", trainer.min_steps), ("min_epochs", trainer.min_epochs))
        kept = " and ".join(f"trainer.{name} {value}" for name, value in mins if value)
        end = f"at step {at}; {kept} kept the run going to step {step}" if kept and at not in (None, step) else ""
        print(
            f"early stopping: val loss not lower{by} for {stopper.patience} validation"
            f"{'s' * (stopper.patience != 1)} in a row (early_stopping.patience {stopper.patience}); "
            f"{end or f'stopped at step {step}'}"
        )
    elif stopper is not None and stopper.stopping_reason != EarlyStoppingReason.NOT_STOPPED:
        print(f"early stopping at step {trainer.global_step}: {stopper.stopping_reason_message}")
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    if timer is not None:  # fit loop only (validation included): not data preparation, not the final eval
        print(f"training time {timer.time_elapsed('train'):.1f}s")


def failed_tasks_end(trainer: Trainer, last: Path) -> None:
    """A task of --eval_tasks that failed at a validation, which then ended the run (HarnessTasks) with its checkpoints
    saved: one `error:` line (rank 0's) and exit code 2."""
    failed = next((c.failed for c in trainer.callbacks if isinstance(c, HarnessTasks) and c.failed), None)
    if failed is None:
        return
    if trainer.is_global_zero:
        print(
            f"error: {first_line(failed, limit=2000)}; the run stopped at that validation (step {trainer.global_step}) "
            f"and saved {last}: continue it with --resume once the task works",
            file=sys.stderr,
        )
    raise SystemExit(2)
