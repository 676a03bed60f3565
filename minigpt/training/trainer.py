"""The Trainer minigpt runs: Lightning's, with precision "auto", its defaults and the run's callbacks."""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning as L
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import (
    Callback,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
    Timer,
    TQDMProgressBar,
)
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason
from lightning.pytorch.cli import SaveConfigCallback

from minigpt.core.errors import ConfigError, UserError
from minigpt.core.precision import resolve_precision
from minigpt.training.callbacks import (
    AttentionImages,
    CompileModel,
    RNGState,
    StartupTimes,
    TextSamples,
    TrainingThroughput,
)
from minigpt.training.run_dir import SignalStop, interval_past_epoch

PROGRESS_REFRESH = 10

# Lightning 2.6 builds each leaf of its data loaders' tree as torch's LeafSpec(), which torch 2.13 deprecates: a
# FutureWarning at every fit and validate that the user can do nothing about.  Ignored where Lightning raises it.
LEAF_SPEC_WARNING = {
    "message": r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    "category": FutureWarning,
    "module": r"lightning\.pytorch\.utilities\._pytree",
}


@contextlib.contextmanager
def lightning_warnings_ignored() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", **LEAF_SPEC_WARNING)
        yield


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
    """Lightning's Trainer with one more precision, "auto": bf16-mixed where bf16 is native, else 32-true.

    "auto" is the trainer's default (configs/default.yaml sets 32-true), decided by minigpt/core/precision.py.  Every
    other argument is Lightning's."""

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
        # spawn and fork launchers hand only the weights back to the launching process, which then saves and reports
        # a run it did not train (step 0, no optimizer state) over rank 0's last.ckpt; Lightning reads a strategy's
        # name in any case (DDP_SPAWN is ddp_spawn)
        if isinstance(strategy := kwargs.get("strategy"), str) and strategy.lower().startswith(
            ("ddp_spawn", "ddp_fork", "ddp_notebook")
        ):
            problems.append(f"trainer.strategy={strategy} hands back only the weights, not the run; use ddp")
        if isinstance(budget := kwargs.get("max_time"), str) and re.fullmatch(r"0+(:0+)*", budget):
            problems.append(f"trainer.max_time={budget} trains nothing; give a positive duration (DD:HH:MM:SS)")
        if problems:
            raise UserError(problems[0])
        precision, _ = resolve_precision(precision, kwargs.get("accelerator", "auto"))
        super().__init__(*args, precision=precision, **kwargs)

    def fit(self, *args: Any, **kwargs: Any) -> None:
        with lightning_warnings_ignored():
            try:
                super().fit(*args, **kwargs)
            except ValueError as e:  # Lightning checks val_check_interval against an epoch once the data is known
                if "`val_check_interval`" not in str(e):
                    raise
                raise interval_past_epoch(self) from None

    def validate(self, *args: Any, **kwargs: Any) -> Any:
        with lightning_warnings_ignored():
            return super().validate(*args, **kwargs)


def strategy_problem(trainer_config: Any) -> str | None:
    """The refusal of a strategy given as a class with arguments (--trainer.strategy.class_path and init_args), or
    None: the settings with which a run would train and leave nothing the commands read."""
    strategy = trainer_config.get("strategy")
    args = strategy.get("init_args") if hasattr(strategy, "get") else None
    if args is None:
        return None
    if args.get("state_dict_type") == "sharded":
        return (
            "trainer.strategy: state_dict_type sharded saves each checkpoint as a folder of shards, which --resume, "
            "sample.py, eval.py and export.py do not read; leave state_dict_type full (the default)"
        )
    if args.get("start_method") not in (None, "popen"):  # as ddp_spawn and ddp_fork (MiniGPTTrainer)
        return (
            f"trainer.strategy: start_method {args['start_method']} hands back only the weights, not the run; "
            "leave start_method popen (the default)"
        )
    return None


class ResumableEarlyStopping(EarlyStopping):
    """Lightning's EarlyStopping, whose resume keeps this run's patience (Lightning's restores the checkpoint's, so
    a raised patience never continued an early-stopped run) and refuses one that would stop at once; it keeps the
    step where patience ran out (trainer.min_steps / min_epochs can keep the run going past it)."""

    stopped_step: int | None = None

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_validation_end(trainer, pl_module)
        self.note_stop(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self.note_stop(trainer)

    def note_stop(self, trainer: Any) -> None:
        if self.stopped_step is None and self.stopping_reason != EarlyStoppingReason.NOT_STOPPED:
            self.stopped_step = trainer.global_step

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        patience = self.patience
        super().load_state_dict(state_dict)
        self.patience = patience
        if self.wait_count >= patience:
            raise UserError(
                f"--resume: the run was ended by early stopping (val loss not lower for {self.wait_count} "
                f"validations in a row), and early_stopping.patience {patience} would end it at its next "
                f"validation; raise --early_stopping.patience above {self.wait_count} to continue it"
            )


@dataclass
class EarlyStoppingConfig:
    """Early stopping (Lightning's EarlyStopping on val_loss, lower is better); off unless patience is set."""

    patience: int | None = None
    """Stop after this many validations in a row without a lower val_loss; unset = never stop early."""
    min_delta: float = 0.0
    """How much lower val_loss must be than its best to count as lower."""

    def __post_init__(self) -> None:
        if self.patience is not None and (isinstance(self.patience, bool) or self.patience < 1):
            raise ConfigError(f"early_stopping.patience: must be >= 1 or null, got {self.patience}; use e.g. 3")
        if not (math.isfinite(self.min_delta) and self.min_delta >= 0):
            raise ConfigError(f"early_stopping.min_delta: must be >= 0, got {self.min_delta}; use e.g. 0.0 or 0.001")


class RunConfigFile(SaveConfigCallback):
    """out_dir/config.yaml, LightningCLI's record of the run's settings, written (over the previous run's) when
    training starts, not at setup as Lightning does: a resume refused while its checkpoint is restored (DPO's
    precomputed log-probs of other pairs) leaves the run's record as it was."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "overwrite": True})

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pass  # not yet: see on_train_start

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the launch's one-off switches are not the run's settings: the record, fed back as --config, starts a new
        # run (resume: true was refused there) and never sets an existing run aside (overwrite: true)
        self.config = self.config.clone()
        for switch in ("resume", "overwrite"):
            if switch in self.config:
                self.config[switch] = False
        super().setup(trainer, pl_module, "fit")

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # rank 0, after Lightning's save to the logger's log_dir: out_dir keeps the record even where a logger of the
        # user's (a CSVLogger's save_dir) writes elsewhere
        path = Path(self.config["out_dir"]) / self.config_filename
        self.parser.save(self.config, str(path), skip_none=False, overwrite=True, multifile=self.multifile)


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint for a file of the run directory's checkpoints/ (best.ckpt, last.ckpt), whose
    state survives the run directory being moved or copied."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning warns when checkpoints/ is not empty: a resumed run's holds its own checkpoints, and a new run
        # where one already is has been refused before (or, with --overwrite, its files moved aside)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
            super().setup(trainer, pl_module, stage)

    @property
    def state_key(self) -> str:
        # ModelCheckpoint's own key: a run checkpointed before these classes existed resumes with its state
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_in = state_dict.get("dirpath", self.dirpath)
        if saved_in != self.dirpath and (Path(self.dirpath) / Path(state_dict["best_model_path"]).name).is_file():
            # the run directory was moved or copied, its checkpoints with it: Lightning would forget the best score
            # (it keeps it only where the folder is the same), and the next validation, however worse, would
            # replace best.ckpt. The same files at their new place keep it
            def moved(path: str) -> str:
                return str(Path(self.dirpath) / Path(path).name) if path else path

            state_dict = {
                **state_dict,
                "dirpath": self.dirpath,
                "best_k_models": {moved(k): v for k, v in state_dict.get("best_k_models", {}).items()},
                **{
                    k: moved(state_dict.get(k, ""))
                    for k in ("best_model_path", "kth_best_model_path", "last_model_path")
                },
            }
        super().load_state_dict(state_dict)


class LastCheckpoint(RunCheckpoint):
    """checkpoints/last.ckpt: every checkpoint_every steps (Lightning's ModelCheckpoint), and at the validation that
    ends the run when that validation was also a scheduled one (val_check_interval's grid).

    The run's final state is saved after `trainer.fit` returns (train.py), when Lightning has already counted the
    step for its loggers.  Lightning's restart takes a checkpoint whose last batch completed, at a step where
    validation is scheduled, for one saved at that validation's end, before that count: it counts the step again,
    and every later point of the resumed run's logs would sit one step late.  Saved here, at the end of that
    validation (after best.ckpt and early stopping have seen it: checkpoint callbacks run last, this one after
    BestCheckpoint), the checkpoint is what Lightning expects; train.py then keeps it (`saved_at_stop`) instead of
    saving again at the same step.  Where the last step is off the grid, the checkpoint saved after `fit` is the
    one Lightning reads right, and nothing is saved here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.saved_at_stop: int | None = None  # the step of the save below, if one was made in this run

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        # the loop stops after this validation: max_steps (FinalValidation), early stopping, Ctrl-C, max_time or
        # SIGTERM (Lightning raises it after this step); min_steps / min_epochs can keep it going
        min_steps, min_epochs = trainer.min_steps or 0, trainer.min_epochs or 0
        can_stop = trainer.global_step >= min_steps and trainer.current_epoch >= min_epochs
        terminating = any(isinstance(c, SignalStop) and c.terminate for c in trainer.callbacks)  # train.py's SIGTERM
        stopping = trainer.received_sigterm or terminating or (trainer.should_stop and can_stop)
        stopping = trainer.strategy.reduce_boolean_decision(bool(stopping), all=False)  # every rank saves, or none
        if stopping and scheduled_validation(trainer) and trainer.global_step > 0:  # an untrained model: no run
            trainer.save_checkpoint(Path(self.dirpath) / f"{self.filename}{self.FILE_EXTENSION}", weights_only=False)
            self.saved_at_stop = trainer.global_step


def uncount_unfinished_epoch(trainer: L.Trainer) -> None:
    """Before the save after `fit` (a stop off the validation grid: max_steps, Ctrl-C, max_time): make the state the
    one Lightning saves after a training batch, which it resumes from exactly.  Lightning's loop has counted the
    epoch it stopped in as done: a resume then started the next one (a max_epochs run trained an epoch's remainder
    less, and its logged epoch ran one ahead).  At the epoch's last batch the batch is left uncompleted too: a
    resume from a completed last batch that is not a validation point trains one more batch in the old epoch
    (with accumulate_grad_batches > 1, an optimizer step of its own, and every later step pairs other batches)."""
    loop = trainer.fit_loop.epoch_loop
    epochs, batches = trainer.fit_loop.epoch_progress, loop.batch_progress
    if epochs.current.processed != epochs.current.started:
        return  # not counted
    for progress in (epochs.current, epochs.total):
        progress.processed -= 1
        progress.completed -= 1
    if batches.is_last_batch:
        batches.current.completed -= 1
        batches.total.completed -= 1
        # a restart completes that batch and counts its optimizer step again (Lightning adds one to the logger's
        # step there, as its own checkpoints saved before the count need): the loop's checkpoint state takes one off
        state = loop.on_save_checkpoint()
        loop.on_load_checkpoint({**state, "_batches_that_stepped": state["_batches_that_stepped"] - 1})


def scheduled_validation(trainer: L.Trainer) -> bool:
    """Whether the current training batch is one at which the validation schedule (val_check_interval,
    check_val_every_n_epoch) validates: what Lightning asks, without the stop request, when it restarts at it."""
    every = trainer.check_val_every_n_epoch
    if every is not None and (trainer.current_epoch + 1) % every != 0:
        return False
    interval = trainer.val_check_batch  # None: a time-based val_check_interval; inf: once per epoch of unknown length
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        return False
    index = trainer.fit_loop.total_batch_idx if every is None else trainer.fit_loop.batch_idx
    return (index + 1) % interval == 0


class BestCheckpoint(RunCheckpoint):
    """checkpoints/best.ckpt: the lowest val_loss so far (Lightning's ModelCheckpoint), and the step it was reached
    at (best_step), which its state keeps for --resume."""

    def __init__(self, dirpath: Path) -> None:
        super().__init__(
            dirpath=dirpath,
            filename="best",
            monitor="val_loss",
            mode="min",
            save_top_k=1,
            enable_version_counter=False,
            auto_insert_metric_name=False,
        )
        self.best_step: int | None = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        saved = self.current_score  # ModelCheckpoint sets it only when it saves a new best
        super().on_validation_end(trainer, pl_module)
        if self.current_score is not saved:
            self.best_step = trainer.global_step

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "best_step": self.best_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.best_step = state_dict.get("best_step")


class FinalValidation(Callback):
    """Validate after the run's last step, whatever val_check_interval says, so the run ends with a val loss and
    best.ckpt has seen it: at that step it asks the loop to stop, and Lightning's loop validates before a stop."""

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        last_step = 0 < trainer.max_steps <= trainer.global_step
        last_epoch = 0 < (trainer.max_epochs or 0) <= trainer.current_epoch + 1
        if last_step or (last_epoch and batch_idx + 1 >= trainer.num_training_batches):
            trainer.should_stop = True


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


def run_callbacks(config: Any, batch_size: int, imported: float | None = None, given: Sequence[Callback] = ()) -> list:
    """imported: seconds from launch to the command's modules loaded, the start of StartupTimes' report; given: the
    user's own callbacks (trainer.callbacks), which go before these."""
    if config["trainer"].get("default_root_dir") is not None:  # train.py gives Lightning out_dir
        raise UserError("trainer.default_root_dir: a run's files go to out_dir; give --out_dir DIR instead")
    if config["trainer"].get("fast_dev_run"):  # Lightning skips the checkpoints, train.py saves last.ckpt all the same
        raise UserError("trainer.fast_dev_run: a run always saves; for a quick check give --trainer.max_steps 1")
    if any(isinstance(c, StochasticWeightAveraging) for c in given):
        raise UserError(
            "trainer.callbacks: StochasticWeightAveraging puts the averaged weights in after the last checkpoint is "
            "saved, so no checkpoint (and no command) would have them; leave it out"
        )
    monitor = config["trainer"].get("logger") is not False and not any(
        isinstance(c, LearningRateMonitor) for c in given
    )
    checkpoints = Path(config["out_dir"]) / "checkpoints"
    callbacks = [
        BestCheckpoint(checkpoints),  # best.ckpt: lowest validation loss so far
        # last.ckpt: every checkpoint_every steps, what --resume continues from
        LastCheckpoint(
            dirpath=checkpoints,
            filename="last",
            every_n_train_steps=config["checkpoint_every"],
            save_top_k=1,
            enable_version_counter=False,
        ),
        *([LearningRateMonitor(logging_interval="step")] if monitor else []),  # unless the user's logs the rates
        TrainingThroughput(),  # rates over the steps since the previous logged step
        RNGState(),
        TextSamples(config["sample_tokens"], config["seed"]),
        AttentionImages(config["attention_images"]),
        FinalValidation(),
    ]
    if (patience := config["early_stopping"]["patience"]) is not None:
        min_delta = config["early_stopping"]["min_delta"]
        callbacks.append(ResumableEarlyStopping(monitor="val_loss", mode="min", patience=patience, min_delta=min_delta))
    if config["trainer"].get("enable_progress_bar") is not False:
        # redrawn every PROGRESS_REFRESH steps, not every step: redrawing cost ~3% of a small CPU model's step
        # no more often than the steps log: each redraw reads the logged loss, which waits for a GPU's queue
        refresh = max(PROGRESS_REFRESH, config["trainer"].get("log_every_n_steps") or 0)
        callbacks.append(TQDMProgressBar(refresh_rate=refresh))
    if imported is not None:
        callbacks.append(StartupTimes(imported))  # before CompileModel: Lightning's setup ends before compiling
    if config["compile"]:
        callbacks.append(CompileModel(batch_size, regions=config["compile_regions"], mode=config["compile_mode"]))
    if not config["trainer"].get("max_time"):  # Lightning adds its own Timer for max_time; else time the run
        callbacks.append(Timer())
    return callbacks
