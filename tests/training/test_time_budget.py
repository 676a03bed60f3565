"""A time-budgeted run's learning-rate schedule (issue 46): the decay runs from warmup's end to the end of the budget
in training time, so it ends at the budget on a fast machine, a slow one and one that slows down mid-run; a resumed
run continues it; runs without a time budget keep their step schedule.  Every clock here is fake (a step takes the
seconds a test says), so no test depends on this machine's speed."""

from __future__ import annotations

import io
from collections.abc import Callable
from contextlib import redirect_stdout
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback, Timer

from minigpt.cli import train as train_cli
from minigpt.core.checkpoint import read_checkpoint
from minigpt.core.errors import ConfigError
from minigpt.training.optim import LRSchedule, OptimConfig, build_scheduler, lr_multiplier, trainer_schedule

WSD = OptimConfig(learning_rate=1.0, warmup_steps=10, lr_schedule="wsd", min_lr_ratio=0.0, cooldown_fraction=0.4)


def wsd_by_time(elapsed: float, warmup_end: float, budget: float, cooldown: float = 0.4) -> float:
    """The definition: the peak until (1 - cooldown) of the time after warmup, then linearly to 0 at the budget."""
    progress = min(1.0, (elapsed - warmup_end) / (budget - warmup_end))
    return min(1.0, (1.0 - progress) / cooldown)


def run_on_clock(
    cfg: OptimConfig,
    seconds_per_step: Callable[[int], float],
    budget: float,
    start: dict | None = None,
    stop_at: float | None = None,
) -> tuple[list[tuple[int, float, float]], dict]:
    """Optimizer steps as Lightning takes them under max_time: the step, then the scheduler's step, then the Timer's
    check.  Returns (step, training seconds at its start, its LR) per step and the state at the end.
    start: a saved {"elapsed", "step", "scheduler", "optimizer"} to resume from; stop_at: interrupt the run there."""
    clock = {"now": 0.0 if start is None else start["elapsed"]}
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=cfg.learning_rate)
    sched = build_scheduler(opt, cfg, None, lambda: (clock["now"], budget))
    step = 0
    if start is not None:
        opt.load_state_dict(start["optimizer"])
        sched.load_state_dict(start["scheduler"])
        step = start["step"]
    steps = []
    while clock["now"] < (budget if stop_at is None else stop_at):
        steps.append((step, clock["now"], opt.param_groups[0]["lr"]))
        clock["now"] += seconds_per_step(step)
        opt.step()
        sched.step()
        step += 1
    final = {"elapsed": clock["now"], "step": step, "lr": opt.param_groups[0]["lr"]}
    return steps, {**final, "scheduler": sched.state_dict(), "optimizer": opt.state_dict()}


@pytest.mark.parametrize("seconds_per_step", [0.125, 0.15625])  # a machine and one 25% slower
def test_the_decay_follows_the_time_budget_and_ends_at_it(seconds_per_step):
    steps, end = run_on_clock(WSD, lambda step: seconds_per_step, budget=10.0)
    assert len(steps) == 10.0 / seconds_per_step  # the slower machine takes fewer steps (80, 64) ...
    warmup_end = 10 * seconds_per_step
    assert [lr for _, _, lr in steps[:10]] == pytest.approx([(s + 1) / 10 for s in range(10)])
    for step, elapsed, lr in steps[10:]:
        assert lr == pytest.approx(wsd_by_time(elapsed, warmup_end, 10.0)), step
    # ... and both hold the peak until 60% of the time after warmup, then cool down to 0 as the budget ends
    cooldown_start = warmup_end + 0.6 * (10.0 - warmup_end)
    assert all(lr == 1.0 for _, t, lr in steps[10:] if t <= cooldown_start)
    assert all(lr < 1.0 for _, t, lr in steps if t > cooldown_start + 1e-9)
    assert steps[-1][2] <= (seconds_per_step + 1e-9) / (0.4 * (10.0 - warmup_end))  # the last step: one step's worth
    assert end["lr"] == 0.0  # the budget is spent: the decay is at its end


def test_a_slow_spell_slows_the_decay_and_the_run_still_ends_cooled_down():
    """3x slower for 1.5 s in the middle of the cooldown: the LR never rises, it is what a steady run has at the
    same time, and it reaches 0 at the budget (fewer steps, the same schedule in time)."""
    steady, _ = run_on_clock(WSD, lambda step: 0.125, budget=10.0)
    spell, end = run_on_clock(WSD, lambda step: 0.375 if 60 <= step < 64 else 0.125, budget=10.0)
    lrs = [lr for _, _, lr in spell[10:]]
    assert all(b <= a for a, b in zip(lrs, lrs[1:]))
    steady_at = {round(t, 6): lr for _, t, lr in steady}
    common = [(t, lr) for _, t, lr in spell if round(t, 6) in steady_at]
    assert len(common) == len(spell) == 72
    assert all(lr == pytest.approx(steady_at[round(t, 6)]) for t, lr in common)
    assert len(spell) < len(steady) and end["lr"] == 0.0


def test_a_resumed_run_continues_the_schedule_where_it_stopped(tmp_path):
    """Interrupted at 5.25 s and resumed from the saved state (through a weights_only file, as a checkpoint is
    read), the schedule gives every remaining step the LR of the run that was never stopped.  Warmup ran at half
    speed, so warmup's end must come from the state: the average speed would put it at 1.64 s, not 2.5 s."""

    def seconds(step: int) -> float:
        return 0.25 if step < 10 else 0.125

    whole, _ = run_on_clock(WSD, seconds, budget=10.0)
    first, saved = run_on_clock(WSD, seconds, budget=10.0, stop_at=5.25)
    assert saved["step"] == 32 and saved["scheduler"]["lr_lambdas"][0] == {"warmup_end_s": 2.5}
    torch.save(saved, tmp_path / "state.pt")
    rest, _ = run_on_clock(WSD, seconds, 10.0, start=torch.load(tmp_path / "state.pt", weights_only=True))
    assert [s for s, _, _ in first + rest] == [s for s, _, _ in whole]
    assert [lr for _, _, lr in first + rest] == pytest.approx([lr for _, _, lr in whole])


def test_a_checkpoint_without_the_warmup_time_estimates_it_from_the_average_speed():
    """A checkpoint saved before the schedule kept warmup's end (a plain function's LambdaLR state: None) resumes
    with warmup's end at the run's average speed: exact for a steady run."""
    whole, _ = run_on_clock(WSD, lambda step: 0.125, budget=10.0)
    _, saved = run_on_clock(WSD, lambda step: 0.125, budget=10.0, stop_at=4.0)
    saved["scheduler"]["lr_lambdas"] = [None]
    rest, _ = run_on_clock(WSD, lambda step: 0.125, 10.0, start=saved)
    assert [lr for _, _, lr in rest] == pytest.approx([lr for _, _, lr in whole[32:]])


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_without_a_time_budget_the_schedule_is_the_step_schedule(schedule):
    cfg = OptimConfig(warmup_steps=10, lr_schedule=schedule, min_lr_ratio=0.1)
    for clock in (None, lambda: None):  # no clock, or a Timer without max_time
        for decay_end in (None, 110):
            lr_lambda = LRSchedule(cfg, decay_end, clock)
            assert [lr_lambda(s) for s in range(200)] == [lr_multiplier(s, cfg, decay_end) for s in range(200)]


class FakeTimer(Timer):
    """Lightning's Timer (the one that stops a run under max_time) on a fake clock: training batch i takes
    seconds_per_step(i) seconds.  Its elapsed time is saved and restored with the checkpoint, as Timer's is."""

    def __init__(self, budget: float, seconds_per_step: Callable[[int], float]) -> None:
        super().__init__(duration=timedelta(seconds=budget), interval="step")
        self.now, self.seconds_per_step = 0.0, seconds_per_step

    def time_elapsed(self, stage: str = "train") -> float:
        return self.now if stage == "train" else 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.now += self.seconds_per_step(trainer.global_step)

    def load_state_dict(self, state_dict: dict) -> None:
        self.now = state_dict["time_elapsed"]["train"]


def test_decay_steps_max_steps_and_the_time_budget():
    """decay_steps fixes the decay in steps (the clock is not read); else max_steps or the time budget, whichever
    end is nearer."""
    timer = FakeTimer(10.0, lambda step: 0.1)
    trainer = SimpleNamespace(max_steps=50, callbacks=[timer])
    assert trainer_schedule(trainer, OptimConfig(decay_steps=180)) == (180, None)
    decay_end, clock = trainer_schedule(trainer, WSD)
    assert decay_end == 50
    timer.now = 2.5
    assert clock() == (2.5, 10.0)
    lr_lambda = LRSchedule(WSD, decay_end, clock)
    timer.now = 1.0
    assert lr_lambda(10) == 1.0  # warmup's end, at 1 s
    timer.now = 9.1  # 90% of the time after warmup, 75% of the steps: the time budget is nearer its end
    assert lr_lambda(40) == pytest.approx(0.25)
    timer.now = 2.0  # a fast machine: max_steps is nearer its end
    assert lr_lambda(40) == pytest.approx(lr_multiplier(40, WSD, 50))
    assert trainer_schedule(SimpleNamespace(max_steps=-1, max_epochs=-1, callbacks=[Timer()]), WSD)[1]() is None
    # a run bounded by max_epochs: the decay ends at Lightning's count of its steps (it held the peak before)
    epochs = SimpleNamespace(max_steps=-1, max_epochs=2, estimated_stepping_batches=120, callbacks=[Timer()])
    assert trainer_schedule(epochs, WSD)[0] == 120
    endless = SimpleNamespace(max_steps=-1, max_epochs=-1, estimated_stepping_batches=float("inf"), callbacks=[])
    assert trainer_schedule(endless, WSD)[0] is None
    with pytest.raises(ConfigError, match=r"^optim.decay_steps: 10 is not past warmup_steps=20, so nothing would"):
        OptimConfig(warmup_steps=20, decay_steps=10)


class LRRecorder(Callback):
    """(step, fake training seconds, LR of the next step) after each optimizer step, and a stop at stop_at."""

    def __init__(self, timer: FakeTimer, stop_at: int | None = None) -> None:
        self.timer, self.stop_at, self.seen = timer, stop_at, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen.append((trainer.global_step, self.timer.now, trainer.optimizers[0].param_groups[0]["lr"]))
        if trainer.global_step == self.stop_at:
            trainer.should_stop = True


@pytest.fixture(scope="module")
def fake_clock_runs(tiny_run_args, corpus, data_root, tmp_path_factory):
    """train.py under a fake 10 s budget, its Timer swapped for a FakeTimer: a fast machine (0.25 s a step), one
    30% slower, and the fast one stopped at step 20 and resumed."""
    tmp = tmp_path_factory.mktemp("time_budget")
    real_callbacks = train_cli.run_callbacks
    runs = {}

    def train(name: str, seconds: float, stop_at: int | None = None, resume: bool = False):
        timer = FakeTimer(10.0, lambda step: seconds)
        recorder = LRRecorder(timer, stop_at)

        def callbacks(*args, **kwargs):
            return [c for c in real_callbacks(*args, **kwargs) if not isinstance(c, Timer)] + [timer, recorder]

        args = tiny_run_args(
            corpus,
            data_root,
            tmp / name,
            steps=-1,
            optim__lr_schedule="wsd",
            optim__min_lr_ratio=0.0,
            optim__cooldown_fraction=0.4,
            sample_tokens=0,
            eval_full="false",
        )
        with pytest.MonkeyPatch.context() as mp, redirect_stdout(io.StringIO()):
            mp.setattr(train_cli, "run_callbacks", callbacks)
            trainer = train_cli.main(args + (["--resume", "true"] if resume else []))
        return trainer, recorder.seen

    runs["fast"] = train("fast", 0.25)
    runs["slow"] = train("slow", 0.325)
    runs["stopped"] = train("resumed", 0.25, stop_at=20)
    runs["resumed"] = train("resumed", 0.25, resume=True)
    return tmp, runs


def test_train_py_ends_its_decay_at_the_budget_on_either_machine(fake_clock_runs):
    _, runs = fake_clock_runs
    peak, warmup = 0.01, 5  # tiny_run_args'
    for name, seconds, steps in (("fast", 0.25, 40), ("slow", 0.325, 31)):
        trainer, seen = runs[name]
        assert trainer.global_step == steps, name  # stopped by the (fake) time budget
        warmup_end = next(t for s, t, _ in seen if s == warmup)
        assert warmup_end == pytest.approx(warmup * seconds)
        for step, elapsed, lr in seen[warmup:]:
            assert lr == pytest.approx(peak * wsd_by_time(elapsed, warmup_end, 10.0)), (name, step)
        assert seen[-1][2] == 0.0  # cooled down as the budget ends
        assert seen[-2][2] <= peak * seconds / (0.4 * (10.0 - warmup_end)) + 1e-12  # the last step's LR


def test_train_py_resumed_on_the_same_clock_is_the_run_never_stopped(fake_clock_runs):
    tmp, runs = fake_clock_runs
    (_, whole), (_, first), (_, rest) = runs["fast"], runs["stopped"], runs["resumed"]
    assert [s for s, _, _ in first] == list(range(1, 21))
    assert first + rest == pytest.approx(whole)  # every step's time and LR
    ckpt = read_checkpoint(tmp / "resumed" / "checkpoints" / "last.ckpt")
    assert ckpt["lr_schedulers"][0]["lr_lambdas"][0] == {"warmup_end_s": pytest.approx(1.25)}
    whole_weights = read_checkpoint(tmp / "fast" / "checkpoints" / "last.ckpt")["state_dict"]
    assert all(torch.equal(ckpt["state_dict"][k], v) for k, v in whole_weights.items())
