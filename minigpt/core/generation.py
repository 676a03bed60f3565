"""Text generation in plain torch: logit filters (top-k / top-p), sampling one token, the KV-cache loop,
and a prompt's start ids.  Used by training (its text samples), by sample.py and by analysis tools; it reads
no checkpoint and parses no command line (see minigpt.loading.load_model and minigpt.cli.sample).

KV cache and block_size: the model accepts at most block_size positions.  Without the cache every step runs
the last block_size tokens (nanoGPT).  With the cache, the prompt is prefilled once and each step feeds one
token; when the cache is full, it is re-filled from scratch with the last `block_size // 2` tokens at
positions 0.. (a fresh prefill: positions are never shifted in place, since learned positions and RoPE
angles are baked into the cached keys).  Within block_size both ways compute the same function.

Mistakes in what a user asked for (a negative temperature, a prompt the vocabulary cannot encode, a broken
checkpoint's NaN logits) raise UserError naming the concept; a caller's programming error (an `idx` of the
wrong shape) raises a plain ValueError.  The sampling settings are checked once, by the Sampling that declares
them (generate and ChatSession build one); the filters and sample_next trust what they are given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import torch

from minigpt.core.compiled import Compile, decoding
from minigpt.core.config import is_whole, kind_problem
from minigpt.core.errors import UnknownCharactersError, UserError
from minigpt.core.model import GPT
from minigpt.core.tokenizers import Tokenizer

__all__ = ["Sampling", "filter_logits", "sample_next", "refill_length", "generate", "prompt_ids"]


# ---------------------------------------------------------------------------------------------------
# Logit filters and sampling one token


MAX_NEW_TOKENS = 10_000_000  # the output buffer is allocated up front
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32, ~1.2e-38


@dataclass(frozen=True)
class Sampling:
    """How the next tokens are drawn, declared and checked once: building one refuses (UserError, one line naming
    the setting) a setting that cannot work, and everything below trusts it (filter_logits, sample_next)."""

    temperature: float = 1.0
    """0 = greedy (argmax)."""
    top_k: int | None = None
    """Keep the k most likely tokens; None = no top-k filtering."""
    top_p: float | None = None
    """Keep the smallest set of tokens whose probability reaches p, in (0, 1]; None or 1 = no nucleus filtering."""
    max_new_tokens: int = 0
    """Tokens to generate, at most MAX_NEW_TOKENS."""

    def __post_init__(self) -> None:
        for problem in self.problems():
            raise UserError(problem)

    def problems(self) -> Iterator[str]:
        if wrong := kind_problem(self, (int, float)):  # the declared types first (an API call may pass "0.7")
            name, _, problem = wrong
            yield f"{name} {problem}"
            return
        if not self.temperature >= 0:  # also catches NaN
            yield f"temperature must be >= 0 (0 = greedy), got {self.temperature}"
        if self.top_k is not None and self.top_k < 1:
            yield f"top_k must be >= 1 (or none for no top-k filtering), got {self.top_k}"
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            yield f"top_p must be in (0, 1] (1 = no nucleus filtering), got {self.top_p}"
        if self.max_new_tokens < 0:
            yield f"max_new_tokens must be >= 0, got {self.max_new_tokens}"
        elif self.max_new_tokens > MAX_NEW_TOKENS:
            yield f"max_new_tokens must be <= {MAX_NEW_TOKENS:,}, got {self.max_new_tokens:,}; generate in parts"


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """logits (..., V) -> the same with every token outside the top-k / nucleus set at -inf (a new tensor).

    top_k keeps exactly the k largest (ties broken by torch.topk's order, never more than k).  top_p keeps
    the smallest set of most probable tokens whose probabilities sum to >= top_p, and always the top token.
    Both given: top-k first, then top-p on what is left.  The settings are a Sampling's (checked there).
    """
    V = logits.size(-1)
    if top_k is not None and top_k < V:
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.topk(top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        # float64 sums the tail exactly; MPS has no float64 (float32 there: the tolerance below absorbs it)
        probs = sorted_logits.to(torch.float32 if logits.device.type == "mps" else torch.float64).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
        # drop a token once the ones before it already reach top_p; the tolerance absorbs float rounding
        # (0.5 + 0.3 must count as reaching 0.8)
        drop_sorted = mass_before >= top_p - 1e-6
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    check_greedy: bool = True,
) -> torch.Tensor:
    """logits (B, V) of the last position -> next token ids (B,).  temperature 0 = argmax.

    Any temperature > 0 samples, however small: the logits are shifted so that the top one is 0 before the
    division, so a tiny temperature (1e-40, 1e-300) sends the others to -inf (the greedy limit, ties drawn evenly)
    instead of overflowing float32 to inf and NaN; the divisor is at least float32's smallest normal number
    (1e-300 would round to 0).  NaN/inf logits (broken weights) are refused either way: argmax would pick a NaN
    (check_greedy False: the caller checks greedy_finite itself, later, without waiting for the device each token)."""
    if temperature == 0:
        ids = logits.argmax(dim=-1)
        if check_greedy and not bool(greedy_finite(logits, ids).all()):
            raise broken_weights()
        return ids
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, FLOAT32_TINY)  # <= 0, the top one 0
    logits = filter_logits(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    try:
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    except RuntimeError as e:
        if "inf" in str(e) or "nan" in str(e):  # the weights, not the code: a user's broken checkpoint
            raise broken_weights() from None
        raise


def greedy_finite(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B,) whether each row's argmax is a finite logit: a NaN is the max; +inf, or -inf only, is no choice either."""
    return logits.gather(-1, ids[..., None]).squeeze(-1).isfinite()


def broken_weights() -> UserError:
    return UserError(
        "the model produced NaN/inf logits, so there is nothing to sample from; the "
        "checkpoint's weights are broken (did training diverge?)"
    )


# ---------------------------------------------------------------------------------------------------
# The generation loop


def refill_length(block_size: int) -> int:
    """Tokens kept when a full KV cache is re-filled: half the block, so a refill happens every
    ~block_size/2 steps and each new token still sees at least block_size/2 tokens of context."""
    return max(1, block_size // 2)


def plain_tensor_out(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Run fn under inference_mode (its KV caches, and on a GPU its decode graphs' static cache, are made there)
    but return an ordinary tensor: an inference tensor refuses autograd and in-place edits outside it."""

    @functools.wraps(fn)
    def run(*args, **kwargs) -> torch.Tensor:
        with torch.inference_mode():
            out = fn(*args, **kwargs)
        return out.clone()  # a copy made outside inference_mode is an ordinary tensor (ids: bytes, not time)

    return run


@plain_tensor_out
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    use_kv_cache: bool = True,
    stop_token: int | Collection[int] | None = None,
    generator: torch.Generator | None = None,
    on_token: Callable[[torch.Tensor], object] | None = None,
    vocab_size: int | None = None,
    compile: Compile = False,
) -> torch.Tensor:
    """idx (B, T) prompt ids -> (B, T + n) ids, n <= max_new_tokens.

    stop_token: a sequence that samples it (or any of several: a folder's ends) is finished; its later positions
    repeat that token, and generation ends early once every sequence has finished.  on_token(new_ids (B,)) is
    called after every step (e.g. to stream text).  Pass a seeded torch.Generator to make sampling reproducible.
    vocab_size: sample only ids below it (a model vocabulary padded past the tokenizer's, e.g. 50304 > 50257).
    The model is used as it is (call .eval() first to sample without dropout).
    compile: each decode step runs through torch.compile (minigpt.core.compiled): compiled once per model (tens
    of seconds on a CPU, then cached on disk), then little Python per token; the same ids.  Where no compiler is
    found, the plain loop runs (a note says so).  On a GPU the step is replayed from CUDA graphs
    (minigpt.core.decode_graphs), compiled where Triton is installed.  compile="auto": on a CPU, compile only if
    this generation's tokens pay for the compile, as measured on this machine (minigpt.core.compiled.
    AutoCompiledStep; a note when it declines); elsewhere as True.
    """
    Sampling(temperature, top_k, top_p, max_new_tokens)  # the library's edge: a bad setting is one UserError
    if idx.dim() != 2 or idx.size(0) < 1 or idx.size(1) < 1:
        raise ValueError(f"idx must be (batch, tokens) with at least one token, got shape {tuple(idx.shape)}")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise ValueError(f"idx must hold token ids (an integer tensor), got {idx.dtype}")
    if vocab_size is not None and not (is_whole(vocab_size) and vocab_size >= 1):
        raise ValueError(f"vocab_size must be a whole number >= 1 (or None: every id), got {vocab_size!r}")
    if (low := int(idx.min())) < 0 or (high := int(idx.max())) >= model.config.vocab_size:  # once, at the edge
        raise UserError(
            f"token id {low if low < 0 else high} is outside the model's vocabulary (0 to "
            f"{model.config.vocab_size - 1}); encode the prompt with the model's own tokenizer"
        )
    device = model.lm_head.weight.device
    B, T0 = idx.shape
    block_size = model.config.block_size
    seq = torch.empty(B, T0 + max_new_tokens, dtype=torch.long, device=device)  # allocated once
    seq[:, :T0] = idx
    n = T0  # tokens in seq so far
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    stops = [stop_token] if isinstance(stop_token, int) else sorted(stop_token or ())
    stop_ids = torch.tensor(stops, dtype=torch.long, device=device) if stops else None
    finite = torch.ones(B, dtype=torch.bool, device=device)  # each row's greedy choices so far were finite logits
    length = min(block_size, T0 + max_new_tokens)
    cache, decode = decoding(model, B, length, compile, max_new_tokens - 1) if use_kv_cache else (None, model)
    cached = 0  # positions in the cache: it holds seq[:, n - 1 - cached : n - 1] at positions 0..cached-1

    for step in range(max_new_tokens):
        if cache is None:  # full (cropped) context every step, as nanoGPT does
            logits = model(seq[:, max(0, n - block_size) : n], last_only=True)[0][:, -1]
        elif step == 0 or cached == block_size:
            # (re)fill: prefill the last tokens at positions 0..; the prompt keeps up to block_size of them
            keep = min(n, block_size if step == 0 else refill_length(block_size))
            logits = model(seq[:, n - keep : n], kv_cache=cache, input_pos=0, last_only=True)[0][:, -1]
            cached = keep
        else:  # decode: one token at the next position
            logits = decode(seq[:, n - 1 : n], kv_cache=cache, input_pos=cached)[0][:, -1]
            cached += 1
        if vocab_size is not None:
            logits = logits[:, :vocab_size]
        next_ids = sample_next(logits, temperature, top_k, top_p, generator, check_greedy=False)
        if temperature == 0:  # checked once at the end: a check here would wait for the device at every token
            finite &= greedy_finite(logits, next_ids)
        if stop_ids is not None:
            next_ids = torch.where(finished, seq[:, n - 1], next_ids)  # pad sequences that stopped with their stop
            finished |= torch.isin(next_ids, stop_ids)
        seq[:, n] = next_ids
        n += 1
        if on_token is not None:
            on_token(next_ids)
        if stop_ids is not None and bool(finished.all()):
            break
    if not bool(finite.all()):
        raise broken_weights()
    return seq[:, :n]


# ---------------------------------------------------------------------------------------------------
# Prompts


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The prompt's token ids; an empty prompt starts from the start-of-text token where the tokenizer has one
    (Llama's <s>, Gemma's <bos>), else end-of-text (GPT-2's BPE), else a newline (char/byte)."""
    if prompt:
        try:
            return tokenizer.encode_text(prompt)  # with its BOS where the tokenizer writes one
        except UnknownCharactersError as e:
            raise e.about(
                "the prompt",
                "a char-level model reads only the characters of its training text, so remove or replace them",
            ) from None
    if (start := getattr(tokenizer, "bos_id", None)) is not None or (start := tokenizer.eot_id) is not None:
        return [start]
    try:
        ids = tokenizer.encode("\n")
    except UnknownCharactersError:  # a char vocabulary without a newline
        ids = []
    return ids or [0]
