"""An optimizer's update captured once as a CUDA graph and replayed (OptimConfig.cuda_graph): on a small model the
host launching the update's kernels one by one from Python is a large share of the step."""

from __future__ import annotations

import warnings

import torch

from minigpt.core.devices import current_stream_kept
from minigpt.training.muon import MuonWithAdamW, evaluate


class GraphedStep:
    """Mixed into an optimizer (before it): step() runs the closure (Lightning's forward, backward and clipping)
    eagerly, then the update, which from the fourth step on is one CUDA graph replayed instead of each of its
    kernels launched from Python.  The first steps run eagerly (they make the state), the third on a side stream,
    as torch's CUDA-graph docs ask.  The graph reads each group's learning rate from a tensor on the device,
    refilled before each replay, so a schedule still moves it.  It holds the gradients, the weights and the state
    where they were at the capture: where the gradients move between steps (zero_grad freeing them), or AdamW is
    not fused, the update runs eagerly (with a warning) from then on.
    """

    _eager_steps = 0
    _graph: torch.cuda.CUDAGraph | None = None
    _graph_grads: list[torch.Tensor | None] = []  # the gradients the graph reads (before it: the last step's)
    _graph_given_up = False

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate(closure)  # eagerly
        params = [p for group in self.param_groups for p in group["params"]]
        if self._graph_grads and any(g is not p.grad for g, p in zip(self._graph_grads, params, strict=True)):
            self._give_up(
                "the gradients moved between steps (compile_mode cudagraphs, reduce-overhead and graphed keep them)"
            )
        if self._graph is not None:
            for lr, group in zip(self._graph_lrs, self.param_groups):
                lr.fill_(group["lr"])
            self._graph.replay()
            return loss
        if not self._graph_given_up and params and params[0].device.type == "cuda":
            self._graph_grads = [p.grad for p in params]  # the next step checks they stayed
        if self._graph_given_up or not self._graph_grads or self._eager_steps < 2:
            self._eager_steps += 1
            super().step()
        elif self._eager_steps == 2:  # the last eager step on a side stream, as torch's CUDA-graph docs ask
            side = torch.cuda.Stream(params[0].device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                super().step()
            torch.cuda.current_stream().wait_stream(side)
            self._eager_steps += 1
        elif problem := self._uncapturable(params):
            self._give_up(problem)
            super().step()
        else:
            try:
                self._capture(params[0].device)
            except Exception as error:  # an op the capture refuses: the update still runs, eagerly
                self._give_up(f"the update could not be captured ({error})")
                super().step()
                return loss
            self._graph.replay()  # capturing ran nothing: this step's update
        return loss

    def _uncapturable(self, params: list[torch.Tensor]) -> str | None:
        """Why the update cannot be captured now, or None."""
        if any(group.get("fused") is False for group in self.param_groups):  # unfused AdamW keeps its step count
            return "AdamW is not fused (under a gradient scaler, precision 16-mixed)"  # on the host
        if any(p.grad is not None and not self.state.get(p) for p in params):  # made in the graph, zeroed per replay
            return "a parameter has a gradient but no optimizer state yet"
        return None

    def _capture(self, device: torch.device) -> None:
        floats = [group["lr"] for group in self.param_groups]
        self._graph_lrs = [torch.tensor(lr, dtype=torch.float32, device=device) for lr in floats]
        self._graph = torch.cuda.CUDAGraph()
        capturable = [group.get("capturable") for group in self.param_groups]  # AdamW's groups have the key
        # captured on a stream of its own, not the warm-up's (torch hands streams out from a pool of 32 a device, of
        # which a run takes a few): cuBLAS makes that stream's workspace during the capture, in the graph's own
        # memory pool, as torch.compile's CUDA graphs make theirs. A workspace made before, in the common pool, would
        # be freed under the graph the next time torch.compile records one (it frees every stream's workspace then),
        # and the replays would write into memory that other tensors own
        stream = torch.cuda.Stream(device)
        try:  # torch's AdamW refuses to be captured unless its groups say capturable; the groups read the tensors
            for group, lr in zip(self.param_groups, self._graph_lrs):
                group["lr"] = lr
                if "capturable" in group:
                    group["capturable"] = True
            with (
                current_stream_kept(device),
                torch.cuda.graph(self._graph, stream=stream, capture_error_mode="thread_local"),
            ):
                super().step()
        finally:
            for group, lr, was in zip(self.param_groups, floats, capturable):
                group["lr"] = lr
                if was is not None:
                    group["capturable"] = was

    def _give_up(self, why: str) -> None:
        warnings.warn(f"optim.cuda_graph: {why}; the update runs eagerly", stacklevel=3)
        self._graph, self._graph_grads, self._graph_given_up = None, [], True

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # new state tensors: a graph would update the old ones
        self._graph, self._graph_grads, self._eager_steps = None, [], 0


class GraphedAdamW(GraphedStep, torch.optim.AdamW):
    """AdamW with its update replayed as a CUDA graph (OptimConfig.cuda_graph)."""


class GraphedMuonWithAdamW(GraphedStep, MuonWithAdamW):
    """Muon + AdamW with their update replayed as one CUDA graph (OptimConfig.cuda_graph)."""
