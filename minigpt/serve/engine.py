"""Continuous batching: many requests decoded as one batch, each joining and leaving it between decode steps.

    engine = Engine(model, tokenizer, max_batch=8, max_queue=64)
    engine.start()
    ticket = engine.submit(Request(prompt=ids, max_tokens=50, temperature=0), on_update=print)
    ticket.cancel()                                  # the client went away: its row is freed before the next step
    engine.stop()

One thread runs the model.  Between two decode steps it drops cancelled requests, then admits waiting ones: each
is prefilled alone (its prompt's keys and values, into a one-row cache copied into the batch's cache) and samples
its first token.  A decode step then runs one token of every running request through the model together: row b
of the batch holds request b at its own position (`input_pos` is a (B,) tensor), with its own sampling settings,
generator and stops.  Decoding one token reads every weight once; a batch shares that read, which is where the
throughput comes from.  A finished request leaves at once, and the last row moves into its place, so the running
requests always fill rows 0..B-1.

On a GPU the decode step is replayed from a CUDA graph (minigpt.core.decode_graphs): the batch's cache is static,
allocated once for max_batch rows of block_size positions and kept while the engine lives, and a batch of B rows
runs padded to the smallest of 1, 2, 4, ... max_batch rows that holds it, so a few graphs serve every step.

Per request the tokens are those of `generate` alone (greedy, or with the same seed): the prefill is the same,
and each step's row sees only its own keys.  Requests are validated before they get here (minigpt.serve.app):
prompt + max_tokens fit the model's context, so no cache is ever re-filled (a sliding layer's ring keeps its last
window of positions as it goes: minigpt.core.kv_cache).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minigpt.core.decode_graphs import DecodeGraphs
from minigpt.core.errors import UserError, first_line
from minigpt.core.generation import sample_next
from minigpt.core.model import GPT
from minigpt.core.tokenizer_base import Tokenizer
from minigpt.serve.text import TextStream

__all__ = ["Engine", "QueueFull", "Request", "Ticket", "Update"]

log = logging.getLogger("minigpt.serve")


@dataclass
class Request:
    """One completion: prompt ids (1 <= len < block_size), and how to sample and stop."""

    prompt: list[int]
    max_tokens: int  # len(prompt) + max_tokens <= block_size
    temperature: float = 1.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None  # None: a fresh random seed
    stop: list[str] = field(default_factory=list)  # stop sequences: the text ends before the first one
    stop_tokens: frozenset[int] = frozenset()  # end-of-text / end-of-turn: end the text, not part of it
    continues_prompt: bool = False  # a completion: its text is what it adds to the prompt's (a chat reply: its own)


@dataclass
class Update:
    """What a request produced since its last update; the last one has finish_reason set."""

    text: str
    completion_tokens: int  # tokens sampled so far (a final end-of-text token included)
    finish_reason: str | None = None  # "stop" (end token or stop sequence), "length", or "error"
    error: str | None = None


class QueueFull(Exception):
    """More requests are waiting than the engine's queue holds."""


class Ticket:
    """A submitted request's handle: cancel() frees its place (before the next decode step)."""

    def __init__(
        self, request: Request, on_update: Callable[[Update], object], generator: torch.Generator, text: TextStream
    ) -> None:
        self.request, self.on_update, self.generator, self.text = request, on_update, generator, text
        self.cancelled = self.finished = False
        self.cached = 0  # positions of this request in the cache
        self.next_token = -1  # sampled, not yet run through the model
        self.sampled = 0

    def cancel(self) -> None:
        self.cancelled = True  # read by the engine thread between steps


class Engine:
    """decode_graphs: decode from CUDA graphs over a static cache; None = on a GPU (elsewhere True runs the same
    static, bucketed step eagerly)."""

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        max_batch: int = 8,
        max_queue: int = 64,
        decode_graphs: bool | None = None,
    ) -> None:
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        self.device = model.lm_head.weight.device
        self.vocab_size = min(tokenizer.vocab_size, model.config.vocab_size)
        self.waiting: deque[Ticket] = deque()
        self.running: list[Ticket] = []  # request b decodes in row b of the cache
        self.cache = None  # the batch's KV cache, one per layer; let go when the batch empties (the graphs keep theirs)
        self.use_graphs = self.device.type == "cuda" if decode_graphs is None else decode_graphs
        self.graphs: DecodeGraphs | None = None  # made on the first request, then kept: the graphs hold its cache
        self.steps = 0  # decode steps run (a batch of B rows counts once)
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------------------------------- the callers' side

    def submit(self, request: Request, on_update: Callable[[Update], object]) -> Ticket:
        """Queue a request; on_update is called from the engine's thread with each Update.  Raises QueueFull."""
        if request.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(request.seed)
        else:
            generator = torch.Generator(device=self.device)
            generator.seed()  # a random seed of its own
        context = request.prompt if request.continues_prompt else ()  # a SentencePiece space at the start is kept
        ticket = Ticket(request, on_update, generator, TextStream(self.tokenizer, request.stop, context))
        with self._wake:
            if self.queued() >= self.max_queue:
                raise QueueFull(f"{self.queued()} requests are already waiting")
            self.waiting.append(ticket)
            self._wake.notify()
        return ticket

    def queued(self) -> int:
        """Requests waiting for a place (one whose client left has given up its place already)."""
        return sum(not t.cancelled for t in self.waiting)

    def stats(self) -> dict[str, int]:
        with self._wake:  # the waiting queue changes under this lock
            return {
                "running": sum(not t.cancelled for t in self.running),
                "waiting": self.queued(),
                "max_batch": self.max_batch,
                "max_queue": self.max_queue,
            }

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="minigpt-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish every request with an error and end the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------------------------- the engine's thread

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    self._drop_cancelled()
                    while not (self.running or self.waiting or self._stopping):
                        self._wake.wait()
                    if self._stopping:
                        break
                    joining = [
                        self.waiting.popleft()
                        for _ in range(min(len(self.waiting), self.max_batch - len(self.running)))
                    ]
                try:
                    for ticket in joining:
                        self._admit(ticket)
                    if self.running:
                        self._step()
                except Exception as e:  # a bug, or the device out of memory: fail what runs, keep serving
                    log.exception("decoding failed")
                    failed = self.running + [t for t in joining if t not in self.running and not t.finished]
                    self.running, self.cache = [], None
                    for ticket in failed:
                        self._finish(ticket, "error", f"decoding failed: {first_line(e)}")
        with self._wake:
            left, self.running, self.waiting, self.cache = self.running + list(self.waiting), [], deque(), None
        for ticket in left:
            self._finish(ticket, "error", "the server is shutting down")

    def _drop_cancelled(self) -> None:
        self.waiting = deque(t for t in self.waiting if not t.cancelled)
        for ticket in [t for t in self.running if t.cancelled]:
            self._leave(ticket)

    def _admit(self, ticket: Ticket) -> None:
        """Prefill the prompt in a cache of its own, sample the first token, and join the batch in row B."""
        prompt = ticket.request.prompt
        one = self.model.new_kv_cache(1, max_len=len(prompt))
        ids = torch.tensor([prompt], device=self.device)
        logits = self.model(ids, kv_cache=one, input_pos=0, last_only=True)[0][:, -1]  # (1, V)
        if not self._advance(ticket, logits[:, : self.vocab_size]):
            return
        if self.cache is None:
            self.cache = self._batch_cache()
        row = len(self.running)
        for layer, source in zip(self.cache, one):
            layer.copy_row(row, source, 0, len(prompt))
        ticket.cached = len(prompt)
        self.running.append(ticket)

    def _step(self) -> None:
        """One token of every running request, as one batch."""
        tokens = torch.tensor([[t.next_token] for t in self.running], device=self.device)  # (B, 1)
        input_pos = torch.tensor([t.cached for t in self.running], device=self.device)  # (B,)
        if self.graphs is not None:  # padded to its bucket and replayed; the logits of rows 0..B-1
            logits = self.graphs(tokens, input_pos)[:, : self.vocab_size]  # (B, V)
        else:
            logits = self.model(tokens, kv_cache=self.cache, input_pos=input_pos)[0][:, -1, : self.vocab_size]
        self.steps += 1
        greedy = logits.argmax(dim=-1).tolist()  # one call for all greedy rows
        for b, ticket in enumerate(list(self.running)):
            ticket.cached += 1
            self._advance(ticket, logits[b : b + 1], greedy[b])
        for ticket in [t for t in self.running if t.finished]:
            self._leave(ticket)

    def _batch_cache(self) -> list:
        """The running batch's KV cache: a new one that grows, or the decode graphs' static one."""
        if not self.use_graphs:
            return self.model.new_kv_cache(self.max_batch)
        if self.graphs is None:
            try:
                self.graphs = DecodeGraphs(self.model, self.max_batch, self.model.config.block_size)
            except torch.cuda.OutOfMemoryError:  # a long context's whole cache does not fit: grow one as needed
                log.warning(
                    "no room for a static KV cache of %d x block_size: decoding without CUDA graphs", self.max_batch
                )
                self.use_graphs = False
                return self.model.new_kv_cache(self.max_batch)
        return self.graphs.cache

    def _advance(self, ticket: Ticket, logits: torch.Tensor, greedy: int | None = None) -> bool:
        """Sample the next token from logits (1, V), send the new text; False once the request is finished."""
        request = ticket.request
        try:
            if request.temperature == 0:
                token = greedy if greedy is not None else int(logits.argmax(dim=-1))
            else:
                token = int(sample_next(logits, request.temperature, request.top_k, request.top_p, ticket.generator))
        except UserError as e:  # NaN/inf logits (broken weights): this request ends with the message, others go on
            self._finish(ticket, "error", first_line(e, 2000))
            return False
        ticket.sampled += 1
        ticket.next_token = token
        if token in request.stop_tokens:
            self._finish(ticket, "stop")
            return False
        text, stopped = ticket.text.push(token)
        if stopped or ticket.sampled >= request.max_tokens:
            self._finish(ticket, "stop" if stopped else "length", text=text)
            return False
        if text:
            self._send(ticket, Update(text, ticket.sampled))
        return True

    def _finish(self, ticket: Ticket, reason: str, error: str | None = None, text: str = "") -> None:
        ticket.finished = True
        if error is None:
            text += ticket.text.finish()
        self._send(ticket, Update(text, ticket.sampled, reason, error))

    def _send(self, ticket: Ticket, update: Update) -> None:
        try:
            ticket.on_update(update)
        except Exception:  # the receiver is gone (its event loop closed): stop decoding for it
            log.exception("could not deliver an update")
            ticket.cancel()

    def _leave(self, ticket: Ticket) -> None:
        """Free the request's row: the last row moves into it, so rows 0..B-1 stay the running requests."""
        row, last = self.running.index(ticket), len(self.running) - 1
        if row != last:
            moved = self.running[last]
            for layer in self.cache:
                layer.copy_row(row, layer, last, moved.cached)
            self.running[row] = moved
        self.running.pop()
        if not self.running:
            self.cache = None  # an idle server holds no cache (but its decode graphs' static one)
