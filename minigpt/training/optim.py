"""Optimizer, parameter groups and learning-rate schedule: what `configure_optimizers` returns, built here.

The schedule is a multiplier of the peak learning rate: linear warmup, then cosine / linear / constant / wsd
(warmup-stable-decay) down to `min_lr_ratio` at the decay's end.  The decay ends at `decay_steps`, else at the
trainer's `max_steps` or at the end of its time budget (`max_time`), whichever comes first: under a time budget
its progress is training time, so a run ends cooled down however many steps the machine managed.  When no end
is known, the peak is held.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import nn

from minigpt.core.errors import ConfigError
from minigpt.core.model import GPT
from minigpt.core.precision import has_native_bf16

OptimizerName = Literal["adamw", "muon"]
Schedule = Literal["cosine", "linear", "constant", "wsd"]
OPTIMIZERS, SCHEDULES = get_args(OptimizerName), get_args(Schedule)


@dataclass
class OptimConfig:
    optimizer: OptimizerName = "adamw"
    """adamw, or muon (Muon for the blocks' matrices, AdamW for embeddings, head and gains)."""
    muon_ns_steps: int = 5
    """muon only: Newton-Schulz iterations per step (torch's default 5; each one costs ~3 small matmuls per matrix)."""
    learning_rate: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak, in [0, 1]."""
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


# ------------------------------------------------------------------------------------------------ optimizer


def param_groups(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[nn.Parameter]]:
    """(named matrices and embeddings: decayed, the rest: biases and norm gains, never decayed)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [(n, p) for n, p in named if p.dim() >= 2], [p for _, p in named if p.dim() < 2]


def build_optimizer(model: GPT, cfg: OptimConfig, fused: bool) -> torch.optim.Optimizer:
    """AdamW (or Muon + AdamW) over the model's parameters.  fused: one kernel for all parameters."""
    decay, no_decay = param_groups(model)
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


def newton_schulz(
    grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration, as torch.optim.Muon computes it, in `dtype`: ~U V^T for G = U S V^T.

    grad: one matrix (m, n), or a stack of same-shaped matrices (k, m, n), each orthogonalised on its own in one
    batched matmul per product (what many small matrices need on a CPU)."""
    a, b, c = coefficients
    addmm = torch.addmm if grad.dim() == 2 else torch.baddbmm
    x = grad.to(dtype)
    tall = grad.size(-2) > grad.size(-1)
    if tall:  # iterate on the wide orientation: the Gram matrix is the smaller one
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = addmm(x, addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon with the Newton-Schulz iteration in a dtype chosen for the parameters' device, batched over
    same-shaped matrices, and run on each projection of a stacked weight on its own.

    torch's iteration is always bfloat16: right on GPUs and CPUs with native bf16, but on a CPU without it (AVX2)
    a bf16 matmul is ~150x slower than float32, and torch's Muon made the CPU recipe's step 6x slower (620 ms vs
    104 ms with the iteration in float32).
    row_splits: {weight: rows of each projection} for weights that stack several projections (fused q/k/v,
    SwiGLU's gate/up): each is orthogonalised, and its learning rate scaled, as the matrix it is, as if the
    projections were separate parameters (as Muon's authors do).  Without row_splits, and with no two matrices
    of one shape, each update is torch's to the bit.
    Everything else is torch's Muon: the update, its hyper-parameters, state (momentum_buffer) and checkpoints.
    """

    ns_dtype: torch.dtype | None = None  # decided at the first step, from where the parameters live

    def __init__(self, params, *args, row_splits: dict[torch.Tensor, list[int]] | None = None, **kwargs) -> None:
        super().__init__(params, *args, **kwargs)
        self.row_splits = dict(row_splits or {})  # keyed by the parameter object (tensors hash by identity)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if self.ns_dtype is None:
                self.ns_dtype = torch.bfloat16 if has_native_bf16(params[0].device) else torch.float32
            # the element-wise updates one foreach call each over the group (on a GPU a few launches, not one per
            # matrix: a small model's optimizer step is the host launching kernels)
            grads = [p.grad for p in params]
            bufs = [self.momentum_buffer(p) for p in params]
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
            decay = 1 - lr * group["weight_decay"]  # decoupled weight decay
            if params[0].dtype == torch.float32:
                torch._foreach_mul_(params, decay)
            else:  # bf16 weights (bf16-true): a CPU's foreach rounds the scalar to bf16 first, mul_ does not
                for p in params:
                    p.mul_(decay)
            by_shape: dict[torch.Size, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # (weight rows, update rows)
            for p, update in zip(params, updates):
                rows = self.row_splits.get(p)
                for piece in zip(p.split(rows), update.split(rows)) if rows else [(p, update)]:
                    by_shape.setdefault(piece[0].shape, []).append(piece)
            for shape, pieces in by_shape.items():
                single = len(pieces) == 1  # a lone matrix takes torch's own 2-D path
                ortho = newton_schulz(
                    pieces[0][1] if single else torch.stack([u for _, u in pieces]),
                    group["ns_coefficients"],
                    group["ns_steps"],
                    group["eps"],
                    self.ns_dtype,
                )
                alpha = -lr * muon_lr_ratio(group["adjust_lr_fn"], shape)
                weights = [weight for weight, _ in pieces]  # the parameters, or views of their rows
                if weights[0].dtype == torch.float32:  # exact (from bf16 or float32): one dtype and layout throughout
                    ortho = ortho.to(torch.float32, memory_format=torch.contiguous_format)  # keeps foreach's fast path
                if isinstance(alpha, torch.Tensor):  # a learning rate on the device (GraphedStep): no scalar alpha
                    ortho = ortho * alpha.to(ortho.dtype)
                    alpha = 1.0
                torch._foreach_add_(weights, [ortho] if single else list(ortho.unbind()), alpha=alpha)
        return loss

    def momentum_buffer(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        return state["momentum_buffer"]


def muon_lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's per-matrix learning-rate scale: "original" sqrt(max(1, A/B)), or "match_rms_adamw"
    0.2 sqrt(max(A, B)), which gives the update AdamW's RMS so the two can share one learning rate."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" else 1.0


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the blocks' 2-D weights, AdamW for everything else, as one optimizer: Lightning's automatic
    optimization (clipping, accumulation, LR schedulers, checkpoints) then drives both unchanged.

    The two inner optimizers share this optimizer's param_groups and state dicts, so state_dict(),
    load_state_dict() and an LR scheduler see all groups at once.
    """

    def __init__(
        self,
        muon_groups: list[dict],
        adamw_groups: list[dict],
        lr: float,
        betas: tuple[float, float],
        fused: bool,
        ns_steps: int = 5,
        row_splits: dict[torch.Tensor, list[int]] | None = None,
    ) -> None:
        # match_rms_adamw scales Muon's update to AdamW's size, so one learning rate serves both
        self.muon = Muon(muon_groups, lr=lr, adjust_lr_fn="match_rms_adamw", ns_steps=ns_steps, row_splits=row_splits)
        self.adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, fused=fused)
        super().__init__(self.muon.param_groups + self.adamw.param_groups, defaults={"lr": lr})
        self._share()

    def _share(self) -> None:
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # replaces the group and state dicts: share the new ones
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.muon.step(closure)  # evaluates the closure (Lightning's forward + backward) first
        self.adamw.step()
        return loss


class GraphedStep:
    """Mixed into an optimizer (before it): step() runs the closure (Lightning's forward, backward and clipping)
    eagerly, then the update, which from the fourth step on is one CUDA graph replayed instead of each of its
    kernels launched from Python.  The first steps run eagerly (they make the state), the third on the side stream
    the graph is captured on, as torch's CUDA-graph docs ask.  The graph reads each group's learning rate from a
    tensor on the device, refilled before each replay, so a schedule still moves it.  It holds the gradients'
    addresses: a step whose gradients moved (freed by zero_grad, say) drops the graph and runs eagerly from then on.
    """

    _eager_steps = 0
    _graph: torch.cuda.CUDAGraph | None = None
    _graph_given_up = False

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        if self._graph is not None and any(g is not p.grad for g, p in zip(self._graph_grads, params, strict=True)):
            warnings.warn("optim.cuda_graph: the gradients moved between steps; the update runs eagerly", stacklevel=2)
            self._graph, self._graph_given_up = None, True
        if self._graph is not None:
            for lr, group in zip(self._graph_lrs, self.param_groups):
                lr.fill_(group["lr"])
            self._graph.replay()
        elif self._graph_given_up or not params or params[0].device.type != "cuda" or self._eager_steps < 2:
            self._eager_steps += 1
            super().step()
        elif self._eager_steps == 2:  # the last eager step on the capture's stream: its libraries warmed up there
            self._graph_stream = torch.cuda.Stream(params[0].device)
            self._graph_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._graph_stream):
                super().step()
            torch.cuda.current_stream().wait_stream(self._graph_stream)
            self._eager_steps += 1
        else:
            try:
                self._capture(params)
            except RuntimeError as error:  # an op the capture refuses: the update still runs, eagerly
                warnings.warn(
                    f"optim.cuda_graph: the update could not be captured ({error}); it runs eagerly", stacklevel=2
                )
                self._graph, self._graph_given_up = None, True
                super().step()
                return loss
            self._graph.replay()  # capturing ran nothing: this step's update
        return loss

    def _capture(self, params: list[torch.Tensor]) -> None:
        floats = [group["lr"] for group in self.param_groups]
        self._graph_lrs = [torch.tensor(lr, dtype=torch.float32, device=params[0].device) for lr in floats]
        self._graph_grads = [p.grad for p in params]
        self._graph = torch.cuda.CUDAGraph()
        capturable = [group.get("capturable") for group in self.param_groups]  # AdamW's groups have the key
        try:  # torch's AdamW refuses to be captured unless its groups say capturable; the groups read the tensors
            for group, lr in zip(self.param_groups, self._graph_lrs):
                group["lr"] = lr
                if "capturable" in group:
                    group["capturable"] = True
            with torch.cuda.graph(self._graph, stream=self._graph_stream, capture_error_mode="thread_local"):
                super().step()
        finally:
            for group, lr, was in zip(self.param_groups, floats, capturable):
                group["lr"] = lr
                if was is not None:
                    group["capturable"] = was

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # new state tensors: a graph would update the old ones
        self._graph, self._eager_steps = None, 0


class GraphedAdamW(GraphedStep, torch.optim.AdamW):
    """AdamW with its update replayed as a CUDA graph (OptimConfig.cuda_graph)."""


class GraphedMuonWithAdamW(GraphedStep, MuonWithAdamW):
    """Muon + AdamW with their update replayed as one CUDA graph (OptimConfig.cuda_graph)."""


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


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, decay_end: int | None, clock: Clock | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    """Stepped once per optimizer step (after it); clock: the run's training clock, if it has a time budget."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, LRSchedule(cfg, decay_end, clock))


def trainer_schedule(trainer: Any, cfg: OptimConfig) -> tuple[int | None, Clock | None]:
    """(decay_end, clock) for a Lightning trainer: decay_steps fixes the decay in steps; else it ends at max_steps
    or at the end of the time budget (max_time), whichever comes first.  The clock is Lightning's Timer, the one
    that stops the run under max_time: it counts the fit loop's time (validation included) from the first batch,
    after compiling (CompileModel), and its elapsed time is in the checkpoint, so a resumed run keeps its place."""
    from lightning.pytorch.callbacks import Timer

    if cfg.decay_steps:
        return cfg.decay_steps, None
    max_steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)

    def clock() -> tuple[float, float] | None:
        remaining = timer.time_remaining("train") if timer is not None else None
        if remaining is None:  # no max_time: the schedule never reads the wall clock
            return None
        elapsed = timer.time_elapsed("train")
        return elapsed, elapsed + remaining

    return max_steps, clock
