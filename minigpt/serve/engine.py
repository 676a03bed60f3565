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
runs padded to the smallest of 1, 2, 4, ... max_batch rows that holds it, so a few graphs serve every step.  The
step the graphs capture is torch.compile's where Triton is installed (fused kernels: fewer, shorter launches in
each replay); start() compiles and captures every bucket before the first request, so none waits for it.  On a
CPU, compile=True runs the same static step compiled (no graphs), once start() has measured it faster than the
step uncompiled.

Per request the tokens are those of `generate` alone (greedy, or with the same seed): the prefill is the same,
and each step's row sees only its own keys.  Requests are validated before they get here (minigpt.serve.app):
prompt + max_tokens fit the model's context, so no cache is ever re-filled (a sliding layer's ring keeps its last
window of positions as it goes: minigpt.core.kv_cache).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from minigpt.core.compiled import compiler_available, median, note_no_compiler, note_once, static_forward
from minigpt.core.decode_graphs import DecodeGraphs
from minigpt.core.errors import UserError, first_line
from minigpt.core.generation import sample_next
from minigpt.core.model import GPT
from minigpt.core.tokenizer_base import Tokenizer
from minigpt.serve.text import TextStream

__all__ = ["SHUTTING_DOWN", "Engine", "QueueFull", "Request", "Ticket", "Update", "in_passing"]

log = logging.getLogger("minigpt.serve")

SHUTTING_DOWN = "the server is shutting down"  # the error of every request the engine's stop ends
T = TypeVar("T")
TIMED_STEPS = 5  # on a CPU, one row's steps timed each way (compiled, uncompiled) before the server answers
step_clock = time.perf_counter  # what they are timed with (a test puts a fake one here)


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


def in_passing(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on a thread that ends with it.  Torch work done so (loading the model) leaves no OpenMP
    team behind, and the engine's thread is the process's only one.  With two teams libgomp has more threads than
    cores, so it stops its idle workers' spinning and each parallel op on a CPU waits for a wake-up: the engine's
    decode step measured 20 to 30 % slower with the model loaded on the main thread (docs/serve.md)."""
    result, failed = [], []

    def run() -> None:
        try:
            result.append(fn(*args, **kwargs))
        except BaseException as e:
            failed.append(e)

    thread = threading.Thread(target=run, name="minigpt-load", daemon=True)  # Ctrl-C while it runs: the process ends
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return result[0]


class Engine:
    """decode_graphs: decode from CUDA graphs over a static cache; None = on a GPU, or where compile (elsewhere the
    same static, bucketed step runs without graphs).
    compile: the step is torch.compile's static one; None = on a GPU where Triton is installed.  On a CPU
    start() times it against the uncompiled step over a growing cache and keeps the faster (a note if that is the
    uncompiled one)."""

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        max_batch: int = 8,
        max_queue: int = 64,
        decode_graphs: bool | None = None,
        compile: bool | None = None,
    ) -> None:
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        self.device = model.lm_head.weight.device
        self.vocab_size = min(tokenizer.vocab_size, model.config.vocab_size)
        self.waiting: deque[Ticket] = deque()
        self.admitting = 0  # taken from waiting, not yet in running (their prefill): counted as decoding
        self.running: list[Ticket] = []  # request b decodes in row b of the cache
        self.cache = None  # the batch's KV cache, one per layer; let go when the batch empties (the graphs keep theirs)
        self.compile = self._compiles(compile, decode_graphs)
        self.use_graphs = self.device.type == "cuda" or self.compile if decode_graphs is None else decode_graphs
        self.graphs: DecodeGraphs | None = None  # made on the first request, then kept: the graphs hold its cache
        self.steps = 0  # decode steps run (a batch of B rows counts once)
        self.warm = False  # the decode step compiled and captured (start does it)
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
            if self._stopping and self._thread is not None:  # a request that came while the engine stops
                self._finish(ticket, "error", SHUTTING_DOWN)
                return ticket
            # max_batch + max_queue in all: a burst on an idle server waits for its rows, not a 503
            decoding = sum(not t.cancelled for t in self.running) + self.admitting
            if decoding + self.queued() >= self.max_batch + self.max_queue:
                raise QueueFull(f"{decoding} requests decoding, {self.queued()} waiting")
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
        """Start the engine's thread.  It first warms the decode step up (_warm_up: on a GPU every batch bucket's
        graph compiled and captured), and start returns once it has, raising what that raised.  All of the engine's
        torch work is on that one thread: on a CPU a second thread's parallel ops would slow both (in_passing)."""
        self._stopping = False
        ready, failed = threading.Event(), []

        def run() -> None:
            try:
                self._warm_up()
            except BaseException as e:  # (the KeyboardInterrupt of a test's timeout too: start re-raises it)
                failed.append(e)
                return
            finally:
                ready.set()
            self._loop()

        self._thread = threading.Thread(target=run, name="minigpt-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            self._thread.join()
            self._thread = None
            raise failed[0]

    def stop(self) -> None:
        """Finish every request with an error and end the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------------------------- the engine's thread

    def _warm_up(self) -> None:
        """Compile (if it does) and capture every batch bucket's decode step before the first request, which would
        otherwise wait for its bucket's.  On a CPU a compiled step is then timed against the uncompiled one."""
        if not self.use_graphs or self.warm:
            return
        self._batch_cache()
        if self.graphs is not None:  # (None: no room for the static cache)
            self.graphs.warm_up()
            if self.compile and not self.graphs.capture:
                self._keep_the_faster_step()  # a CPU's compiled step: kept, or dropped with the static cache
        if self.graphs is not None:
            self.graphs.bucket_steps = dict.fromkeys(self.graphs.buckets, 0)  # the requests' steps from here on
        self.warm = True

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
                    self.admitting = len(joining)
                try:
                    for ticket in joining:
                        self._admit(ticket)
                        with self._wake:  # now in running, or finished at its first token
                            self.admitting -= 1
                    if self.running:
                        self._step()
                except Exception as e:  # a bug, or the device out of memory: fail what runs, keep serving
                    log.exception("decoding failed")
                    with self._wake:
                        self.admitting = 0
                    failed = self.running + [t for t in joining if t not in self.running and not t.finished]
                    self.running, self.cache = [], None
                    for ticket in failed:
                        self._finish(ticket, "error", f"decoding failed: {first_line(e)}")
        with self._wake:
            left, self.running, self.waiting, self.cache = self.running + list(self.waiting), [], deque(), None
        for ticket in left:
            self._finish(ticket, "error", SHUTTING_DOWN)

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
        best = logits.max(dim=-1)  # one call for all greedy rows; a row whose max is NaN/inf: -1 (sample_next refuses)
        greedy = torch.where(best.values.isfinite(), best.indices, -1).tolist()
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
                forward = static_forward(self.device.type) if self.compile else None
                self.graphs = DecodeGraphs(self.model, self.max_batch, self.model.config.block_size, forward)
            except torch.cuda.OutOfMemoryError:  # a long context's whole cache does not fit: grow one as needed
                log.warning(
                    "no room for a static KV cache of %d x block_size: decoding without CUDA graphs", self.max_batch
                )
                self.use_graphs = self.compile = False  # (what compiles is the static step)
                return self.model.new_kv_cache(self.max_batch)
        return self.graphs.cache

    def _compiles(self, compile: bool | None, decode_graphs: bool | None) -> bool:
        """Is the decode step torch.compile's static one?  (As asked, where a compiler is; else a note.)"""
        if compile is None:
            return self.device.type == "cuda" and decode_graphs is not False and compiler_available("cuda")
        if compile and decode_graphs is False:
            raise ValueError("compile=True compiles the static step, and decode_graphs=False asks for none")
        if compile and not compiler_available(self.device.type):
            note_no_compiler(self.device.type)
            return False
        return compile

    def _keep_the_faster_step(self) -> None:
        """On a CPU the compiled static step is not always faster than the default, the uncompiled step over a cache
        that grows (int8 weights: slower than their eager kernel).  One row's step is timed both ways, the median of
        TIMED_STEPS (the growing cache's at position min(64, block_size / 2)), and the slower dropped, with a note."""
        tokens = torch.zeros(1, 1, dtype=torch.long, device=self.device)

        def median_s(step: Callable[[int], object]) -> float:
            times = []
            for i in range(TIMED_STEPS):
                start = step_clock()
                step(i)
                times.append(step_clock() - start)
            return median(times)

        compiled_s = median_s(lambda i: self.graphs(tokens, 0))
        cache, at = self.model.new_kv_cache(1), min(64, self.model.config.block_size // 2)
        with torch.inference_mode():
            self.model(tokens.expand(1, at), kv_cache=cache, input_pos=0)
            growing_s = median_s(lambda i: self.model(tokens, kv_cache=cache, input_pos=torch.tensor([at + i])))
        if compiled_s < growing_s:
            return
        self.compile, self.use_graphs, self.graphs = False, False, None  # the static cache goes too
        note_once(
            f"the decode step is not compiled: compiled, it measured slower here ({1e3 * compiled_s:.1f} against "
            f"{1e3 * growing_s:.1f} ms a step uncompiled)"
        )

    def _advance(self, ticket: Ticket, logits: torch.Tensor, greedy: int | None = None) -> bool:
        """Sample the next token from logits (1, V), send the new text; False once the request is finished."""
        request = ticket.request
        try:
            if request.temperature == 0 and greedy is not None and greedy >= 0:
                token = greedy
            else:  # a draw, or greedy's argmax (the first token's), NaN/inf logits refused as broken weights
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
            reason = "stop" if ticket.text.stopped else reason  # a stop sequence only the end of the text showed
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
