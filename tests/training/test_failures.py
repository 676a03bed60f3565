"""Bad input gives one line and exit 2; kills leave loadable checkpoints; resume is exact; NaN stops cleanly."""

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]  # the repository root
from minigpt.cli.errors import run_cli
from minigpt.cli.train import main
from minigpt.core.checkpoint import model_state_dict, read_checkpoint


def run_train(args, capsys) -> tuple[int, str]:
    """train.py's entry point in-process: (exit code, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: main(args))
    err = capsys.readouterr().err.strip()
    return exit_info.value.code, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture
def short_corpus(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("just a few characters\n")
    return path


def test_empty_and_too_short_and_binary_corpora(tiny_run_args, tmp_path, data_root, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, err = run_train(tiny_run_args(empty, data_root, tmp_path / "run"), capsys)
    assert_one_line_error(code, err, "empty")

    short = tmp_path / "short.txt"
    short.write_text("only a few characters here, far fewer than one window\n")
    code, err = run_train(tiny_run_args(short, data_root, tmp_path / "run", model__block_size=64), capsys)
    assert_one_line_error(code, err, "fewer than one window of block_size + 1 = 65")

    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    code, err = run_train(tiny_run_args(binary, data_root, tmp_path / "run"), capsys)
    assert_one_line_error(code, err, "byte")


@pytest.mark.parametrize(
    "flags,fragments",
    [
        (["--trainer.gradient_clip_val", "-1"], ["trainer.gradient_clip_val must be >= 0", "got -1"]),
        (["--init_from", ""], ["init_from is empty", "hf:ORG/NAME"]),
        (["--init_from", "  "], ["init_from is empty"]),
        (["--trainer.check_val_every_n_epoch", "0"], ["trainer.check_val_every_n_epoch must be >= 1 or null"]),  # was
        (["--trainer.min_steps", "-3"], ["trainer.min_steps must be >= 0"]),  # ZeroDivisionError
        (["--trainer.num_sanity_val_steps", "-2"], ["trainer.num_sanity_val_steps must be >= -1"]),
        (["--trainer.max_steps", "0"], ["trainer.max_steps=0 trains nothing"]),  # each of these three exited 0
        (["--trainer.max_epochs", "0"], ["trainer.max_epochs=0 trains nothing"]),
        (["--trainer.limit_train_batches", "0"], ["trainer.limit_train_batches=0 trains nothing"]),
    ],
)
def test_values_that_would_train_silently_wrong_are_refused(
    tiny_run_args, corpus, data_root, tmp_path, capsys, flags, fragments
):
    """A negative clip value would clip to gradient ascent; an empty init_from would silently train from scratch;
    a zero check_val_every_n_epoch divided by zero; a zero length or limit ended the run before its first step with
    exit code 0, as if it had trained."""
    code, err = run_train(tiny_run_args(corpus, data_root, tmp_path / "run") + flags, capsys)
    assert_one_line_error(code, err, *fragments)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_unwritable_out_dir(tiny_run_args, corpus, data_root, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code, err = run_train(tiny_run_args(corpus, data_root, blocker / "run"), capsys)
    assert_one_line_error(code, err, "cannot write to out_dir", "choose a writable --out_dir")


def test_a_model_config_mistake_is_refused_before_the_data_is_prepared(tiny_run_args, corpus, tmp_path, capsys):
    """Not after minutes of preparing a large corpus: the model's settings are checked as they are parsed."""
    argv = tiny_run_args(corpus, tmp_path / "data", tmp_path / "run", model__n_embd=30, model__n_head=4)
    code, err = run_train(argv, capsys)
    assert_one_line_error(code, err, "model.n_embd: 30 is not divisible by n_head=4")
    assert not (tmp_path / "data").exists()


def test_resume_mistakes_leave_the_run_untouched(tiny_run_args, corpus, data_root, tmp_path, capsys):
    code, err = run_train(tiny_run_args(corpus, data_root, tmp_path / "none") + ["--resume"], capsys)
    assert_one_line_error(code, err, "--resume: no checkpoint at")
    assert not (tmp_path / "none").exists()  # no empty run directory left behind

    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=5))
    capsys.readouterr()
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    code, err = run_train(
        tiny_run_args(corpus, data_root, tmp_path / "run", model__n_layer=2) + ["--resume", "true"], capsys
    )
    assert_one_line_error(code, err, "n_layer=1 (this run's config gives 2)")
    assert last.read_bytes() == before
    # what the optimizer's saved state carries: a resume kept the old learning rate while config.yaml said the new
    # one, and another optimizer was Lightning's traceback
    for flag, value, said in (
        ("--optim.learning_rate", "0.02", "optim.learning_rate=0.01 (this run's config gives 0.02)"),
        ("--optim.optimizer", "muon", "optim.optimizer='adamw' (this run's config gives 'muon')"),
    ):
        code, err = run_train(
            tiny_run_args(corpus, data_root, tmp_path / "run", steps=8) + [flag, value, "--resume"], capsys
        )
        assert_one_line_error(code, err, said, "--init_from")
    assert last.read_bytes() == before
    for steps in (5, 3):  # a finished run resumed as it was, or to fewer steps: refused, not rewritten
        code, err = run_train(tiny_run_args(corpus, data_root, tmp_path / "run", steps=steps) + ["--resume"], capsys)
        assert_one_line_error(
            code, err, f"is at step 5, so --trainer.max_steps {steps} trains nothing; raise --trainer.max_steps above 5"
        )
    code, err = run_train(tiny_run_args(corpus, data_root, tmp_path / "run") + ["--resume", "--overwrite"], capsys)
    assert_one_line_error(code, err, "--resume continues the run in out_dir and --overwrite starts it over")
    assert last.read_bytes() == before
    # other data settings are the user's to change, but said: they redraw the windows or the validation set
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=7, data__batch_size=4, seed=7) + ["--resume"])
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: --resume")]
    assert notes == [
        "note: --resume with seed 7 (the run had 1337): the training windows and the validation set are not the "
        "run's from here on; best.ckpt and early stopping compare val losses across the change",
        "note: --resume with data.batch_size 4 (the run had 8): the validation set is not the run's from here on; "
        "best.ckpt and early stopping compare val losses across the change",
    ]
    # and the processes it runs on (each reads its own batch): as a run of two DDP processes resumed on one
    from minigpt.core.checkpoint import SECTION, save_file

    ckpt = read_checkpoint(last)
    assert ckpt[SECTION]["world_size"] == 1
    ckpt[SECTION]["world_size"] = 2
    save_file(ckpt, last)
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=8, data__batch_size=4, seed=7) + ["--resume"])
    assert (
        capsys.readouterr().err.count(
            "note: --resume on 1 process(es) (the run had 2): each optimizer step now reads 1 batch(es) of "
            "data.batch_size where it read 2"
        )
        == 1
    )


def test_non_finite_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(
    tiny_run_args, corpus, data_root, tmp_path, capsys, monkeypatch
):
    from minigpt.training import lightning_module

    real_step = lightning_module.GPTLightningModule.training_step

    def step(self, batch, batch_idx):
        if self.global_step == 13:  # as if the weights had blown up
            with torch.no_grad():
                self.model.lm_head.weight.fill_(float("nan"))
        return real_step(self, batch, batch_idx)

    monkeypatch.setattr(lightning_module.GPTLightningModule, "training_step", step)
    code, err = run_train(tiny_run_args(corpus, data_root, tmp_path / "run", steps=30), capsys)
    assert_one_line_error(code, err, "the training loss became nan at step 13")
    ckpt = read_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 10
    assert all(torch.isfinite(v).all() for v in model_state_dict(ckpt).values())


def test_on_a_gpu_a_non_finite_loss_is_read_late_but_named_at_its_step_and_never_saved(
    tiny_run_args, corpus, data_root, tmp_path, capsys, monkeypatch
):
    # on CUDA the loss is not read on the host every step (it would stall the GPU's queue): the first bad step is
    # kept on the device and read at the next logging step or before any checkpoint is written
    from minigpt.training import lightning_module

    real_step = lightning_module.GPTLightningModule.training_step

    def step(self, batch, batch_idx):
        if self.global_step == 13:
            with torch.no_grad():
                self.model.lm_head.weight.fill_(float("nan"))
        return real_step(self, batch, batch_idx)

    monkeypatch.setattr(lightning_module.GPTLightningModule, "training_step", step)
    monkeypatch.setattr(lightning_module, "host_read_is_free", lambda device: False)
    code, err = run_train(tiny_run_args(corpus, data_root, tmp_path / "run", steps=30), capsys)
    assert_one_line_error(code, err, "the training loss became NaN or infinite at step 13")
    ckpt = read_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 10
    assert all(torch.isfinite(v).all() for v in model_state_dict(ckpt).values())


def test_bad_input_through_the_real_command():
    result = subprocess.run(
        [sys.executable, "train.py", "--model.attention", "flash3", "--data.source", "/nope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_matches_an_uninterrupted_run(tiny_run_args, make_corpus, tmp_path):
    """Kill a real training process repeatedly; every kill leaves a loadable last.ckpt, and resuming to the end
    gives bitwise the weights of a run that was never interrupted (CPU, float32, with dropout)."""
    corpus = make_corpus(tmp_path / "corpus.txt")
    steps = 60

    def args(out):
        return tiny_run_args(
            corpus,
            tmp_path / "data",
            tmp_path / out,
            steps=steps,
            checkpoint_every=3,
            model__dropout=0.1,
            trainer__val_check_interval=20,
            optim__decay_steps=steps,
        )

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "train.py", *args("straight")], cwd=REPO, check=True, env=env, capture_output=True, timeout=300
    )
    rng = random.Random(0)
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    kills = 0
    for _ in range(3):
        extra = ["--resume", "true"] if last.exists() else ["--overwrite", "true"]
        seen = last.stat().st_mtime_ns if last.exists() else None
        proc = subprocess.Popen(
            [sys.executable, "train.py", *args("killed"), *extra],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # kill within 50 ms of this process's n-th save, n random in 1..4 (3 steps each: by the third kill, 36 of the
        # 60 steps at most where the polls see every save); not at a random time, which a fast machine outran
        saves, deadline = rng.randint(1, 4), time.time() + 120
        while saves and time.time() < deadline and proc.poll() is None:
            mtime = last.stat().st_mtime_ns if last.exists() else None
            if mtime != seen:
                saves, seen = saves - 1, mtime
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.05))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        assert read_checkpoint(last)["global_step"] <= steps  # loadable after every kill
    assert kills >= 2, "the runs ended before they could be killed; make them longer"
    subprocess.run(
        [sys.executable, "train.py", *args("killed"), "--resume", "true"],
        cwd=REPO,
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    a = read_checkpoint(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    b = read_checkpoint(last)
    assert a["global_step"] == b["global_step"] == steps
    wa, wb = model_state_dict(a), model_state_dict(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_second_train_py_on_the_same_run_directory_is_refused(tiny_run_args, corpus, data_root, tmp_path, capsys):
    from minigpt.training.run_dir import lock_run_dir

    (tmp_path / "run").mkdir()
    held = lock_run_dir(tmp_path / "run")  # as another train.py would hold it
    try:
        code, err = run_train(tiny_run_args(corpus, data_root, tmp_path / "run", steps=5), capsys)
        assert_one_line_error(code, err, "is in use by another train.py (pid", "choose another --out_dir")
    finally:
        held.close()
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=5))  # free again once the holder is gone


def test_overwrite_keeps_the_old_run_until_the_new_one_has_a_checkpoint(
    tiny_run_args, corpus, data_root, tmp_path, capsys, monkeypatch
):
    from minigpt.training import lightning_module

    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=5))
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    before, config_before = last.read_bytes(), (tmp_path / "run" / "config.yaml").read_text()
    logs_before = sorted((tmp_path / "run").glob("events.out.tfevents.*"))
    assert len(logs_before) == 1
    own = tmp_path / "run" / "checkpoints" / "my-notes.txt"  # a user's file: --overwrite never touches it
    own.write_text("mine")

    def broken_step(self, batch, batch_idx):
        raise RuntimeError("a bug in the new run")

    with monkeypatch.context() as m:
        m.setattr(lightning_module.GPTLightningModule, "training_step", broken_step)
        with pytest.raises(RuntimeError, match="a bug in the new run"):
            main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=5) + ["--overwrite"])
    assert last.read_bytes() == before, "the old run's checkpoints must be put back"
    assert (tmp_path / "run" / "config.yaml").read_text() == config_before, "and its config"
    assert not list((tmp_path / "run").glob(".checkpoints*")), "nothing left aside"
    assert sorted((tmp_path / "run").glob("events.out.tfevents.*")) == logs_before, "and its logs alone"
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=7) + ["--overwrite"])
    assert read_checkpoint(last)["global_step"] == 7
    assert not list((tmp_path / "run").glob(".checkpoints*"))
    # TensorBoard shows the new run alone: the old run's curves went with its checkpoints
    (log,) = (tmp_path / "run").glob("events.out.tfevents.*")
    assert log not in logs_before
    assert own.read_text() == "mine"


def test_files_a_killed_overwrite_set_aside_are_put_back_by_the_next_run(tiny_run_args, corpus, data_root, tmp_path):
    """SIGKILL between --overwrite setting the old run aside and the new run's first checkpoint: the next train.py
    finds the old run where it was, so --resume continues it."""
    run = tmp_path / "run"
    main(tiny_run_args(corpus, data_root, run, steps=5))
    killed = subprocess.Popen([sys.executable, "-c", "pass"])  # a process id that is no longer alive
    killed.wait()
    aside = run / f".checkpoints.old-{killed.pid}"
    (aside / "checkpoints").mkdir(parents=True)
    for name in ("checkpoints/last.ckpt", "checkpoints/best.ckpt", "config.yaml"):
        if (run / name).is_file():
            (run / name).rename(aside / name)  # as a killed --overwrite leaves them
    (run / "config.yaml").write_text("the killed run's config")
    trainer = main(tiny_run_args(corpus, data_root, run, steps=8) + ["--resume", "true"])
    assert trainer.global_step == 8 and not aside.exists()
    assert read_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == 8


def test_sigint_and_sigterm_save_a_checkpoint_at_the_step_and_exit_non_zero(tiny_run_args, make_corpus, tmp_path):
    """Both signals end training after the current step: one line, the step's checkpoint, a non-zero exit, and no
    lock or pid file left in the run folder.  Ctrl-C (SIGINT) is a stop the user asked for, not an error: its line
    has no `error:` (issue 48)."""
    corpus = make_corpus(tmp_path / "corpus.txt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        args = tiny_run_args(
            corpus,
            tmp_path / f"data-{sig.name}",
            tmp_path / sig.name,
            steps=100000,
            checkpoint_every=3,
            trainer__val_check_interval=2,
            eval_full=False,
        )
        procs[sig] = subprocess.Popen(
            [sys.executable, "train.py", *args],
            cwd=REPO,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    for sig, proc in procs.items():
        last = tmp_path / sig.name / "checkpoints" / "last.ckpt"
        deadline = time.time() + 120
        while not last.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()
        start = time.time()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        assert time.time() - start < 30
        assert proc.returncode == 128 + sig, err
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        if sig == signal.SIGINT:
            stops = [line for line in err.splitlines() if line.startswith("stopped by SIGINT (Ctrl-C) at step ")]
            assert not errors and len(stops) == 1, err
        else:
            stops = errors
            assert len(errors) == 1 and f"stopped by {sig.name} at step" in errors[0], err
        assert "Traceback" not in err
        step = int(stops[0].split(" at step ")[1].split(";")[0])
        assert read_checkpoint(last)["global_step"] == step
        # the val loss printed is the last validation's, named by its step: SIGINT validates the step it stops at,
        # SIGTERM does not (its last validation, every 2 steps, was one or two steps before)
        estimate = next(line for line in out.splitlines() if line.startswith("estimated val loss"))
        if sig == signal.SIGINT or "(stopped at" not in estimate:  # (a SIGTERM right after a validation)
            assert f"after {step} steps;" in estimate, out
        else:
            validated = int(re.search(rf"at step (\d+) \(stopped at {step}\);", estimate)[1])
            assert validated % 2 == 0 and step - 2 <= validated < step, out
        assert f"saved {last};" in stops[0] and "continue the run with --resume" in stops[0]
        assert not {".train.lock", ".train.pid"} & {p.name for p in (tmp_path / sig.name).iterdir()}


def test_compile_without_a_cpp_compiler_trains_eagerly_with_one_warning(
    tiny_run_args, corpus, data_root, tmp_path, monkeypatch
):
    from minigpt.core import compiled as compiled_module
    from minigpt.training.callbacks import CompileModel

    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ here
    monkeypatch.delenv("CXX", raising=False)
    compiled_module.compiler_available.cache_clear()  # found or not, once per process: found again here
    try:
        with pytest.warns(
            UserWarning,
            match=r"torch.compile's C\+\+ compiler 'g\+\+' was not found .*apt-get install g\+\+.*training without",
        ):
            trainer = main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=3, compile="true"))
    finally:
        compiled_module.compiler_available.cache_clear()
    compiled = next(c for c in trainer.callbacks if isinstance(c, CompileModel))
    assert trainer.global_step == 3 and not compiled.enabled and compiled.seconds is None
    model = trainer.lightning_module.model
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in [model, *model.transformer.h])


def test_a_full_disk_while_saving_a_checkpoint_is_one_line_and_keeps_the_previous_one(
    tiny_run_args, corpus, data_root, tmp_path, capsys, monkeypatch
):
    import errno

    from minigpt.core import checkpoint

    real_save, saves = torch.save, []

    def save(obj, f, *args, **kwargs):
        saves.append(1)
        if len(saves) > 1:  # the first checkpoint (step 10) fits; the disk is full from then on
            f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", save)
    code, err = run_train(tiny_run_args(corpus, data_root, tmp_path / "run", steps=30), capsys)
    assert_one_line_error(
        code, err, "cannot write checkpoint", "No space left on device", "previous checkpoint is kept", "--resume"
    )
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    ckpts = tmp_path / "run" / "checkpoints"
    assert read_checkpoint(ckpts / "last.ckpt")["global_step"] == 10
    assert sorted(p.name for p in ckpts.iterdir() if "tmp" in p.name) == []  # no half-written file left behind


def test_a_full_disk_inside_torch_save_is_one_line_not_torchs_runtime_error(tmp_path, monkeypatch):
    """A full disk as torch.save meets it: its zip writer, closing after the failed write, raises a RuntimeError
    ("unexpected pos ...") that hides the OSError; the save is the one CheckpointError line all the same."""
    import errno

    from minigpt.core import fsutil
    from minigpt.core.errors import CheckpointError
    from minigpt.training.checkpoint_io import SafeCheckpointIO

    path = tmp_path / "last.ckpt"
    path.write_bytes(b"the previous checkpoint")

    class FullDisk:  # a file that takes 1000 bytes, then the disk is full
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, b):
            if self.written + len(b) > 1000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.written += len(b)
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(fsutil, "open", lambda *a, **k: FullDisk(open(*a, **k)), raising=False)
    with pytest.raises(CheckpointError, match="cannot write checkpoint .*No space left on device.*previous checkpoint"):
        SafeCheckpointIO().save_checkpoint({"w": torch.zeros(10000)}, path)
    assert path.read_bytes() == b"the previous checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left


def test_a_killed_saves_temporary_checkpoint_is_removed_by_the_next_run(tiny_run_args, corpus, data_root, tmp_path):
    """A SIGKILL while last.ckpt is written leaves .last.ckpt.tmp-PID (up to a checkpoint's size): the next
    train.py on the run directory removes it, as prepared data's leftovers are."""
    run = tmp_path / "run"
    main(tiny_run_args(corpus, data_root, run, steps=5))
    killed = subprocess.Popen([sys.executable, "-c", "pass"])  # a process id that is no longer alive
    killed.wait()
    stale = run / "checkpoints" / f".last.ckpt.tmp-{killed.pid}"
    stale.write_bytes(b"half a checkpoint")
    main(tiny_run_args(corpus, data_root, run, steps=8) + ["--resume", "true"])
    assert not stale.exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.ckpt", "last.ckpt"]


def train_patched(patch: str, args: list[str]) -> subprocess.CompletedProcess:
    """`train.py ARGS` in a fresh process, after `patch` (Python with os, signal, sys and time imported) ran in it."""
    train = "from minigpt.cli.main import run_command\nrun_command('train', sys.argv[1:])\n"
    script = f"import os, signal, sys, time\n{patch}{train}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_sigterm_before_lightning_handles_it_stops_the_run_in_one_line(tiny_run_args, corpus, tmp_path):
    """Lightning handles SIGTERM only once the run is set up: one while the step compiles (on_fit_start) killed
    the process with no line and left the lock files; it stops the run as a SIGTERM in training does."""
    run = tmp_path / "run"
    patch = (
        "from minigpt.training.lightning_module import GPTLightningModule\n"
        "def on_fit_start(self):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "GPTLightningModule.on_fit_start = on_fit_start\n"
    )
    proc = train_patched(patch, tiny_run_args(corpus, tmp_path / "data", run, steps=50))
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "error: stopped by SIGTERM before the first step; nothing saved" in proc.stderr.splitlines(), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not {".train.lock", ".train.pid"} & {p.name for p in run.iterdir()}


def test_a_ctrl_c_while_a_stopped_run_exits_adds_no_traceback(tiny_run_args, corpus, tmp_path):
    """A Ctrl-C stop says its line and exits; an impatient second Ctrl-C landed in the interpreter's exit, as an
    `Exception ignored in atexit callback` traceback of KeyboardInterrupt after the stop's line."""
    patch = (
        "import atexit\n"
        "def press():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.2)\n"
        "atexit.register(press)\n"
        "from minigpt.training.lightning_module import GPTLightningModule\n"
        "def on_fit_start(self):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "GPTLightningModule.on_fit_start = on_fit_start\n"
    )
    proc = train_patched(patch, tiny_run_args(corpus, tmp_path / "data", tmp_path / "run", steps=50))
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert proc.stderr.splitlines()[-1] == "stopped by SIGINT (Ctrl-C) before the first step; nothing saved"
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr


def test_sigterm_during_the_full_validation_is_one_line_and_keeps_the_run(tiny_run_args, corpus, tmp_path):
    """The run is over and saved when its full split is evaluated: a SIGTERM there killed the process unsaid and
    left the lock files."""
    run = tmp_path / "run"
    patch = (
        "from minigpt.training import run_end\n"
        "def full_split_loss(*a):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(60)\n"
        "run_end.full_split_loss = full_split_loss\n"
    )
    proc = train_patched(patch, tiny_run_args(corpus, tmp_path / "data", run, steps=3))
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "error: stopped by SIGTERM during the full validation; the run's checkpoints are saved"
    )
    assert not {".train.lock", ".train.pid"} & {p.name for p in run.iterdir()}
    assert read_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == 3
