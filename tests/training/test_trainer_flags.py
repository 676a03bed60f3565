"""Lightning's own Trainer flags through train.py: each works as Lightning documents it and as minigpt's end lines
say, or is refused in one line (overfit_batches crashed at the first save, limit_val_batches was reported as
val_batches, a val_check_interval longer than an epoch and a spent max_epochs / max_time resume were a traceback or
a run that trained nothing, default_root_dir was ignored, a logger of the user's took config.yaml out of out_dir)."""

from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Trainer

from minigpt.cli.train import main
from minigpt.core.errors import UserError
from minigpt.training import run_dir
from minigpt.training.trainer import MiniGPTTrainer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def short_corpus(make_corpus, tmp_path_factory) -> Path:
    """A corpus whose epoch is a few steps (batch 8 of 32 tokens)."""
    return make_corpus(tmp_path_factory.mktemp("short") / "short.txt", n_lines=40)


def test_overfit_batches_trains_on_its_batches_and_saves(tiny_run_args, corpus, data_root, tmp_path, capsys):
    """Lightning swaps the training sampler for its own: the loader's state_dict read the missing start()."""
    run = tmp_path / "run"
    trainer = main(tiny_run_args(corpus, data_root, run, steps=12) + ["--trainer.overfit_batches", "1"])
    assert trainer.global_step == 12 and (run / "checkpoints" / "last.ckpt").is_file()
    assert "(1 batch of 8) after 12 steps" in capsys.readouterr().out  # overfit_batches limits validation too


@pytest.mark.parametrize("limit,read", [("1", 1), ("0.5", 2)])
def test_the_end_line_counts_the_validation_batches_lightning_read(
    tiny_run_args, corpus, data_root, tmp_path, capsys, limit, read
):
    argv = tiny_run_args(corpus, data_root, tmp_path / "run", steps=5, data__val_batches=4)
    main(argv + ["--trainer.limit_val_batches", limit])
    assert f"({read} batch{'es' * (read != 1)} of 8) after 5 steps" in capsys.readouterr().out


def test_a_val_check_interval_longer_than_an_epoch_is_one_line(tiny_run_args, short_corpus, data_root, tmp_path):
    argv = tiny_run_args(short_corpus, data_root, tmp_path / "run", steps=30, trainer__check_val_every_n_epoch=2)
    with pytest.raises(UserError, match=r"val_check_interval 10 is more than an epoch's \d+ training batches"):
        main(argv)


def test_a_resume_with_its_epochs_spent_is_refused(tiny_run_args, short_corpus, data_root, tmp_path):
    run = tmp_path / "run"
    argv = tiny_run_args(short_corpus, data_root, run, steps=-1, trainer__max_epochs=1, trainer__val_check_interval=3)
    first = main(argv)
    with pytest.raises(UserError, match="has trained 1 epoch.*raise --trainer.max_epochs above 1"):
        main(argv + ["--resume", "true"])
    resumed = main(argv + ["--trainer.max_epochs", "2", "--resume", "true"])
    assert resumed.global_step == 2 * first.global_step


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_max_epochs_run_stopped_inside_an_epoch_resumes_to_its_last_epoch(
    tiny_run_args, short_corpus, data_root, tmp_path, accumulate
):
    """Stopped off the validation grid (a shorter max_steps here; Ctrl-C or max_time alike), the state saved after
    `fit` had the unfinished epoch counted as done: the resume started the next epoch, so the run ended that epoch's
    remainder short of an uninterrupted one (and logged its epoch one ahead).  Stopped at the epoch's last batch,
    the resume trained one batch more in that epoch (with accumulation, an optimizer step of its own)."""
    import torch

    from minigpt.core.checkpoint import model_state_dict, read_checkpoint

    def argv(out, steps):
        run = tmp_path / out
        return tiny_run_args(
            short_corpus,
            data_root,
            run,
            steps=steps,
            trainer__max_epochs=3,
            trainer__accumulate_grad_batches=accumulate,
            optim__lr_schedule="constant",
        )

    straight = main(argv("straight", -1))
    epoch = straight.global_step // 3  # its steps
    assert epoch * accumulate % 10, "the epoch's last batch must be off the validation grid (every 10 batches)"
    for stop in (epoch - 2, epoch):  # inside the first epoch, and at its last batch
        resumed_run = f"resumed-{stop}"
        main(argv(resumed_run, stop))
        assert read_checkpoint(tmp_path / resumed_run / "checkpoints" / "last.ckpt")["epoch"] == 0
        resumed = main(argv(resumed_run, -1) + ["--resume", "true"])
        assert resumed.global_step == straight.global_step
        if stop != epoch:  # (restarted at an epoch's last batch, Lightning's final count has that epoch twice)
            assert resumed.current_epoch == straight.current_epoch
        a, b = (
            model_state_dict(read_checkpoint(tmp_path / r / "checkpoints" / "last.ckpt"))
            for r in ("straight", resumed_run)
        )
        assert all(torch.equal(a[k], b[k]) for k in a), "a resumed run must match an uninterrupted one bitwise"


def test_a_resume_with_its_time_spent_is_refused():
    trainer = Trainer(max_time="00:00:00:05", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    saved = {"callbacks": {"Timer": {"time_elapsed": {"train": 5.2}}}}
    with pytest.raises(UserError, match=r"trained for 5.2s, the whole --trainer.max_time \(5s\)"):
        run_dir.check_budget_left(Path("last.ckpt"), saved, trainer)
    saved["callbacks"]["Timer"]["time_elapsed"]["train"] = 4.0
    run_dir.check_budget_left(Path("last.ckpt"), saved, trainer)  # time left: it resumes


def test_default_root_dir_is_refused_for_out_dir(tiny_run_args, corpus, data_root, tmp_path):
    argv = tiny_run_args(corpus, data_root, tmp_path / "run", steps=3)
    with pytest.raises(UserError, match="give --out_dir DIR instead"):
        main(argv + ["--trainer.default_root_dir", str(tmp_path / "elsewhere")])
    assert not (tmp_path / "elsewhere").exists()


def test_a_logger_of_the_users_leaves_config_yaml_in_out_dir(tiny_run_args, corpus, data_root, tmp_path):
    config = tmp_path / "csv.yaml"
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path / "csv")}}
    config.write_text(yaml.safe_dump({"trainer": {"logger": logger}}))
    run = tmp_path / "run"
    main(["--config", str(config)] + tiny_run_args(corpus, data_root, run, steps=3))
    assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["max_steps"] == 3
    assert list((tmp_path / "csv").rglob("metrics.csv"))


def test_a_learning_rate_monitor_of_the_users_logs_each_rate_once(tiny_run_args, corpus, data_root, tmp_path):
    """train.py adds its own LearningRateMonitor: with the user's beside it every point was logged twice."""
    from support import scalars

    config = tmp_path / "lr.yaml"
    monitor = {
        "class_path": "lightning.pytorch.callbacks.LearningRateMonitor",
        "init_args": {"logging_interval": "step"},
    }
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": [monitor]}}))
    run = tmp_path / "run"
    main(["--config", str(config)] + tiny_run_args(corpus, data_root, run, steps=4, trainer__log_every_n_steps=1))
    rates = [values for tag, values in scalars(run).items() if tag.startswith("lr")]
    assert rates and all(len(values) == 4 for values in rates), rates


def test_stochastic_weight_averaging_is_refused(tiny_run_args, corpus, data_root, tmp_path):
    """SWA swaps the averaged weights in at on_train_end, after the last checkpoint: no checkpoint held them."""
    config = tmp_path / "swa.yaml"
    swa = {"class_path": "lightning.pytorch.callbacks.StochasticWeightAveraging", "init_args": {"swa_lrs": 0.001}}
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": [swa]}}))
    with pytest.raises(UserError, match="StochasticWeightAveraging .* no checkpoint"):
        main(["--config", str(config)] + tiny_run_args(corpus, data_root, tmp_path / "run", steps=3))
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("strategy", ["ddp_spawn", "DDP_Spawn", "DDP_FORK", "ddp_notebook"])
def test_a_spawning_strategy_is_refused_in_any_case(strategy):
    """Lightning reads a strategy's name in any case: DDP_Spawn launched ddp_spawn, which trained, handed the
    launching process the weights alone and ended in an error about a temporary file, with no run saved."""
    with pytest.raises(UserError, match=f"trainer.strategy={strategy} hands back only the weights.*use ddp"):
        MiniGPTTrainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
