"""Decoding on a GPU from CUDA graphs: a decode step captured once and replayed, not launched kernel by kernel.

A small model's decode step is a few hundred small kernels (about twenty per layer).  Launched one by one from
Python, each costs more host time than the GPU needs to run it, so the GPU mostly waits; torch.compile fuses some
of them but still launches its kernels from Python every token.  A CUDA graph records the step's kernels once,
and one replay launches all of them.

A graph replays fixed shapes at fixed addresses, so the step is made static (as gpt-fast does):
- the KV cache is allocated once, for the whole generation (KVCache.make_static), and every step attends over all
  its positions: the mask, built on the device from the positions, hides each row's positions past its own (a
  sliding layer's static cache is its ring of window slots, written at position % window: static as it is);
- the step reads its token ids and positions from device tensors updated in place before each replay: no Python
  int reaches the graph and nothing in it waits for the host.
One graph then serves every position.  A batch of B rows runs in the graph of the smallest bucket >= B (1, 2, 4,
8, ..., the cache's rows): the rows past B are padding (token 0 at position 0 of cache rows no request holds; the
server's running requests always fill rows 0..B-1) and their logits are dropped.

Where a capture fails, a note says so and the step runs eagerly from then on.  Without CUDA (capture=False) the
same static step runs eagerly: the tests' reference for the graphs.  A CPU decodes this way only in the serve
engine with --compile, and only where its compiled step measured faster at start than the step over a cache that
grows (launches are cheap there; elsewhere minigpt.core.compiled's dynamic step is the one).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable

import torch

from minigpt.core.devices import current_stream_kept
from minigpt.core.errors import first_line
from minigpt.core.model import GPT

__all__ = ["DecodeGraphs", "batch_buckets"]

WARMUP_STEPS = 2  # eager runs before a capture: lazy set-up (cuBLAS workspaces, a compile) stays out of the graph


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, ... below max_batch, and max_batch itself."""
    return [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch] + [max_batch]


class DecodeGraphs:
    """Decode steps of `model` over one static KV cache (`rows` rows x `capacity` positions, `self.cache`), one
    CUDA graph per batch bucket, captured on the bucket's first step.

    forward(model, idx, kv_cache=..., input_pos=...) is what runs (and is captured): the model's own call, or
    torch.compile's GPT.forward.  Only a weak reference to the model is kept, so a registry keyed by the model
    (minigpt.core.compiled) lets it go; the graphs read its weights where they were at capture.
    """

    @torch.inference_mode()
    def __init__(
        self,
        model: GPT,
        rows: int,
        capacity: int,
        forward: Callable | None = None,
        capture: bool | None = None,
    ) -> None:
        device = model.lm_head.weight.device
        self.model = weakref.ref(model)
        self.forward = forward or DecodeGraphs.call_model
        self.capture = device.type == "cuda" if capture is None else capture
        self.cache = model.new_kv_cache(rows, capacity)
        for layer in self.cache:
            layer.make_static(capacity)
        self.buckets = batch_buckets(rows)
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)  # (rows, 1): the ids a replay reads
        self.input_pos = torch.zeros(rows, dtype=torch.long, device=device)  # (rows,): their positions
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> graph, its logits
        self.bucket_steps: dict[int, int] = dict.fromkeys(self.buckets, 0)  # steps run per bucket

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, input_pos: int | torch.Tensor) -> torch.Tensor:
        """tokens (B, 1) at positions input_pos (B,), or one int for every row -> next-token logits (B, V).

        The logits are the graph's output buffer, overwritten by the next step: use them before it."""
        B = tokens.size(0)
        b = next(size for size in self.buckets if size >= B)
        self.tokens[:B].copy_(tokens)
        if isinstance(input_pos, torch.Tensor):
            self.input_pos[:B].copy_(input_pos)
        else:
            self.input_pos[:B].fill_(input_pos)
        if b > B:  # padding: token 0 at position 0 of rows no request holds
            self.tokens[B:b].zero_()
            self.input_pos[B:b].zero_()
        self.bucket_steps[b] += 1
        return self._run(b)[:B]

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run (on a GPU: compile if it does, and capture) every bucket's step now, so that no later step waits for
        its bucket's capture.  Every row is padding (token 0 at position 0): use it before any row holds a request."""
        self.tokens.zero_()
        self.input_pos.zero_()
        for b in self.buckets:
            self._run(b)

    def _run(self, b: int) -> torch.Tensor:
        """Rows 0..b-1's step from the graph of bucket b (captured on its first step), or eagerly -> logits (b, V)."""
        if not self.capture:
            return self._step(b)
        if b not in self.graphs:
            try:
                self.graphs[b] = self._capture(b)
            except RuntimeError as e:  # a step CUDA cannot capture (an op that waits for the host): run it eagerly
                print(f"note: decoding without CUDA graphs: {first_line(e)}", file=sys.stderr, flush=True)
                self.capture = False
                return self._step(b)
        graph, logits = self.graphs[b]
        graph.replay()
        return logits

    @staticmethod
    def call_model(model: GPT, *args, **kwargs):
        return model(*args, **kwargs)

    def _step(self, b: int) -> torch.Tensor:
        """The static step of rows 0..b-1 -> logits (b, V)."""
        model = self.model()
        assert model is not None, "the model was freed while its decode graphs were in use"
        return self.forward(model, self.tokens[:b], kv_cache=self.cache, input_pos=self.input_pos[:b])[0][:, -1]

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # the warm-up runs are this very step (same ids, same positions): writing the same keys twice is harmless
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._step(b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server captures on its engine thread while its event loop's thread goes on; a failed
        # capture leaves this thread on the caller's stream for the eager steps after it
        with current_stream_kept(self.tokens.device), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = self._step(b)
        return graph, logits
