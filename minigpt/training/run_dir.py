"""The run directory's guards: writable, one train.py at a time, --overwrite that can be undone, Ctrl-C that saves.

A run directory (out_dir) holds checkpoints/, TensorBoard events and config.yaml.  These context managers and
checks keep it whole whatever happens to the process: a second train.py is refused, an --overwrite run that fails
before its first checkpoint puts the old checkpoints back, and Ctrl-C stops after the current step.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, Timer
from lightning.pytorch.utilities.exceptions import SIGTERMException

from minigpt.core.checkpoint import SECTION, check_resumable
from minigpt.core.errors import UserError
from minigpt.core.fsutil import make_writable_dir, pid_alive, remove_stale, temp_sibling
from minigpt.training.datamodule import resume_data_notes
from minigpt.training.optim import check_optim_resumable
from minigpt.training.sft import check_chat_resumable

LOCK_FILE, PID_FILE = ".train.lock", ".train.pid"
SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}


def nothing_to_resume(last: Path) -> UserError:
    if holds_run(last.parent.parent):  # without --resume the run is refused as one that exists: say what does
        return UserError(
            f"--resume: no checkpoint at {last}, where the run's last state goes; copy checkpoints/best.ckpt (or "
            "another of its checkpoints) there to resume from it, or start over with --overwrite"
        )
    return UserError(
        f"--resume: no checkpoint at {last}; start the run without --resume (or point --out_dir at the run to continue)"
    )


def holds_run(out_dir: Path) -> bool:
    return (out_dir / "checkpoints").is_dir() and any((out_dir / "checkpoints").glob("*.ckpt"))


def already_a_run(out_dir: Path) -> UserError:
    return UserError(
        f"{out_dir} already holds a run; continue it with --resume, pick another --out_dir, or pass --overwrite to "
        "start over"
    )


def refuse_taken(out_dir: Path, resume: bool, overwrite: bool) -> None:
    """The run directory's refusals that need no data, made before the data is prepared (a large corpus's BPE
    takes minutes); train.py makes them again once it holds out_dir.  Left to that check while another train.py
    holds it, or an interrupted --overwrite left files that recover() puts back."""
    if (out_dir / LOCK_FILE).exists() or any(out_dir.glob(".checkpoints.old-*")):
        return
    if resume and not (out_dir / "checkpoints" / "last.ckpt").is_file():
        raise nothing_to_resume(out_dir / "checkpoints" / "last.ckpt")
    if not resume and not overwrite and holds_run(out_dir):
        raise already_a_run(out_dir)


def check_resume(saved: dict[str, Any], module: Any, datamodule: Any, trainer: Trainer, last: Path) -> None:
    """Every check a resume from `saved` (last's contents) passes before Lightning restores it: the same data's
    tokenizer and chat format, the same model and optimizer settings, steps left to train; and a note for each data
    setting it changes, the number of processes among them (each has its own batch)."""
    check_chat_resumable(saved, module.tokenizer, last)
    check_resumable(saved, module.config, module.tokenizer, last)
    check_optim_resumable(saved[SECTION].get("optim"), module.optim, last)
    check_steps_left(last, saved["global_step"], trainer.max_steps)
    check_budget_left(last, saved, trainer)
    notes = resume_data_notes(saved.get("datamodule_hyper_parameters"), dict(datamodule.hparams))
    if (before := saved[SECTION].get("world_size", trainer.world_size)) != trainer.world_size:
        notes.append(
            f"--resume on {trainer.world_size} process(es) (the run had {before}): each optimizer step now reads "
            f"{trainer.world_size} batch(es) of data.batch_size where it read {before}"
        )
    for note in notes if trainer.is_global_zero else []:
        print(f"note: {note}", file=sys.stderr, flush=True)


def check_steps_left(last: Path, step: int, max_steps: int) -> None:
    """A resume from `last`, at `step`, must have steps left to train (max_steps -1: no bound)."""
    if 0 <= max_steps <= step:
        raise UserError(
            f"--resume: {last} is at step {step}, so --trainer.max_steps {max_steps} trains nothing; "
            f"raise --trainer.max_steps above {step} to continue the run"
        )


def check_budget_left(last: Path, saved: dict[str, Any], trainer: Trainer) -> None:
    """A resume must have epochs (max_epochs) and training time (max_time) left: Lightning would stop at once."""
    loop = saved.get("loops", {}).get("fit_loop", {})
    epoch, batch = loop.get("epoch_progress", {}).get("current", {}), loop.get("epoch_loop.batch_progress", {})
    epochs = epoch.get("processed")
    if epochs is not None and epoch.get("started", 0) > epochs and batch.get("is_last_batch"):
        epochs += 1  # saved at the validation after the epoch's last batch, before Lightning counted the epoch
    if epochs is not None and 0 < (trainer.max_epochs or 0) <= epochs:
        raise UserError(
            f"--resume: {last} has trained {epochs} epoch(s), so --trainer.max_epochs {trainer.max_epochs} trains "
            f"nothing; raise --trainer.max_epochs above {epochs} to continue the run"
        )
    spent = saved.get("callbacks", {}).get("Timer", {}).get("time_elapsed", {}).get("train")
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    budget = timer.time_remaining() if timer is not None else None  # before the restore: the whole max_time
    if spent is not None and budget is not None and spent >= budget:
        raise UserError(
            f"--resume: {last} has trained for {spent:.1f}s, the whole --trainer.max_time ({budget:g}s), so it "
            "trains nothing; raise --trainer.max_time to continue the run"
        )


def interval_past_epoch(trainer: Trainer) -> UserError:
    """Lightning's refusal of a val_check_interval longer than an epoch when validation is counted per epoch."""
    batches, every = trainer.fit_loop.max_batches, trainer.check_val_every_n_epoch
    return UserError(
        f"trainer.val_check_interval {trainer.val_check_interval} is more than an epoch's {batches} training batches, "
        f"and trainer.check_val_every_n_epoch {every} validates within each epoch; give val_check_interval at most "
        f"{batches} (or a fraction of an epoch, e.g. 0.5), or check_val_every_n_epoch null to count the batches "
        "across epochs"
    )


def check_writable(out_dir: Path, resume: bool, loggers: Sequence[Any] = ()) -> None:
    """out_dir made if missing and written to; with --resume a missing one is refused first (not made empty).  So is
    the save_dir of a --trainer.logger of one's own, which Lightning makes in its setup (an unwritable one failed
    there, with a traceback); a URL's (a remote file system) is left to the logger."""
    if resume and not out_dir.exists():
        raise nothing_to_resume(out_dir / "checkpoints" / "last.ckpt")
    dirs = [(out_dir, "out_dir", "--out_dir")]
    dirs += [
        (Path(logger.save_dir), f"{type(logger).__name__}'s save_dir", "--trainer.logger.save_dir")
        for logger in loggers
        if getattr(logger, "save_dir", None) and "://" not in str(logger.save_dir)
    ]
    for folder, name, flag in dirs:
        try:
            make_writable_dir(folder)
        except OSError as e:
            raise UserError(
                f"cannot write to {name} {folder} ({e.strerror or type(e).__name__}); choose a writable {flag}"
            ) from None


class RunLock:
    """An exclusive lock on out_dir for this process's lifetime (filelock: the OS drops it when the process ends,
    however it ends, on every platform): a second train.py on the same run directory is refused instead of mixing
    two runs' files.  The holder's pid sits in a file beside the lock, for the refusal's message."""

    def __init__(self, out_dir: Path) -> None:
        self.lock = FileLock(out_dir / LOCK_FILE)
        self.pid_file = out_dir / PID_FILE
        try:
            self.lock.acquire(timeout=0)
        except Timeout:
            try:
                other = f"pid {self.pid_file.read_text().strip()}"
            except OSError:
                other = "pid unknown"
            raise UserError(
                f"{out_dir} is in use by another train.py ({other}); wait for it to finish or choose another --out_dir"
            ) from None
        self.pid_file.write_text(str(os.getpid()))

    def close(self) -> None:
        """Release the lock and take its two files away: a run that ended (or was stopped) leaves none.  The lock
        file goes while it is still held; a train.py that opened it meanwhile sees, once it gets the lock, that the
        file is gone, and starts over on a new one (filelock checks), so two runs cannot both hold the directory."""
        self.pid_file.unlink(missing_ok=True)
        with contextlib.suppress(PermissionError):  # Windows removes no open file: filelock's release removes it there
            Path(self.lock.lock_file).unlink(missing_ok=True)
        self.lock.release()


def lock_run_dir(out_dir: Path) -> RunLock | None:
    """Only the launching process takes the lock (DDP workers it starts share its run directory)."""
    if any(os.environ.get(k, "0") != "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK")):
        return None
    return RunLock(out_dir)


# what train.py itself writes that a new run replaces: --overwrite moves these and nothing else
RUN_FILES = ("checkpoints/best.ckpt", "checkpoints/last.ckpt", "config.yaml", "hparams.yaml")
LOGS = "events.out.tfevents.*"  # TensorBoard's: another run's curves would mix with the new run's


def run_files(folder: Path) -> list[str]:
    """The run's own files in `folder` (out_dir, or where --overwrite set them aside): RUN_FILES and its logs."""
    return [*RUN_FILES, *sorted(p.name for p in folder.glob(LOGS))]


ASIDE = re.compile(r"^\.checkpoints\.old-(\d+)$")  # fsutil.temp_sibling(out_dir / "checkpoints", "old")


def _move(names: tuple[str, ...] | list[str], src: Path, dst: Path) -> list[str]:
    moved = []
    for name in names:
        if (src / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            os.rename(src / name, dst / name)
            moved.append(name)
    return moved


@contextlib.contextmanager
def replacing(out_dir: Path, enabled: bool) -> Iterator[None]:
    """--overwrite: the old run's files (RUN_FILES; a user's own files stay where they are) are moved aside, not
    deleted, until the new run has written a checkpoint of its own or finished; if it fails before that, they are
    put back.  A process killed in between leaves them aside, and the next train.py puts them back (recover)."""
    aside = temp_sibling(out_dir / "checkpoints", "old")
    moved = _move(run_files(out_dir), out_dir, aside) if enabled else []
    try:
        yield
    finally:  # an exception, or a stop (Ctrl-C, SIGTERM) before the first step, which saves nothing
        if moved and not any((out_dir / name).is_file() for name in RUN_FILES if name.endswith(".ckpt")):
            for log in out_dir.glob(LOGS):  # the failed run's
                log.unlink()
            _move(moved, aside, out_dir)
            print(f"the new run stopped before its first checkpoint: {out_dir} is as it was", file=sys.stderr)
        if enabled:
            shutil.rmtree(aside, ignore_errors=True)


def recover(out_dir: Path) -> None:
    """Files an --overwrite run set aside and never took back, because it was killed: put them back where the run
    that replaced them left no checkpoint, else drop them (the new run had checkpointed: they were replaced).  Then
    the temporary files of killed writes (a checkpoint cut short by a kill) go."""
    for aside in out_dir.glob(".checkpoints.old-*"):
        m = ASIDE.match(aside.name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        if not any((out_dir / name).is_file() for name in RUN_FILES if name.endswith(".ckpt")):
            names = [name for name in run_files(aside) if (aside / name).is_file()]
            for name in [*names, *(p.name for p in out_dir.glob(LOGS))]:  # the killed run's logs go too
                (out_dir / name).unlink(missing_ok=True)
            _move(names, aside, out_dir)
            print(
                f"put back the previous run's files that an interrupted --overwrite had set aside in {aside.name}",
                file=sys.stderr,
            )
        shutil.rmtree(aside, ignore_errors=True)
    for folder in (out_dir, out_dir / "checkpoints"):  # a killed save's half-written .last.ckpt.tmp-PID, and such
        remove_stale(folder)


class SignalStop(Callback):
    """Stops every rank at the same step when any of them received Ctrl-C or SIGTERM: a stop one rank takes alone
    leaves the others waiting in the next step's collectives (a hang).  Whether a rank received one is agreed on
    (one all-reduce of a number) after each training batch and each validation; Ctrl-C then stops after that step
    (validated and saved), SIGTERM at the next batch's start, as Lightning's SIGTERMException does.

    While it trains, SIGTERM is this callback's: Lightning 2.6's own handler runs a broadcast inside the handler,
    which hangs where every rank receives the signal (a scheduler's group kill) or one receives it twice."""

    STOPS = ("", "SIGINT", "SIGTERM")  # the agreed number: the strongest stop any rank received

    def __init__(self, received: list[str]) -> None:
        self.received = received
        self.training = False
        self.terminate = False

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.training = True
        if threading.current_thread() is threading.main_thread():  # in place of Lightning's, until its teardown
            signal.signal(signal.SIGTERM, self.on_sigterm)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.training = False

    def on_sigterm(self, signum: int, frame: Any) -> None:
        if "SIGTERM" not in self.received:
            self.received.append("SIGTERM")

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if self.terminate:
            # Lightning has counted this batch as ready: uncounted, the checkpoint is one saved between batches, as
            # its own SIGTERMException leaves it; else a resume counts the step twice (its logs one step late)
            progress = trainer.fit_loop.epoch_loop.batch_progress
            progress.current.ready -= 1
            progress.total.ready -= 1
            raise SIGTERMException

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.agree(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        if self.training:
            self.agree(trainer)

    def agree(self, trainer: Trainer) -> None:
        stop = max((self.STOPS.index(name) for name in self.received), default=0)
        if trainer.world_size > 1:
            mine = torch.tensor(stop, device=trainer.strategy.root_device)
            stop = int(trainer.strategy.reduce(mine, reduce_op="max").item())
        if stop and self.STOPS[stop] not in self.received:  # another rank's: this one stops as it does
            self.received.append(self.STOPS[stop])
        if stop == 2:
            self.terminate = True
        elif stop == 1:
            trainer.should_stop = True


@contextlib.contextmanager
def stop_on_signals(trainer: Trainer) -> Iterator[list[str]]:
    """Ctrl-C (SIGINT) ends training after the current step, SIGTERM before the next one, so the checkpoint saved
    then is a whole one (SignalStop, on every rank at the same step); a second Ctrl-C stops at once (a
    KeyboardInterrupt, which Lightning turns into SystemExit(1) after tearing the run down).  Before training starts
    (set-up, compiling) a stop in one process ends the run before its first step; under several, after it (the
    ranks agree at each step).  Yields the list of signals received."""
    received: list[str] = []
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield received
        return
    stopper = SignalStop(received)
    trainer.callbacks.append(stopper)

    def stop_before_training() -> None:
        if not stopper.training and trainer.world_size == 1:
            trainer.should_stop = True

    def on_sigint(signum: int, frame: Any) -> None:
        received.append("SIGINT")
        if received.count("SIGINT") > 1:
            raise KeyboardInterrupt
        stop_before_training()
        if trainer.is_global_zero:  # a terminal's Ctrl-C reaches every rank: said once
            print(
                "\nstopping after this step and saving a checkpoint (Ctrl-C again to stop at once)",
                file=sys.stderr,
                flush=True,
            )

    def on_sigterm(signum: int, frame: Any) -> None:
        # before training starts and after it ends (SignalStop's while it trains): a SIGTERM while the step compiles,
        # a --resume restores or the final state is saved would otherwise kill the process, unsaid and with its lock
        # files left
        if "SIGTERM" not in received:
            received.append("SIGTERM")
        stop_before_training()

    previous = signal.signal(signal.SIGINT, on_sigint)
    previous_term = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield received
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)


@contextlib.contextmanager
def stop_at_once(received: list[str], last: Path) -> Iterator[None]:
    """A second Ctrl-C (stop_on_signals' KeyboardInterrupt) while the run trains or saves its final state: one line
    and exit 130.  It surfaces as Lightning's SystemExit(1), as a KeyboardInterrupt in the final save, or as the
    error torch.save raises when one cuts its write short; last.ckpt is the last whole save (atomic_write)."""
    try:
        yield
    except (SystemExit, KeyboardInterrupt, RuntimeError):
        if received[:2] != ["SIGINT", "SIGINT"]:
            raise
        saved = f"continue from {last} with --resume" if last.is_file() else "no checkpoint was saved yet"
        print(f"stopped at once by a second Ctrl-C; {saved}", file=sys.stderr)
        raise SystemExit(128 + SIGNALS["SIGINT"]) from None


@contextlib.contextmanager
def sigterm_ends_evaluation() -> Iterator[None]:
    """A SIGTERM (a scheduler's) while the finished run's full split is evaluated: one line and exit 143, the run's
    lock files removed on the way out; by default it killed the process unsaid and left them."""

    def stop(signum: int, frame: Any) -> None:
        print("error: stopped by SIGTERM during the full validation; the run's checkpoints are saved", file=sys.stderr)
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield
        return
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
