"""`train.py`: LightningCLI gives YAML configs, a flag for every key, --help and --print_config.

    python train.py                                  # configs/default.yaml
    python train.py --config configs/X.yaml --model.attention manual --trainer.max_steps 500
    python train.py --out_dir out/run1 --resume true # continue a run from its last checkpoint
    python train.py --config configs/finetune_shakespeare.yaml  # fine-tune: init_from another model's weights

How a setting travels: each field of GPTConfig (section `model`) and OptimConfig (section `optim`) is a YAML
key and a `--model.FIELD` / `--optim.FIELD` flag because jsonargparse reads the dataclasses themselves (types,
defaults, docstrings).  The parsed sections are instantiated as those dataclasses and handed to
GPTLightningModule as they are.  Shared values are linked, not copied: model.block_size -> data.block_size,
seed -> data.seed, and the data's tokenizer -> model.vocab_size.

Fine-tuning (`init_from: SRC`, anything minigpt.loading.load_model reads) takes the model config, the weights
and the tokenizer from SRC: the tokenizer is written to out_dir/tokenizer.json and becomes data.tokenizer, so the
corpus is prepared with it; the model keys a run sets must agree with SRC, except those in INIT_OVERRIDABLE.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from collections.abc import Iterator
from typing import IO, Any, Literal

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ThroughputMonitor, Timer, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from jsonargparse import ActionYesNo
from jsonargparse._link_arguments import skip_apply_links
from jsonargparse.typing import NonNegativeInt, PositiveInt
from lightning.fabric.connector import _PRECISION_INPUT
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from minigpt.training.callbacks import AttentionImages, CompileModel, RNGState, TextSamples
from minigpt.core import checkpoint
from minigpt.core.checkpoint import check_resumable, read_checkpoint
from minigpt.loading import load_model
from minigpt.training.checkpoint_io import SafeCheckpointIO
from minigpt.cli.parsing import OneLineErrors
from minigpt.configs import default_config
from minigpt.core.config import GPTConfig
from minigpt.training.datamodule import MAX_SEED, TokenDataModule
from minigpt.core.errors import CheckpointError, UserError, first_line, run_cli
from minigpt.core.evaluate import evaluate_tokens
from minigpt.core.fsutil import atomic_write, temp_sibling
from minigpt.training.lightning_module import GPTLightningModule
from minigpt.core.model import GPT
from minigpt.training.optim import OptimConfig
from minigpt.core.precision import resolve_precision

# Our sampler restarts exactly where a run stopped (see datamodule.py), so Lightning's caution does not apply.
warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch ended")
# A torch-internal deprecation inside Lightning, not something a user can act on.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")


class _DropAdverts(logging.Filter):
    """Lightning prints tips advertising its cloud products at every run; keep the console for our output."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropAdverts())

PROGRESS_REFRESH = 10
# model fields set by a link rather than by the user (see the module docstring)
LINKED_MODEL_FIELDS = {"vocab_size"}
# model fields a fine-tuning run (init_from) may set differently from its source; block_size only smaller
INIT_OVERRIDABLE = {"attention", "sdpa_backend", "dropout", "block_size"}

class TrainArgumentParser(OneLineErrors, LightningArgumentParser):
    """LightningCLI's parser, with parse mistakes as one line."""


class MiniGPTTrainer(Trainer):
    """Lightning's Trainer with one more precision: "auto" (the default), bf16-mixed where the device computes
    bf16 natively and float32 elsewhere (see minigpt/core/precision.py).  Every other argument is Lightning's."""

    def __init__(self, *args: Any, precision: Literal["auto"] | _PRECISION_INPUT | None = "auto",
                 **kwargs: Any) -> None:
        # settings Lightning would divide by (or loop on) before it checks them
        for key, need in (("accumulate_grad_batches", 1), ("log_every_n_steps", 1), ("val_check_interval", 1e-9)):
            value = kwargs.get(key)
            if value is not None and value < need:
                raise UserError(f"trainer.{key} must be {'>= 1' if need == 1 else '> 0'}, got {value}")
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


class MiniGPTCLI(LightningCLI):
    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--seed", type=int, default=1337, help="Fixes data order, initialisation and dropout.")
        parser.add_argument("--out_dir", type=str, default="out/default",
                            help="Run directory: checkpoints/, TensorBoard logs, config.yaml.")
        parser.add_argument("--resume", action=ActionYesNo, nargs="?", default=False,
                            help="Continue the run in out_dir from checkpoints/last.ckpt.")
        parser.add_argument("--overwrite", action=ActionYesNo, nargs="?", default=False,
                            help="Start a new run in an out_dir that already holds one (its checkpoints are deleted).")
        parser.add_argument("--eval_full", action=ActionYesNo, nargs="?", default=True,
                            help="At the end, report the loss over the whole validation split (one device only).")
        parser.add_argument("--checkpoint_every", type=PositiveInt, default=100,
                            help="Optimizer steps between saves of checkpoints/last.ckpt.")
        parser.add_argument("--compile", action=ActionYesNo, nargs="?", default=False,
                            help="torch.compile the model; compiled on a dummy batch before the training clock starts.")
        parser.add_argument("--sample_tokens", type=NonNegativeInt, default=200,
                            help="Tokens generated and logged as text at each validation (0 = none).")
        parser.add_argument("--attention_images", type=bool | Literal["auto"], default="auto",
                            help="Log the attention maps of a probe text as a TensorBoard image at each validation "
                                 "(auto = for models of at most 64 heads in all, n_layer * n_head).")
        parser.add_argument("--init_from", type=str | None, default=None,
                            help="Fine-tune: start from this model's weights, config and tokenizer (a .ckpt, a run "
                                 "directory, a Hugging Face model directory or hf:ORG/NAME).")

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({f"trainer.{k}": v for k, v in self.trainer_defaults.items()})
        parser.add_class_arguments(GPTConfig, "model")  # every field of the dataclass, as declared there
        parser.add_class_arguments(OptimConfig, "optim")
        parser.add_lightning_class_args(TokenDataModule, "data")

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.block_size", "data.block_size")
        parser.link_arguments("seed", "data.seed")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")

    def _set_seed(self) -> None:
        seed = self.config["seed"]
        if not 0 <= seed <= MAX_SEED:  # seed_everything would raise a bare ValueError
            raise UserError(f"--seed must be in [0, {MAX_SEED}], got {seed}; use e.g. 1337")
        seed_everything(seed, workers=True)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        # init_from needs to know which settings the user gave (config files and flags), not their defaults
        # (links skipped: an unset link source is fine here; jsonargparse is pinned, see pyproject.toml)
        self.given = None
        if self.config.get("init_from"):
            with skip_apply_links():
                self.given = parser.parse_args(args, defaults=False)

    def instantiate_classes(self) -> None:
        source_config, source_model = None, None
        if self.config.get("init_from"):  # fills the model section and data.tokenizer from the source
            source_config, source_model = init_from_source(self.config, self.given)
        self.config_init = self.parser.instantiate_classes(self.config)
        self.datamodule = self.config_init["data"]
        config = self.config_init["model"]
        if source_config is not None:  # the source's vocabulary may be larger than its tokenizer's (padded)
            config = GPTConfig.from_dict({**config.to_dict(), "vocab_size": source_config.vocab_size})
        self.model = GPTLightningModule(config, self.config_init["optim"], tokenizer=self.datamodule.tokenizer)
        if source_model is not None:
            load_init_weights(self.model.model, source_model)
        self.trainer = self.instantiate_trainer()

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        out_dir = Path(self.config["out_dir"])
        trainer_config = self.config["trainer"]
        if trainer_config.get("logger") in (None, True):
            # save_dir/name/version flattened: events and config.yaml sit in out_dir itself
            kwargs["logger"] = TensorBoardLogger(save_dir=str(out_dir), name="", version="")
        kwargs["default_root_dir"] = str(out_dir)
        kwargs["plugins"] = [SafeCheckpointIO()]
        user_callbacks = self.config_init["trainer"].get("callbacks") or []
        kwargs["callbacks"] = list(user_callbacks) + run_callbacks(self.config, self.datamodule.hparams.batch_size)
        # resolved here, where the attention path is known (bf16 does not pay for sdpa on a CPU)
        kwargs["precision"], reason = resolve_precision(trainer_config.get("precision"),
                                                        trainer_config.get("accelerator"), self.model.config.attention)
        if trainer_config.get("precision") == "auto":
            rank_zero_info(reason)
        try:
            return super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ValueError) as e:  # Lightning's words for a setting that cannot work
            raise UserError(f"trainer: {first_line(e, 300)}") from None


def init_from_source(config: Any, given: Any) -> tuple[GPTConfig, GPT | None]:
    """init_from: fill config's model section from the source and point data.tokenizer at its tokenizer (written
    to out_dir/tokenizer.json).  Returns the source's config and model; the model is None when --resume continues
    the run, whose own checkpoint then supplies config and tokenizer (the source's weights are not read again)."""
    src, out_dir = config["init_from"], Path(config["out_dir"])
    last = out_dir / "checkpoints" / "last.ckpt"
    if config["resume"] and last.is_file():
        saved = read_last(last)
        source_model, tokenizer = None, checkpoint.checkpoint_tokenizer(saved)
        source_config = checkpoint.model_config(saved)
    else:
        try:
            source_model, tokenizer = load_model(src)
        except UserError as e:
            raise UserError(f"init_from: {first_line(e, 1000)}") from None
        source_config = source_model.config
    if tokenizer is None:
        raise UserError(f"init_from {src}: it has no tokenizer; fine-tune from a checkpoint written by train.py")
    tokenizer_file = out_dir / "tokenizer.json"
    given_tokenizer = given.get("data.tokenizer") if given is not None else None
    if given_tokenizer is not None and Path(str(given_tokenizer)).resolve() != tokenizer_file.resolve():
        raise UserError(f"init_from {src}: data.tokenizer is set ({given_tokenizer}), but a fine-tuning run uses its "
                        "source's tokenizer; remove data.tokenizer")
    source_keys = source_config.to_dict()
    user_keys = {k: v for k, v in (given.get("model") or {}).items() if v is not None} if given is not None else {}
    conflicts = [f"model.{k}={v!r} (the source has {source_keys[k]!r})" for k, v in user_keys.items()
                 if k in source_keys and k not in INIT_OVERRIDABLE | LINKED_MODEL_FIELDS and v != source_keys[k]]
    if conflicts:
        raise UserError(f"init_from {src}: the model comes from the source, but this run sets " + ", ".join(conflicts)
                        + "; remove these model settings (a fine-tuning run may change only attention, sdpa_backend, "
                        "dropout and a smaller block_size)")
    block_size = user_keys.get("block_size", source_config.block_size)
    if block_size > source_config.block_size:
        raise UserError(f"init_from {src}: model.block_size={block_size} is larger than the source's "
                        f"{source_config.block_size}; use a block_size of at most {source_config.block_size}")
    for key, value in source_keys.items():
        if key not in LINKED_MODEL_FIELDS:
            config["model"][key] = user_keys.get(key, value) if key in INIT_OVERRIDABLE else value
    config["data"]["block_size"] = block_size  # its link from model.block_size ran at parse time
    check_writable(out_dir)
    text = json.dumps(tokenizer.to_dict()).encode()  # the data layer keys its cache by this file's content
    if not tokenizer_file.is_file() or tokenizer_file.read_bytes() != text:
        atomic_write(tokenizer_file, lambda f: f.write(text))
    config["data"]["tokenizer"] = str(tokenizer_file)
    return source_config, source_model


def load_init_weights(model: GPT, source: GPT) -> None:
    """Copy the source's weights into the model being trained; learned positions beyond a smaller block_size are
    dropped (nanoGPT's crop_block_size)."""
    state = source.state_dict()
    if "transformer.wpe.weight" in state:
        state["transformer.wpe.weight"] = state["transformer.wpe.weight"][:model.config.block_size]
    model.load_state_dict(state)


def read_last(last: Path) -> dict[str, Any]:
    """The run's last checkpoint for --resume; a damaged one is a one-line error with the way out."""
    try:
        return read_checkpoint(last)
    except CheckpointError as e:
        raise UserError(f"--resume: {first_line(e, 400)}; copy checkpoints/best.ckpt over it to resume from the "
                        "best one, or start over with --overwrite") from None


def run_callbacks(config: Any, batch_size: int) -> list:
    checkpoints = Path(config["out_dir"]) / "checkpoints"
    callbacks = [
        # best.ckpt: lowest validation loss so far
        ModelCheckpoint(dirpath=checkpoints, filename="best", monitor="val_loss", mode="min", save_top_k=1,
                        enable_version_counter=False, auto_insert_metric_name=False),
        # last.ckpt: every checkpoint_every steps, what --resume continues from
        ModelCheckpoint(dirpath=checkpoints, filename="last", every_n_train_steps=config["checkpoint_every"],
                        save_top_k=1, enable_version_counter=False),
        LearningRateMonitor(logging_interval="step"),
        ThroughputMonitor(batch_size_fn=lambda batch: batch.size(0), length_fn=lambda batch: batch.size(1) - 1,
                          window_size=10),  # rates over the last 10 batches
        RNGState(),
        TextSamples(config["sample_tokens"]),
        AttentionImages(config["attention_images"]),
    ]
    if config["trainer"].get("enable_progress_bar") is not False:
        # redrawn every PROGRESS_REFRESH steps, not every step: redrawing cost ~3% of a small CPU model's step
        callbacks.append(TQDMProgressBar(refresh_rate=PROGRESS_REFRESH))
    if config["compile"]:
        callbacks.append(CompileModel(batch_size))
    if not config["trainer"].get("max_time"):  # Lightning adds its own Timer for max_time; else time the run
        callbacks.append(Timer())
    return callbacks


def check_writable(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test-{id(out_dir)}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write to out_dir {out_dir} ({e.strerror or type(e).__name__}); "
                        "choose a writable --out_dir") from None


def lock_run_dir(out_dir: Path) -> IO[str] | None:
    """An exclusive lock on out_dir for this process's lifetime (the OS drops it when the process ends, however
    it ends): a second train.py on the same run directory is refused instead of mixing two runs' files.
    Only the launching process takes it (DDP workers it starts share its run directory)."""
    if any(os.environ.get(k, "0") != "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK")):
        return None
    handle = open(out_dir / ".train.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        other = handle.read().strip() or "another process"
        handle.close()
        raise UserError(f"{out_dir} is in use by another train.py (pid {other}); wait for it to finish or "
                        "choose another --out_dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


@contextlib.contextmanager
def replacing(checkpoints: Path, enabled: bool) -> Iterator[None]:
    """--overwrite: the old run's checkpoints are moved aside, not deleted, until the new run has written a
    checkpoint of its own or finished; if it fails before that, they are put back."""
    aside = temp_sibling(checkpoints, "old")
    if enabled:
        os.rename(checkpoints, aside)
    try:
        yield
    except BaseException:
        if enabled and aside.exists() and not any(checkpoints.glob("*.ckpt")):
            shutil.rmtree(checkpoints, ignore_errors=True)
            os.rename(aside, checkpoints)
            print(f"the new run failed before its first checkpoint: {checkpoints} is as it was", file=sys.stderr)
        raise
    finally:
        if enabled and aside.exists():
            shutil.rmtree(aside, ignore_errors=True)


SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}


@contextlib.contextmanager
def stop_on_signals(trainer: Trainer) -> Iterator[list[str]]:
    """Ctrl-C (SIGINT) ends training after the current step, like SIGTERM (which Lightning handles), so the
    checkpoint saved then is a whole one; a second Ctrl-C stops at once.  Yields the list of signals received."""
    received: list[str] = []
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield received
        return

    def on_sigint(signum: int, frame: Any) -> None:
        if received:
            raise KeyboardInterrupt
        received.append("SIGINT")
        trainer.should_stop = True
        print("\nstopping after this step and saving a checkpoint (Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield received
    finally:
        signal.signal(signal.SIGINT, previous)


def parse(argv: list[str] | None = None) -> MiniGPTCLI:
    """Parse the config and flags and build the datamodule, the module and the trainer (nothing is trained)."""
    given = sys.argv[1:] if argv is None else argv
    parser_kwargs: dict[str, Any] = {"prog": "train.py"}
    if not any(a in ("-c", "--config") or a.startswith("--config=") for a in given):
        parser_kwargs["default_config_files"] = [str(default_config())]  # shipped in the package, never skipped
    with warnings.catch_warnings():  # args given as a list (tests, scripts) is intended, not a mistake
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        return MiniGPTCLI(GPTLightningModule, TokenDataModule, trainer_class=MiniGPTTrainer,
                          parser_class=TrainArgumentParser, args=argv,
                          run=False, trainer_defaults=TRAINER_DEFAULTS, parser_kwargs=parser_kwargs,
                          save_config_kwargs={"overwrite": True}, auto_configure_optimizers=False)


def main(argv: list[str] | None = None) -> Trainer:
    """Parse the config and flags, train, save the final state; returns the Trainer (for tests and scripts)."""
    cli = parse(argv)
    out_dir = Path(cli.config["out_dir"])
    check_writable(out_dir)
    lock = lock_run_dir(out_dir)
    try:
        return _train(cli, out_dir)
    finally:  # released here too, not only at exit: in-process callers (tests, notebooks) run main again
        if lock is not None:
            lock.close()


def _train(cli: MiniGPTCLI, out_dir: Path) -> Trainer:
    last = out_dir / "checkpoints" / "last.ckpt"
    ckpt_path, overwrite = None, False
    if cli.config["resume"]:
        if not last.is_file():
            raise UserError(f"--resume: no checkpoint at {last}; start the run without --resume "
                            "(or point --out_dir at the run to continue)")
        saved = read_last(last)
        check_resumable(saved, cli.model.config, cli.model.tokenizer, last)
        ckpt_path = str(last)
    elif (out_dir / "checkpoints").is_dir() and any((out_dir / "checkpoints").glob("*.ckpt")):
        if not cli.config["overwrite"]:
            raise UserError(f"{out_dir} already holds a run; continue it with --resume, pick another --out_dir, "
                            "or pass --overwrite to start over")
        overwrite = cli.trainer.is_global_zero
    trainer = cli.trainer
    with replacing(out_dir / "checkpoints", overwrite), stop_on_signals(trainer) as stopped_by:
        try:
            trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path, weights_only=True)
        except SIGTERMException:  # Lightning's: raised between steps after a SIGTERM, the state is whole
            stopped_by.append("SIGTERM")
        trainer.save_checkpoint(last, weights_only=False)  # the final state, whatever step the run stopped at
    if stopped_by:
        print(f"error: stopped by {stopped_by[0]} at step {trainer.global_step}; saved {last}; continue the run "
              "with --resume", file=sys.stderr, flush=True)
        raise SystemExit(128 + SIGNALS[stopped_by[0]])
    if trainer.is_global_zero:
        val_loss = trainer.callback_metrics.get("val_loss")
        shown = f"{val_loss.item():.4f}" if val_loss is not None else "n/a"
        print(f"final val loss {shown} after {trainer.global_step} steps; checkpoint: {last}")
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
        if timer is not None:  # fit loop only (validation included): not data preparation, not the final eval
            print(f"training time {timer.time_elapsed('train'):.1f}s")
    if cli.config["eval_full"] and trainer.world_size == 1:
        start = time.perf_counter()
        with torch.compiler.set_stance("force_eager"):  # a ragged last batch would trigger a recompile
            nats, n = evaluate_tokens(cli.model.model, cli.datamodule.prepared.val,
                                      cli.datamodule.hparams.batch_size)
        trainer.callback_metrics["full_val_loss"] = torch.tensor(nats / n)
        print(f"full val loss {nats / n:.4f} over all {n:,} validation tokens "
              f"({time.perf_counter() - start:.1f}s to evaluate)")
    return trainer


def entry() -> None:
    run_cli(main)
