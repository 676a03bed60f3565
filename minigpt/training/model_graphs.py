"""--compile_mode graphed: the model's training forward and backward recorded as CUDA graphs, with no compile.

torch.cuda.make_graphed_callables runs the eager model a few times, records its kernels once (forward, and the
backward on the same shapes) and replays them: the step is two launches, as under torch.compile's cudagraphs
backend, but without Dynamo tracing the model and AOTAutograd splitting it (seconds of a GPU run's start-up, in
which nothing trains).  The replayed graphs hold the shapes they were recorded on, so only the training forward
of exactly those shapes replays; everything else (validation, generation, another shape) runs the eager model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minigpt.core.devices import current_stream_kept
from minigpt.core.model import GPT
from minigpt.training.sft import split_batch


class TrainingGraphs:
    """Installed as a GPT's forward: a training forward (model.training, gradients on, targets given, no keyword
    options) on the recorded shape replays the graphs, and returns (None, loss): the training step reads only the
    loss; any other call runs the eager forward.  replays counts the forwards that replayed."""

    def __init__(self, model: GPT, replay: Callable, eager: Callable, shape: torch.Size) -> None:
        self.model, self.replay, self.eager, self.shape = model, replay, eager, shape
        self.replays = 0

    def __call__(self, idx: torch.Tensor, targets: torch.Tensor | None = None, **options):
        if (
            targets is not None
            and not options
            and self.model.training
            and torch.is_grad_enabled()
            and idx.shape == self.shape
            and targets.shape == self.shape
        ):
            self.replays += 1
            # the inputs are copied into the graphs' own: a batch of another shape would broadcast, hence the check
            return None, self.replay(idx, targets)
        return self.eager(idx, targets, **options)


class TrainingLoss(torch.nn.Module):
    """What the graphs record: the GPT's training forward with its loss as the only output.  Recorded with the
    logits as an output too, each replay's backward would take a gradient for them as well, which autograd makes
    as zeros of their shape: (B, T, vocab) allocated, copied and added per micro-batch, for nothing."""

    def __init__(self, model: GPT, eager: Callable) -> None:
        super().__init__()
        self.model, self.eager = model, eager  # the model for its parameters, its eager forward to run

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.eager(idx, targets)[1]


def record_training_graphs(model: GPT, batch: torch.Tensor, autocast: Callable) -> TrainingGraphs:
    """Record model(inputs, targets)'s loss for `batch`'s shape (B, T + 1), under the training step's precision
    (autocast: its context), as CUDA graphs, and install them as model.forward.  The parameters' gradients come out
    of the backward graph and are added into p.grad by autograd as usual; the graphs' outputs are overwritten by the
    next replay, so the step's loss is copied before the next forward (GPTLightningModule.training_step)."""
    inputs, targets = split_batch(batch)
    eager = model.forward
    device = batch.device.type
    # the step's autocast, without its cast cache: a cached bf16 copy of a weight would be recorded stale
    with (
        autocast(),
        torch.autocast(
            device,
            dtype=torch.get_autocast_dtype(device),
            enabled=torch.is_autocast_enabled(device),
            cache_enabled=False,
        ),
        current_stream_kept(batch.device),  # a failure leaves the model as it was
    ):
        loss = TrainingLoss(model, eager)
        recorded = torch.cuda.make_graphed_callables(loss, (inputs, targets), allow_unused_input=True)
    graphs = TrainingGraphs(model, recorded, eager, inputs.shape)
    model.forward = graphs
    return graphs
