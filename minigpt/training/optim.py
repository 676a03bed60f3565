"""Optimizer, parameter groups and learning-rate schedule: what `configure_optimizers` returns, built here (Muon's
update in minigpt.training.muon, the update as a CUDA graph in minigpt.training.step_graph).

The schedule is a multiplier of the peak learning rate: linear warmup, then cosine / linear / constant / wsd
(warmup-stable-decay) down to `min_lr_ratio` at the decay's end.  The decay ends at `decay_steps`, else at the
trainer's `max_steps` (or its `max_epochs`' last step) or at the end of its time budget (`max_time`), whichever comes
first: under a time budget
its progress is training time, so a run ends cooled down however many steps the machine managed.  When no end
is known, the peak is held.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import nn

from minigpt.core.errors import ConfigError, UserError
from minigpt.core.model import GPT
from minigpt.training.muon import MuonWithAdamW
from minigpt.training.step_graph import GraphedAdamW, GraphedMuonWithAdamW

OptimizerName = Literal["adamw", "muon"]
Schedule = Literal["cosine", "linear", "constant", "wsd"]
OPTIMIZERS, SCHEDULES = get_args(OptimizerName), get_args(Schedule)


# settings the optimizer's saved state carries (its parameter groups, each group's initial_lr): a resume would keep
# the checkpoint's values whatever the config said, so a change is refused (check_optim_resumable)
KEPT_BY_THE_STATE = ("optimizer", "learning_rate", "weight_decay", "beta1", "beta2")
KEPT_BY_MUONS_STATE = ("muon_ns_steps",)  # Muon's parameter groups carry ns_steps: kept where Muon trained


def check_optim_resumable(saved: dict[str, Any] | None, optim: OptimConfig, last: Path) -> None:
    """A resume continues with the optimizer settings it was trained with; `saved` is the checkpoint's (None in a
    checkpoint written before they were recorded: nothing to compare)."""
    if saved is None:
        return
    current = asdict(optim)
    kept = KEPT_BY_THE_STATE + (KEPT_BY_MUONS_STATE if saved.get("optimizer") == "muon" else ())
    diff = [
        f"optim.{k}={saved[k]!r} (this run's config gives {current[k]!r})"
        for k in kept
        if k in saved and saved[k] != current[k]
    ]
    if diff:
        raise UserError(
            f"{last} was trained with " + ", ".join(diff) + "; the optimizer's saved state keeps those, so a "
            "resume cannot change them: remove the setting to resume, or train on from this run with "
            f"--init_from {last} in another out_dir"
        )


@dataclass
class OptimConfig:
    """The optimizer and its learning-rate schedule."""

    optimizer: OptimizerName = "adamw"
    """adamw, or muon (Muon for the blocks' matrices, AdamW for embeddings, head and gains)."""
    muon_ns_steps: int = 5
    """muon only: Newton-Schulz iterations per step (torch's default 5; each one costs ~3 small matmuls per matrix)."""
    learning_rate: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """The learning rate where the decay ends, as a fraction of the peak, in [0, 1] (a run of max_steps steps
    ends its decay at step max_steps, one past its last: that step trains a little above it)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices and embeddings only (never biases or norm gains)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    warmup_steps: int = 100
    """Optimizer steps of linear warmup."""
    lr_schedule: Schedule = "cosine"
    """After warmup: cosine, linear, constant, or wsd (hold the peak, then a linear cooldown)."""
    cooldown_fraction: float = 0.2
    """wsd only: the share of the decay (warmup's end to decay's end) spent in the linear cooldown, in (0, 1]."""
    decay_steps: int | None = None
    """Step at which the decay ends; unset = at trainer.max_steps or at the end of max_time, whichever is first."""
    cuda_graph: bool = False
    """On a GPU, replay the optimizer's update as one CUDA graph from the fourth step (a small model's step is mostly
    the host launching the update's kernels). Needs gradients kept in place between steps, as compile_mode
    reduce-overhead and cudagraphs keep them; where they move, or on a CPU, the update runs eagerly."""

    def __post_init__(self) -> None:
        for name, problem, fix in self.problems():
            raise ConfigError(f"optim.{name}: {problem}; {fix}")

    def problems(self) -> Iterator[tuple[str, str, str]]:
        """(field, problem, fix) for each rule this config breaks (a config built in Python is checked here too,
        not only by the parser's Literal types). NaN fails every range below, so it is refused too."""
        for name, choices in (("optimizer", OPTIMIZERS), ("lr_schedule", SCHEDULES)):
            if getattr(self, name) not in choices:
                yield name, f"unknown value {getattr(self, name)!r}", f"choose one of {', '.join(choices)}"
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            yield "learning_rate", f"must be a positive number, got {self.learning_rate}", "use e.g. 1e-3"
        for name, value, ok, need, fix in (
            (
                "min_lr_ratio",
                self.min_lr_ratio,
                0.0 <= self.min_lr_ratio <= 1.0,
                "[0, 1]",
                "use e.g. 0.1 (or 0 to decay to zero)",
            ),
            ("weight_decay", self.weight_decay, 0.0 <= self.weight_decay < 10.0, "[0, 10)", "use e.g. 0.1"),
            ("beta1", self.beta1, 0.0 <= self.beta1 < 1.0, "[0, 1)", "use e.g. 0.9 / 0.95"),
            ("beta2", self.beta2, 0.0 <= self.beta2 < 1.0, "[0, 1)", "use e.g. 0.9 / 0.95"),
            ("muon_ns_steps", self.muon_ns_steps, 1 <= self.muon_ns_steps <= 10, "[1, 10]", "use e.g. 5"),
            (
                "cooldown_fraction",
                self.cooldown_fraction,
                0.0 < self.cooldown_fraction <= 1.0,
                "(0, 1]",
                "use e.g. 0.2 (1 = a linear decay from the end of warmup)",
            ),
        ):
            if not ok:
                yield name, f"must be in {need}, got {value}", fix
        if self.warmup_steps < 0:
            yield "warmup_steps", f"must be >= 0, got {self.warmup_steps}", "use e.g. 100"
        if self.decay_steps is not None and self.decay_steps < 1:
            yield "decay_steps", f"must be >= 1 or unset, got {self.decay_steps}", "leave it unset to use max_steps"
        elif self.decay_steps is not None and self.decay_steps <= self.warmup_steps and self.lr_schedule != "constant":
            yield (
                "decay_steps",
                f"{self.decay_steps} is not past warmup_steps={self.warmup_steps}, so nothing would decay (the decay "
                "runs from warmup's end to decay_steps)",
                "set decay_steps above warmup_steps, or leave it unset to use max_steps",
            )


# ------------------------------------------------------------------------------------------------ optimizer


def param_groups(
    model: nn.Module, dims: Mapping[str, int] | None = None
) -> tuple[list[tuple[str, nn.Parameter]], list[nn.Parameter]]:
    """(named matrices and embeddings: decayed, the rest: biases and norm gains, never decayed).  dims: each
    parameter's number of dimensions as built, by name, for a model whose parameters a strategy has reshaped
    since: FSDP makes every one a 1-D view of its shard, which would leave nothing decayed."""
    dims = dims or {}
    named = [(n, p, dims.get(n, p.dim())) for n, p in model.named_parameters() if p.requires_grad]
    return [(n, p) for n, p, dim in named if dim >= 2], [p for _, p, dim in named if dim < 2]


def build_optimizer(
    model: GPT, cfg: OptimConfig, fused: bool, dims: Mapping[str, int] | None = None
) -> torch.optim.Optimizer:
    """AdamW (or Muon + AdamW) over the model's parameters.  fused: one kernel for all parameters; dims: as for
    param_groups."""
    decay, no_decay = param_groups(model, dims)
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "muon":
        # Muon orthogonalises updates of the blocks' hidden matrices; embeddings and the head stay with AdamW
        hidden = [p for n, p in decay if p.dim() == 2 and n.startswith("transformer.h.")]
        ids = {id(p) for p in hidden}
        muon = GraphedMuonWithAdamW if cfg.cuda_graph else MuonWithAdamW
        return muon(
            [{"params": hidden, "weight_decay": cfg.weight_decay}],
            [
                {"params": [p for _, p in decay if id(p) not in ids], "weight_decay": cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=cfg.learning_rate,
            betas=betas,
            fused=fused,
            ns_steps=cfg.muon_ns_steps,
            row_splits=model.stacked_projections(),
        )
    adamw = GraphedAdamW if cfg.cuda_graph else torch.optim.AdamW
    return adamw(
        [
            {"params": [p for _, p in decay], "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.learning_rate,
        betas=betas,
        fused=fused,
    )


# ------------------------------------------------------------------------------------------------- schedule


def lr_multiplier(step: int, cfg: OptimConfig, decay_end: int | None, time_progress: float | None = None) -> float:
    """Learning rate at `step` as a fraction of the peak.  decay_end: the step at which the decay ends;
    time_progress: under a time budget, the share of the budget after warmup spent so far.  The decay follows
    whichever end is nearer (the larger progress); with neither known the peak is held."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progresses = [] if time_progress is None else [time_progress]
    if decay_end is not None and decay_end > cfg.warmup_steps:
        progresses.append((step - cfg.warmup_steps) / (decay_end - cfg.warmup_steps))
    if cfg.lr_schedule == "constant" or not progresses:
        return 1.0
    progress = min(1.0, max(progresses))
    if cfg.lr_schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif cfg.lr_schedule == "linear":
        decay = 1.0 - progress
    else:  # wsd: stable at the peak, then a linear cooldown over the last cooldown_fraction of the decay
        decay = min(1.0, (1.0 - progress) / cfg.cooldown_fraction)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


# a run's training clock: (seconds elapsed, seconds budgeted), or None when the run has no time budget
Clock = Callable[[], tuple[float, float] | None]


class LRSchedule:
    """LambdaLR's lr_lambda: the multiplier at a step (lr_multiplier), the decay placed on the time budget when
    the run has one.  Under a time budget the decay runs from the end of warmup to the budget's end in time, on
    the clock that stops the run, so the LR reaches its floor as the run stops, on a fast machine or a slow one,
    and a slow spell mid-run only slows the decay down.

    LambdaLR saves a callable's __dict__ with the scheduler's state (torch's documented behaviour), so __dict__
    holds only what a resumed run needs: the training time at warmup's end.  The wiring lives in slots."""

    __slots__ = ("cfg", "decay_end", "clock", "__dict__")

    def __init__(self, cfg: OptimConfig, decay_end: int | None, clock: Clock | None = None) -> None:
        self.cfg, self.decay_end, self.clock = cfg, decay_end, clock
        self.warmup_end_s: float | None = None  # training seconds at warmup's end, once reached

    def __call__(self, step: int) -> float:
        return lr_multiplier(step, self.cfg, self.decay_end, self.time_progress(step))

    def time_progress(self, step: int) -> float | None:
        """The share of the time budget after warmup spent at this step; None: no time budget, or still warming up."""
        times = self.clock() if self.clock is not None and step >= self.cfg.warmup_steps else None
        if times is None:
            return None
        elapsed, budget = times
        if self.warmup_end_s is None:
            # now, at warmup's end; resuming a checkpoint that predates this state: at the average speed so far
            self.warmup_end_s = elapsed * self.cfg.warmup_steps / step if step else 0.0
        span = budget - self.warmup_end_s
        return (elapsed - self.warmup_end_s) / span if span > 0 else 1.0


class ScheduledLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose restored state (a resume) sets the optimizer's learning rate from this run's schedule: the
    optimizer's saved state holds the rate the old schedule gave the next step, and a resume may change the schedule
    (a larger max_steps continues a run; lr_schedule, warmup_steps, decay_steps...), which would otherwise apply only
    from the step after."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # Lightning restores the optimizer's state first, then this
        lrs = [base * schedule(self.last_epoch) for base, schedule in zip(self.base_lrs, self.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, decay_end: int | None, clock: Clock | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    """Stepped once per optimizer step (after it); clock: the run's training clock, if it has a time budget."""
    return ScheduledLR(optimizer, LRSchedule(cfg, decay_end, clock))


def trainer_schedule(trainer: Any, cfg: OptimConfig) -> tuple[int | None, Clock | None]:
    """(decay_end, clock) for a Lightning trainer: decay_steps fixes the decay in steps; else it ends at max_steps
    or at the end of the time budget (max_time), whichever comes first.  The clock is Lightning's Timer, the one
    that stops the run under max_time: it counts the fit loop's time (validation included) from the first batch,
    after compiling (CompileModel), and its elapsed time is in the checkpoint, so a resumed run keeps its place."""
    from lightning.pytorch.callbacks import Timer

    if cfg.decay_steps:
        return cfg.decay_steps, None
    max_steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
    if max_steps is None and (trainer.max_epochs or -1) > 0:  # a run of max_epochs: Lightning counts its steps
        steps = trainer.estimated_stepping_batches
        max_steps = int(steps) if math.isfinite(steps) else None
    if max_steps is not None and cfg.warmup_steps >= max_steps and trainer.is_global_zero:
        print(
            f"note: optim.warmup_steps {cfg.warmup_steps} is not below the run's {max_steps} steps: the learning rate "
            f"rises to {cfg.learning_rate * max_steps / cfg.warmup_steps:.3g} at most (its peak is "
            f"{cfg.learning_rate:g}) and never decays; lower warmup_steps",
            file=sys.stderr,
        )
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)

    def clock() -> tuple[float, float] | None:
        remaining = timer.time_remaining("train") if timer is not None else None
        if remaining is None:  # no max_time: the schedule never reads the wall clock
            return None
        elapsed = timer.time_elapsed("train")
        return elapsed, elapsed + remaining

    return max_steps, clock
