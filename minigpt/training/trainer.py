"""The Trainer minigpt runs: Lightning's, with precision "auto", its defaults and the run's callbacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning.pytorch.utilities._pytree as lightning_pytree
import torch.utils._pytree as torch_pytree
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, Timer, TQDMProgressBar

from minigpt.core.errors import UserError
from minigpt.core.precision import resolve_precision
from minigpt.training.callbacks import (
    AttentionImages,
    CompileModel,
    RNGState,
    StartupTimes,
    TextSamples,
    TrainingThroughput,
)

PROGRESS_REFRESH = 10

# Lightning 2.6 builds a leaf of its data loaders' tree as LeafSpec(), which torch 2.13 deprecates (a FutureWarning
# per fit/validate, ~60 in the test suite); torch's own treespec_leaf() is the same leaf, without the warning.
if hasattr(torch_pytree, "treespec_leaf") and getattr(lightning_pytree, "LeafSpec", None) is torch_pytree.LeafSpec:
    lightning_pytree.LeafSpec = torch_pytree.treespec_leaf
# Lightning's precision settings (its Trainer checks them again) and minigpt's "auto"; declared here because
# Lightning's own type for them is private
Precision = Literal[
    "auto",
    "32-true",
    "bf16-mixed",
    "16-mixed",
    "bf16-true",
    "16-true",
    "64-true",
    "transformer-engine",
    "transformer-engine-float16",
    "32",
    "16",
    "bf16",
    "64",
    32,
    16,
    64,
]


class MiniGPTTrainer(Trainer):
    """Lightning's Trainer with one more precision: "auto" (the default), bf16-mixed where the device computes
    bf16 natively and float32 elsewhere (see minigpt/core/precision.py).  Every other argument is Lightning's."""

    def __init__(self, *args: Any, precision: Precision | None = "auto", **kwargs: Any) -> None:
        # settings Lightning would divide by (or loop on, or silently misuse) before it checks them
        limits = (
            ("accumulate_grad_batches", 1, ">= 1"),
            ("log_every_n_steps", 1, ">= 1"),
            ("val_check_interval", 1e-9, "> 0"),
            ("check_val_every_n_epoch", 1, ">= 1 or null"),
            ("min_steps", 0, ">= 0 or null"),
            ("num_sanity_val_steps", -1, ">= -1 (-1: all)"),
            ("gradient_clip_val", 0, ">= 0 (0 or null: no clipping)"),
        )  # < 0 ascends
        problems = [
            f"trainer.{key} must be {rule}, got {kwargs[key]}"
            for key, need, rule in limits
            if isinstance(kwargs.get(key), (int, float)) and kwargs[key] < need
        ]
        # a run that would stop before its first step and exit 0, as if it had trained
        problems += [
            f"trainer.{key}=0 trains nothing; give a positive number (evaluate a model with eval.py instead)"
            for key in ("max_steps", "max_epochs", "limit_train_batches")
            if kwargs.get(key) == 0
        ]
        if problems:
            raise UserError(problems[0])
        precision, _ = resolve_precision(precision, kwargs.get("accelerator", "auto"))
        super().__init__(*args, precision=precision, **kwargs)


TRAINER_DEFAULTS: dict[str, Any] = {
    "max_steps": 2000,
    "max_epochs": -1,
    "check_val_every_n_epoch": None,  # val_check_interval counts batches across epochs
    "val_check_interval": 250,
    "log_every_n_steps": 10,
    "gradient_clip_val": 1.0,
    "num_sanity_val_steps": 0,
    "use_distributed_sampler": False,  # the datamodule draws per-rank windows itself
    "enable_model_summary": False,
}


def run_callbacks(config: Any, batch_size: int, imported: float | None = None) -> list:
    """imported: seconds from launch to the command's modules loaded, the start of StartupTimes' report."""
    checkpoints = Path(config["out_dir"]) / "checkpoints"
    callbacks = [
        # best.ckpt: lowest validation loss so far
        ModelCheckpoint(
            dirpath=checkpoints,
            filename="best",
            monitor="val_loss",
            mode="min",
            save_top_k=1,
            enable_version_counter=False,
            auto_insert_metric_name=False,
        ),
        # last.ckpt: every checkpoint_every steps, what --resume continues from
        ModelCheckpoint(
            dirpath=checkpoints,
            filename="last",
            every_n_train_steps=config["checkpoint_every"],
            save_top_k=1,
            enable_version_counter=False,
        ),
        LearningRateMonitor(logging_interval="step"),
        TrainingThroughput(),  # rates over the steps since the previous logged step
        RNGState(),
        TextSamples(config["sample_tokens"]),
        AttentionImages(config["attention_images"]),
    ]
    if config["trainer"].get("enable_progress_bar") is not False:
        # redrawn every PROGRESS_REFRESH steps, not every step: redrawing cost ~3% of a small CPU model's step
        # no more often than the steps log: each redraw reads the logged loss, which waits for a GPU's queue
        refresh = max(PROGRESS_REFRESH, config["trainer"].get("log_every_n_steps") or 0)
        callbacks.append(TQDMProgressBar(refresh_rate=refresh))
    if imported is not None:
        callbacks.append(StartupTimes(imported))  # before CompileModel: Lightning's setup ends before compiling
    if config["compile"]:
        callbacks.append(CompileModel(batch_size, regions=config["compile_regions"]))
    if not config["trainer"].get("max_time"):  # Lightning adds its own Timer for max_time; else time the run
        callbacks.append(Timer())
    return callbacks
