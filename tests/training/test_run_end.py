"""How a run ends: its last step validates, the end says the best val loss with its step and checkpoint, early
stopping (off by default) stops a run that stops improving and keeps its best checkpoint, the commands and init_from
say which checkpoint a run directory gives them, a mid-epoch resume is resumable to Lightning, and the run's lock
files go (issues 48 and 49)."""

import contextlib
import io
import os
import random
import re
import shutil
import signal
import warnings
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback, EarlyStopping
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from minigpt.cli import attention as attention_cli
from minigpt.cli import eval as eval_cli
from minigpt.cli import export as export_cli
from minigpt.cli import sample as sample_cli
from minigpt.cli.train import main
from minigpt.core.checkpoint import read_checkpoint
from minigpt.core.errors import UserError

LETTERS = "abcdefghijklmnopqrst"
PATIENCE, INTERVAL, MAX_STEPS = 2, 5, 400


def val_losses(run: Path) -> list[float]:
    return [e.value for e in EventAccumulator(str(run)).Reload().Scalars("val_loss")]


@pytest.fixture(scope="module")
def stopped_run(tiny_run_args, data_root, tmp_path_factory):
    """A run on random letters, which it cannot learn beyond their frequencies: its val loss soon stops falling,
    and early stopping (patience 2, a validation every 5 steps) ends it long before max_steps."""
    tmp = tmp_path_factory.mktemp("stopped")
    rng = random.Random(0)
    corpus = tmp / "letters.txt"
    corpus.write_text("".join(rng.choice(LETTERS) for _ in range(4000)))
    run = tmp / "run"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer = main(
            tiny_run_args(
                corpus,
                data_root,
                run,
                steps=MAX_STEPS,
                trainer__val_check_interval=INTERVAL,
                early_stopping__patience=PATIENCE,
                eval_full="false",
            )
        )
    found = re.search(r"^best val loss ([\d.]+) at step (\d+); checkpoint: (.+) \(what sample", out.getvalue(), re.M)
    assert found, out.getvalue()
    return run, trainer, out.getvalue(), float(found[1]), int(found[2]), Path(found[3])


def test_early_stopping_stops_a_run_that_stops_improving_and_keeps_the_best_checkpoint(stopped_run):
    run, trainer, out, best_loss, best_step, best = stopped_run
    assert trainer.global_step < MAX_STEPS, out
    # it stopped after PATIENCE validations in a row without a lower val loss than the best's
    assert trainer.global_step - best_step == PATIENCE * INTERVAL, out
    losses = val_losses(run)
    assert min(losses) == pytest.approx(best_loss, abs=1e-4) and min(losses[-PATIENCE:]) >= best_loss
    assert f"early stopping: val loss not lower for {PATIENCE} validations in a row" in out
    assert f"stopped at step {trainer.global_step}" in out
    # best.ckpt still holds the best step's weights: the later, worse validations did not replace it
    assert best == run / "checkpoints" / "best.ckpt"
    assert read_checkpoint(best)["global_step"] == best_step
    assert read_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == trainer.global_step


def test_early_stopping_names_its_min_delta(tiny_run_args, corpus, data_root, tmp_path, capsys):
    """With early_stopping.min_delta, a val loss that fell by less than it does not count as lower: the end says so."""
    argv = tiny_run_args(corpus, data_root, tmp_path / "run", steps=50, trainer__val_check_interval=INTERVAL)
    trainer = main(
        argv + ["--early_stopping.patience", "1", "--early_stopping.min_delta", "10", "--eval_full", "false"]
    )
    assert trainer.global_step == 2 * INTERVAL  # the first validation sets the best, the second does not beat it
    out = capsys.readouterr().out
    assert "early stopping: val loss not lower by more than 10 for 1 validation in a row" in out, out


def test_early_stopping_kept_going_by_min_steps_says_where_patience_ran_out(
    tiny_run_args, corpus, data_root, tmp_path, capsys
):
    """Lightning honours early stopping only once trainer.min_steps (and the min_epochs 1 it sets with them) are
    done: the end says where patience ran out and what kept the run going (it said the run stopped at its end)."""
    argv = tiny_run_args(corpus, data_root, tmp_path / "run", steps=50, trainer__val_check_interval=INTERVAL)
    argv += ["--early_stopping.patience", "1", "--early_stopping.min_delta", "10", "--eval_full", "false"]
    trainer = main(argv + ["--trainer.min_steps", "30"])
    assert trainer.global_step >= 30
    out = capsys.readouterr().out
    assert (
        "early stopping: val loss not lower by more than 10 for 1 validation in a row (early_stopping.patience 1); "
        f"at step {2 * INTERVAL}; trainer.min_steps 30 and trainer.min_epochs 1 kept the run going to step "
        f"{trainer.global_step}\n"
    ) in out, out


def test_a_run_without_a_logger_trains_and_ends_as_any_run(tiny_run_args, corpus, data_root, tmp_path, capsys):
    """--trainer.logger false: no TensorBoard events, and no callback that needs a logger (the learning-rate
    monitor raised MisconfigurationException, a traceback)."""
    trainer = main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=10) + ["--trainer.logger", "false"])
    assert trainer.global_step == 10 and trainer.logger is None
    assert "best val loss" in capsys.readouterr().out and not list((tmp_path / "run").glob("events.*"))


def test_a_moved_run_resumes_with_its_best(stopped_run, tiny_run_args, data_root, tmp_path, capsys, monkeypatch):
    """A run directory copied (or moved) elsewhere and resumed keeps its best: Lightning forgets the best score
    where the checkpoints' folder changed, and a worse validation then replaced best.ckpt and was called the best."""
    from minigpt.training.lightning_module import GPTLightningModule

    run, trainer, _, best_loss, best_step, _ = stopped_run
    moved = Path(shutil.copytree(run, tmp_path / "moved"))
    best = (moved / "checkpoints" / "best.ckpt").read_bytes()
    real = GPTLightningModule.batch_loss
    monkeypatch.setattr(  # the resumed run's validations are far worse than the best
        GPTLightningModule, "batch_loss", lambda self, batch, stage: real(self, batch, stage) + (stage == "val")
    )
    steps = trainer.global_step + INTERVAL
    argv = tiny_run_args(
        run.parent / "letters.txt", data_root, moved, steps=steps, trainer__val_check_interval=INTERVAL
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = main(
            argv + ["--early_stopping.patience", str(PATIENCE + 1), "--eval_full", "false", "--resume", "true"]
        )
    assert resumed.global_step == steps and val_losses(moved)[-1] > best_loss + 0.9
    assert not [w for w in caught if "dirpath has changed" in str(w.message)], [str(w.message) for w in caught]
    assert (moved / "checkpoints" / "best.ckpt").read_bytes() == best
    out = capsys.readouterr().out
    assert (
        f"best val loss {best_loss:.4f} at step {best_step}; checkpoint: {moved / 'checkpoints' / 'best.ckpt'}" in out
    )


def test_an_early_stopped_run_resumes_with_a_raised_patience_and_refuses_the_same(
    stopped_run, tiny_run_args, data_root, tmp_path, capsys
):
    """Lightning restored the checkpoint's patience over the one given, so a raised patience never continued an
    early-stopped run; the same patience would stop it at its next validation, and is refused in one line."""
    run, trainer, *_ = stopped_run
    copy = Path(shutil.copytree(run, tmp_path / "copy"))
    steps = trainer.global_step + 2 * INTERVAL
    argv = tiny_run_args(run.parent / "letters.txt", data_root, copy, steps=steps, trainer__val_check_interval=INTERVAL)
    argv += ["--eval_full", "false", "--resume", "true", "--early_stopping.patience"]
    with pytest.raises(UserError, match=f"raise --early_stopping.patience above {PATIENCE} to continue it"):
        main(argv + [str(PATIENCE)])
    resumed = main(argv + [str(PATIENCE + 2)])  # two more validations: not lower, but within the new patience
    assert resumed.global_step == steps


@pytest.mark.parametrize("steps,interval,validations", [(7, 10, 1), (10, 5, 2)])
def test_every_run_ends_with_a_validation_and_names_its_best(
    tiny_run_args, corpus, data_root, tmp_path, capsys, steps, interval, validations
):
    """A run whose val_check_interval never comes still validates at its last step (it said "val loss n/a"), and
    one whose last step validates anyway does so once; early stopping is off unless asked for."""
    run = tmp_path / "run"
    trainer = main(tiny_run_args(corpus, data_root, run, steps=steps, trainer__val_check_interval=interval))
    out = capsys.readouterr().out
    val_loss = trainer.callback_metrics["val_loss"].item()
    assert f"estimated val loss {val_loss:.4f} (2 batches of 8) after {steps} steps" in out
    validated_at = [interval * (i + 1) for i in range(validations - 1)] + [steps]
    assert len(val_losses(run)) == validations
    best_loss, best_step = min(zip(val_losses(run), validated_at))
    best = run / "checkpoints" / "best.ckpt"
    assert f"best val loss {best_loss:.4f} at step {best_step}; checkpoint: {best}" in out
    assert read_checkpoint(best)["global_step"] == best_step
    assert trainer.global_step == steps and not any(isinstance(c, EarlyStopping) for c in trainer.callbacks)
    assert not {".train.lock", ".train.pid"} & {p.name for p in run.iterdir()}


def test_commands_say_which_checkpoint_a_run_directory_gives_them(stopped_run, tmp_path, capsys, monkeypatch):
    """A run directory means its best checkpoint, and every command reading one says so in one stderr line; with
    no --ckpt, it names the run it picked under out/; a file the user names is taken without a word."""
    run, _, _, best_loss, best_step, best = stopped_run
    line = f"using {best} (step {best_step}, val loss {best_loss:.4f}, the run's best)"
    capsys.readouterr()
    sample_cli.main(["--ckpt", str(run), "--prompt", "ab", "--max_new_tokens", "3"], stdout=io.StringIO())
    assert capsys.readouterr().err.splitlines() == [line]
    text = tmp_path / "text.txt"
    text.write_text(LETTERS * 20)
    eval_cli.main(["--ckpt", str(run), "--text", str(text)])
    export_cli.main(["--ckpt", str(run), "--out", str(tmp_path / "hf")])
    attention_cli.main(["--ckpt", str(run), "--prompt", "abc", "--out", str(tmp_path / "lab")], stdout=io.StringIO())
    assert capsys.readouterr().err.splitlines() == [line] * 3

    sample_cli.main(["--ckpt", str(best), "--prompt", "ab", "--max_new_tokens", "3"], stdout=io.StringIO())
    assert capsys.readouterr().err == ""

    shutil.copytree(run, tmp_path / "out" / "letters")
    monkeypatch.chdir(tmp_path)
    sample_cli.main(["--prompt", "ab", "--max_new_tokens", "3"], stdout=io.StringIO())
    assert capsys.readouterr().err.splitlines() == [
        f"using {Path('out/letters/checkpoints/best.ckpt')} (no checkpoint named: the newest run under out/; "
        f"step {best_step}, val loss {best_loss:.4f}, the run's best)"
    ]


def test_init_from_a_run_directory_says_which_checkpoint_it_took(
    stopped_run, tiny_run_args, data_root, tmp_path, capsys
):
    """init_from reads a run directory as its best checkpoint and says so in the commands' one stderr line, once
    the source is accepted: a refused fine-tune shows only its error."""
    run, _, _, best_loss, best_step, best = stopped_run
    corpus = tmp_path / "letters.txt"
    corpus.write_text(LETTERS * 200)
    args = tiny_run_args(corpus, data_root, tmp_path / "tuned", steps=1, eval_full="false")
    args = [x for k, v in zip(args[::2], args[1::2]) if not k.startswith("--model.") for x in (k, v)]
    capsys.readouterr()
    main([*args, "--init_from", str(run)])
    line = f"using {best} (step {best_step}, val loss {best_loss:.4f}, the run's best)"
    assert capsys.readouterr().err.splitlines().count(line) == 1
    with pytest.raises(UserError):  # a model setting the source decides: refused
        main([*args, "--init_from", str(run), "--out_dir", str(tmp_path / "refused"), "--model.n_layer", "5"])
    assert line not in capsys.readouterr().err


def test_a_mid_epoch_resume_is_resumable_to_lightning(tiny_run_args, corpus, data_root, tmp_path):
    """The training loader's position is the trainer's step, and it says so through state_dict/load_state_dict:
    Lightning no longer warns that a mid-epoch resume has a loader that is not resumable (issue 48 item 17)."""
    run = tmp_path / "run"
    main(tiny_run_args(corpus, data_root, run, steps=10))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = main(tiny_run_args(corpus, data_root, run, steps=20) + ["--resume", "true"])
    assert trainer.global_step == 20 and trainer.num_training_batches > 20  # the resume was mid-epoch
    assert not [w for w in caught if "not resumable" in str(w.message)], [str(w.message) for w in caught]
    # every callback state in the checkpoint found its callback (best.ckpt's is ModelCheckpoint's own key)
    assert not [w for w in caught if "callbacks used to create the checkpoint" in str(w.message)]
    assert not [w for w in caught if "exists and is not empty" in str(w.message)]  # a resume's folder is full
    ckpt = read_checkpoint(run / "checkpoints" / "last.ckpt")
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"next_batch": 20}]
    best = next(v for k, v in ckpt["callbacks"].items() if k.startswith("ModelCheckpoint{'monitor': 'val_loss'"))
    assert best["best_step"] == read_checkpoint(run / "checkpoints" / "best.ckpt")["global_step"]


class CtrlC(Callback):
    """Presses Ctrl-C `times` times (SIGINT to this process) at the end of step `step`."""

    def __init__(self, step: int, times: int) -> None:
        self.step, self.times = step, times

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("times", [1, 2])
def test_ctrl_c_is_a_stop_not_an_error(tiny_run_args, corpus, data_root, tmp_path, capsys, monkeypatch, times):
    """Ctrl-C stops after the step, saves it and says where (a second one stops at once): exit 130, no `error:`
    line, no traceback, and no lock or pid file left in the run folder (issue 48 item 16)."""
    from minigpt.cli import train as train_cli
    from minigpt.cli.errors import run_cli

    real = train_cli.run_callbacks
    monkeypatch.setattr(train_cli, "run_callbacks", lambda *a, **k: real(*a, **k) + [CtrlC(step=3, times=times)])
    run = tmp_path / "run"
    last = run / "checkpoints" / "last.ckpt"
    with pytest.raises(SystemExit) as stopped:
        run_cli(lambda: main(tiny_run_args(corpus, data_root, run, steps=50, checkpoint_every=2)))
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert stopped.value.code == 130 and "error" not in captured.err and "Traceback" not in captured.err
    if times == 1:
        assert lines[-1] == f"stopped by SIGINT (Ctrl-C) at step 3; saved {last}; continue the run with --resume"
        assert read_checkpoint(last)["global_step"] == 3
        assert "best val loss" in captured.out  # the stop validated first, as the end of any run does
    else:
        assert lines[-1] == f"stopped at once by a second Ctrl-C; continue from {last} with --resume"
        assert read_checkpoint(last)["global_step"] == 2  # the last checkpoint_every save: nothing half-done
    assert not {".train.lock", ".train.pid"} & {p.name for p in run.iterdir()}


class Signal(Callback):
    """Sends `signal_number` to this process at the end of step `step` (0: as training starts, before any step)."""

    def __init__(self, step: int, signal_number: int) -> None:
        self.step, self.signal_number = step, signal_number

    def on_train_start(self, trainer, *args) -> None:
        if self.step == 0:
            os.kill(os.getpid(), self.signal_number)

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signal_number)


def test_ctrl_c_before_the_first_step_saves_nothing(tiny_run_args, corpus, data_root, tmp_path, capsys, monkeypatch):
    """An untrained step-0 checkpoint made out_dir a run (a plain rerun was refused, sample.py took random
    weights) and its resume logged every point a step late: nothing is saved, and the same command starts again."""
    from minigpt.cli import train as train_cli
    from minigpt.cli.errors import run_cli

    real = train_cli.run_callbacks
    monkeypatch.setattr(train_cli, "run_callbacks", lambda *a, **k: real(*a, **k) + [Signal(0, signal.SIGINT)])
    argv = tiny_run_args(corpus, data_root, tmp_path / "run", steps=10)
    with pytest.raises(SystemExit) as stopped:
        run_cli(lambda: main(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 130 and err[-1] == "stopped by SIGINT (Ctrl-C) before the first step; nothing saved"
    assert not list((tmp_path / "run").rglob("*.ckpt"))
    monkeypatch.setattr(train_cli, "run_callbacks", real)
    assert main(argv).global_step == 10


def test_an_overwrite_stopped_before_its_first_step_puts_the_old_run_back(
    tiny_run_args, corpus, data_root, tmp_path, capsys, monkeypatch
):
    """--overwrite sets the old run aside until the new one has a checkpoint: a Ctrl-C (or SIGTERM) before the
    first step saves none, and the old run's checkpoints and config went with the folder they were set aside in (the
    stop ends the run without an exception, which alone put them back)."""
    from minigpt.cli import train as train_cli
    from minigpt.cli.errors import run_cli

    run = tmp_path / "run"
    main(tiny_run_args(corpus, data_root, run, steps=5))
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    real = train_cli.run_callbacks
    monkeypatch.setattr(train_cli, "run_callbacks", lambda *a, **k: real(*a, **k) + [Signal(0, signal.SIGINT)])
    with pytest.raises(SystemExit) as stopped:
        run_cli(lambda: main(tiny_run_args(corpus, data_root, run, steps=10) + ["--overwrite"]))
    assert stopped.value.code == 130
    assert f"the new run stopped before its first checkpoint: {run} is as it was" in capsys.readouterr().err
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_max_epochs_run_stopped_by_sigterm_resumes_exactly(tiny_run_args, corpus, data_root, tmp_path, monkeypatch):
    """The data order of a max_epochs run restarted at batch 0 on resume: Lightning makes the training iterator
    before it restores the checkpoint (the schedule asks for its estimated_stepping_batches)."""
    import torch

    from minigpt.cli import train as train_cli
    from minigpt.core.checkpoint import model_state_dict

    def argv(out):
        return tiny_run_args(corpus, data_root, tmp_path / out, steps=-1, trainer__max_epochs=1, model__dropout=0.1)

    straight = main(argv("straight"))
    real = train_cli.run_callbacks
    monkeypatch.setattr(train_cli, "run_callbacks", lambda *a, **k: real(*a, **k) + [Signal(5, signal.SIGTERM)])
    with pytest.raises(SystemExit):
        main(argv("resumed"))
    monkeypatch.setattr(train_cli, "run_callbacks", real)
    resumed = main(argv("resumed") + ["--resume", "true"])
    assert resumed.global_step == straight.global_step > 10
    a, b = (
        model_state_dict(read_checkpoint(tmp_path / r / "checkpoints" / "last.ckpt")) for r in ("straight", "resumed")
    )
    assert all(torch.equal(a[k], b[k]) for k in a), "a resumed run must match an uninterrupted one bitwise"


def test_a_run_whose_best_is_not_its_end_reports_the_full_split_loss_of_both(
    tiny_run_args, corpus, data_root, tmp_path, monkeypatch, capsys
):
    """A run that overfit ends above its best: the end gives the full split's loss of the best checkpoint (what the
    commands take) beside the final weights', and the module keeps its final weights.  The reference: the full
    split's loss that a shorter run printed for its own final weights, here made the longer run's best."""
    import torch

    from minigpt.core.checkpoint import model_state_dict
    from minigpt.training import run_end

    main(tiny_run_args(corpus, data_root, tmp_path / "short", steps=10))
    short = re.search(r"^full val loss ([\d.]+) over all", capsys.readouterr().out, re.M)[1]
    earlier = tmp_path / "short" / "checkpoints" / "last.ckpt"
    monkeypatch.setattr(run_end, "best_checkpoint", lambda trainer, last: (earlier, 10, 0.0))
    trainer = main(tiny_run_args(corpus, data_root, tmp_path / "long", steps=20))
    out = capsys.readouterr().out
    final = re.search(r"^full val loss ([\d.]+) over all", out, re.M)[1]
    assert re.search(rf"^full val loss of last\.ckpt \(step 10\): {short} over all [\d,]+ validation tokens", out, re.M)
    assert final != short and f"{trainer.callback_metrics['full_val_loss'].item():.4f}" == final
    saved = model_state_dict(read_checkpoint(tmp_path / "long" / "checkpoints" / "last.ckpt"))
    assert all(torch.equal(v, saved[k]) for k, v in trainer.lightning_module.model.state_dict().items())


def test_a_run_that_ends_at_its_best_evaluates_the_full_split_once(tiny_run_args, corpus, data_root, tmp_path, capsys):
    """Its last validation is its best (the letters run above is the other case): one full-split line."""
    trainer = main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=20, trainer__val_check_interval=20))
    out = capsys.readouterr().out
    assert re.search(r"^best val loss [\d.]+ at step 20;", out, re.M) and trainer.global_step == 20
    assert len(re.findall(r"^full val loss", out, re.M)) == 1


def logged(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every logged point of train_loss and val_loss, over all of the run's event files, as (step, value)."""
    points: dict[str, list[tuple[int, float]]] = {"train_loss": [], "val_loss": []}
    for events in sorted(run.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0}).Reload()
        for tag, found in points.items():
            found += [(e.step, round(e.value, 5)) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []
    return {tag: sorted(found) for tag, found in points.items()}


@pytest.mark.parametrize("step", [7, 10])  # between validations, and at one (val_check_interval 10)
def test_a_run_stopped_by_sigterm_resumes_with_the_logs_of_an_uninterrupted_run(
    tiny_run_args, corpus, data_root, tmp_path, monkeypatch, step
):
    """SignalStop raised its SIGTERMException after Lightning had counted the next batch as begun: the resumed run
    counted the stop's step twice, every later point of its logs sat a step late and its validations ran a batch
    early (at other weights than the uninterrupted run's)."""
    from minigpt.cli import train as train_cli

    def argv(out):
        return tiny_run_args(corpus, data_root, tmp_path / out, steps=25, trainer__log_every_n_steps=1)

    main(argv("straight"))
    real = train_cli.run_callbacks
    monkeypatch.setattr(train_cli, "run_callbacks", lambda *a, **k: real(*a, **k) + [Signal(step, signal.SIGTERM)])
    with pytest.raises(SystemExit) as stopped:
        main(argv("resumed"))
    assert stopped.value.code == 128 + signal.SIGTERM
    assert read_checkpoint(tmp_path / "resumed" / "checkpoints" / "last.ckpt")["global_step"] == step
    monkeypatch.setattr(train_cli, "run_callbacks", real)
    main(argv("resumed") + ["--resume", "true"])
    straight, resumed = logged(tmp_path / "straight"), logged(tmp_path / "resumed")
    assert resumed["train_loss"] == straight["train_loss"]
    assert resumed["val_loss"] == straight["val_loss"]


class CutWrites:
    """A file whose first write presses Ctrl-C: the KeyboardInterrupt lands inside torch.save's zip writer."""

    def __init__(self, f) -> None:
        self.f, self.pressed = f, False

    def write(self, data) -> int:
        if not self.pressed:
            self.pressed = True
            os.kill(os.getpid(), signal.SIGINT)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def test_a_second_ctrl_c_during_the_final_save_stops_at_once_in_one_line(
    tiny_run_args, corpus, data_root, tmp_path, capsys, monkeypatch
):
    """The state of a Ctrl-C stop off the validation grid is saved after `fit` returns: a second Ctrl-C there
    escaped as the RuntimeError torch.save raises when its write is cut short, with its traceback, instead of the
    second Ctrl-C's line; the earlier last.ckpt stays whole."""
    import torch

    from minigpt.cli import train as train_cli
    from minigpt.cli.errors import run_cli

    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        cut = "last.ckpt" in str(getattr(f, "name", ""))  # a save of last.ckpt (at step 13: the final one)
        return real_save(obj, CutWrites(f) if cut and obj["global_step"] == 13 else f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    real = train_cli.run_callbacks
    monkeypatch.setattr(train_cli, "run_callbacks", lambda *a, **k: real(*a, **k) + [CtrlC(step=13, times=1)])
    run = tmp_path / "run"
    last = run / "checkpoints" / "last.ckpt"
    with pytest.raises(SystemExit) as stopped:
        run_cli(lambda: main(tiny_run_args(corpus, data_root, run, steps=50)))
    err = capsys.readouterr().err
    assert stopped.value.code == 130 and "Traceback" not in err and "error" not in err, err
    assert err.strip().splitlines()[-1] == f"stopped at once by a second Ctrl-C; continue from {last} with --resume"
    assert read_checkpoint(last)["global_step"] == 10  # checkpoint_every's: whole
    assert not {".train.lock", ".train.pid"} & {p.name for p in run.iterdir()}
    assert not [p.name for p in last.parent.iterdir() if p.name.startswith(".")]  # no half-written file
