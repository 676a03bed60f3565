"""Text generation: load a checkpoint, filter logits (top-k / top-p), sample with or without a KV cache.

`generate` is the loop; `main` is the `sample.py` command line around it.

KV cache and block_size: the model accepts at most block_size positions.  Without the cache every step runs
the last block_size tokens (nanoGPT).  With the cache, the prompt is prefilled once and each step feeds one
token; when the cache is full, it is re-filled from scratch with the last `block_size // 2` tokens at
positions 0.. (a fresh prefill: positions are never shifted in place, since learned positions and RoPE
angles are baked into the cached keys).  Within block_size both ways compute the same function.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import torch

from minigpt.checkpoint import CheckpointError, find_checkpoint, load_checkpoint, model_from_checkpoint
from minigpt.config import ATTENTIONS, ConfigError
from minigpt.errors import UserError, run_cli
from minigpt.model import GPT
from minigpt.tokenizers import Tokenizer, UnknownCharactersError, tokenizer_from_dict

# ---------------------------------------------------------------------------------------------------
# Loading


def load_model(ckpt: str | Path | None, device: str = "cpu",
               attention: str | None = None) -> tuple[GPT, Tokenizer]:
    """A checkpoint file, a run directory, or None (the newest run under out/) -> (model in eval mode, tokenizer).

    `attention` picks another attention path for the same weights (same outputs, e.g. 'manual' to inspect
    attention weights).  Only tensors and plain data are unpickled (weights_only=True).
    """
    path = find_checkpoint(ckpt)
    raw = load_checkpoint(path, map_location="cpu")
    overrides = {"attention": attention} if attention is not None else {}
    meta = raw["minigpt"]
    missing = [k for k in ("model_config", "tokenizer") if not isinstance(meta, dict) or not meta.get(k)]
    if missing or not isinstance(raw["state_dict"], dict):
        raise CheckpointError(f"{path} is not a usable minigpt checkpoint (no {' or '.join(missing) or 'weights'} "
                              "in it); pass a .ckpt written by train.py")
    try:
        tokenizer = tokenizer_from_dict(meta["tokenizer"])
        model = model_from_checkpoint(raw, **overrides)
    except ConfigError:
        raise
    except (KeyError, TypeError, AttributeError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{path} is not a usable minigpt checkpoint ({type(e).__name__}: {first[:160]}); "
                              "pass a .ckpt written by train.py") from None
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model only "
                              f"{model.config.vocab_size}; the checkpoint is inconsistent")
    return model.to(device).eval(), tokenizer


# ---------------------------------------------------------------------------------------------------
# Logit filters


def check_sampling_args(temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                        max_new_tokens: int = 0) -> None:
    """Raise UserError (a ValueError) naming the flag when a sampling setting cannot work."""
    if not temperature >= 0:  # also catches NaN
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top_k must be >= 1 (or 'none' for no top-k filtering), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise UserError(f"--top_p must be in (0, 1] (1 = no nucleus filtering), got {top_p}")
    if max_new_tokens < 0:
        raise UserError(f"--max_new_tokens must be >= 0, got {max_new_tokens}")


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """logits (..., V) -> the same with every token outside the top-k / nucleus set at -inf (a new tensor).

    top_k keeps exactly the k largest (ties broken by torch.topk's order, never more than k).  top_p keeps
    the smallest set of most probable tokens whose probabilities sum to >= top_p, and always the top token.
    Both given: top-k first, then top-p on what is left.
    """
    check_sampling_args(top_k=top_k, top_p=top_p)
    V = logits.size(-1)
    if top_k is not None and top_k < V:
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.topk(top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.double().softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
        # drop a token once the ones before it already reach top_p; the tolerance absorbs float rounding
        # (0.5 + 0.3 must count as reaching 0.8)
        drop_sorted = mass_before >= top_p - 1e-6
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) of the last position -> next token ids (B,).  temperature 0 = argmax."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float() / temperature, top_k, top_p)
    probs = logits.softmax(dim=-1)
    try:
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    except RuntimeError as e:
        if "inf" in str(e) or "nan" in str(e):
            raise ValueError("the model produced NaN/inf logits, so there is nothing to sample from; the "
                             "checkpoint's weights are broken (did training diverge?)") from None
        raise


# ---------------------------------------------------------------------------------------------------
# The generation loop


def refill_length(block_size: int) -> int:
    """Tokens kept when a full KV cache is re-filled: half the block, so a refill happens every
    ~block_size/2 steps and each new token still sees at least block_size/2 tokens of context."""
    return max(1, block_size // 2)


@torch.inference_mode()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, use_kv_cache: bool = True,
             stop_token: int | None = None, generator: torch.Generator | None = None,
             on_token: Callable[[torch.Tensor], object] | None = None,
             vocab_size: int | None = None) -> torch.Tensor:
    """idx (B, T) prompt ids -> (B, T + n) ids, n <= max_new_tokens.

    stop_token: a sequence that samples it is finished; later positions of it are padded with stop_token,
    and generation ends early once every sequence has finished.  on_token(new_ids (B,)) is called after
    every step (e.g. to stream text).  Pass a seeded torch.Generator to make sampling reproducible.
    vocab_size: sample only ids below it (a model vocabulary padded past the tokenizer's, e.g. 50304 > 50257).
    """
    check_sampling_args(temperature, top_k, top_p, max_new_tokens)
    if idx.dim() != 2 or idx.size(1) < 1:
        raise ValueError(f"idx must be (batch, tokens) with at least one token, got shape {tuple(idx.shape)}")
    device = model.lm_head.weight.device
    B, T0 = idx.shape
    block_size = model.config.block_size
    seq = torch.empty(B, T0 + max_new_tokens, dtype=torch.long, device=device)  # allocated once
    seq[:, :T0] = idx
    n = T0  # tokens in seq so far
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    cache = model.new_kv_cache(B) if use_kv_cache else None
    cached = 0  # positions in the cache: it holds seq[:, n - 1 - cached : n - 1] at positions 0..cached-1

    for step in range(max_new_tokens):
        if cache is None:  # full (cropped) context every step, as nanoGPT does
            logits = model(seq[:, max(0, n - block_size):n])[0][:, -1]
        elif step == 0 or cached == block_size:
            # (re)fill: prefill the last tokens at positions 0..; the prompt keeps up to block_size of them
            keep = min(n, block_size if step == 0 else refill_length(block_size))
            logits = model(seq[:, n - keep:n], kv_cache=cache, input_pos=0)[0][:, -1]
            cached = keep
        else:  # decode: one token at the next position
            logits = model(seq[:, n - 1:n], kv_cache=cache, input_pos=cached)[0][:, -1]
            cached += 1
        if vocab_size is not None:
            logits = logits[:, :vocab_size]
        next_ids = sample_next(logits, temperature, top_k, top_p, generator)
        if stop_token is not None:
            next_ids = next_ids.masked_fill(finished, stop_token)  # pad sequences that already stopped
            finished |= next_ids == stop_token
        seq[:, n] = next_ids
        n += 1
        if on_token is not None:
            on_token(next_ids)
        if stop_token is not None and bool(finished.all()):
            break
    return seq[:, :n]


# ---------------------------------------------------------------------------------------------------
# Command line


class TextStreamer:
    """Prints tokens as they arrive.  Byte-level / BPE tokens can end in the middle of a UTF-8 character,
    which decodes to U+FFFD: hold that tail back and decode it again with the tokens that follow."""

    def __init__(self, tokenizer: Tokenizer, out: TextIO, stop_token: int | None = None) -> None:
        self.tokenizer, self.out, self.stop_token = tokenizer, out, stop_token
        self.pending: list[int] = []  # tokens since the last clean character boundary
        self.printed = 0  # characters of decode(pending) already written
        self.stopped = False

    def push(self, ids: list[int]) -> None:
        for i in ids:
            if self.stopped or i == self.stop_token:
                self.stopped = True
                return
            self.pending.append(i)
        text = self.tokenizer.decode(self.pending)
        stable = text.rstrip("\ufffd")
        if len(stable) > self.printed:
            self.out.write(stable[self.printed:])
            self.out.flush()
            self.printed = len(stable)
        if len(stable) == len(text):  # ends on a whole character: start afresh (keeps decoding O(n))
            self.pending, self.printed = [], 0

    def flush(self) -> None:
        text = self.tokenizer.decode(self.pending) if self.pending else ""
        self.out.write(text[self.printed:])
        self.out.flush()
        self.pending, self.printed = [], 0


def decode_generated(tokenizer: Tokenizer, ids: list[int], stop_token: int | None) -> str:
    if stop_token is not None and stop_token in ids:
        ids = ids[:ids.index(stop_token)]
    return tokenizer.decode(ids)


def start_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The prompt's token ids; an empty prompt starts from end-of-text (BPE) or a newline (char/byte)."""
    if prompt:
        try:
            return tokenizer.encode(prompt)
        except UnknownCharactersError as e:
            shown = ", ".join(repr(c) for c in e.chars[:10]) + (", ..." if len(e.chars) > 10 else "")
            raise UserError(f"the prompt has {len(e.chars)} character(s) outside the model's char vocabulary: "
                            f"{shown}; a char-level model reads only the characters of its training text, "
                            "so remove or replace them") from None
    if tokenizer.eot_id is not None:
        return [tokenizer.eot_id]
    try:
        ids = tokenizer.encode("\n")
    except ValueError:  # a char vocabulary without a newline
        ids = []
    return ids or [0]


def _top_k_arg(value: str) -> int | None:
    return None if value.lower() in ("none", "off") else int(value)


_top_k_arg.__name__ = "int"  # argparse names the type in its error: "invalid int value: 'x'"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sample.py", description="Generate text from a minigpt checkpoint.")
    p.add_argument("--ckpt", default=None,
                   help="checkpoint file or run directory (default: the newest run under out/)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="", help="text to continue; '-' reads it from stdin (default: empty)")
    src.add_argument("--prompt-file", "--prompt_file", dest="prompt_file", default=None,
                     help="read the prompt from this file")
    p.add_argument("--num_samples", "--num-samples", type=int, default=1,
                   help="samples to draw, generated together as one batch (default 1)")
    p.add_argument("--max_new_tokens", "--max-new-tokens", type=int, default=500,
                   help="tokens to generate per sample (default 500; BPE models may stop earlier at end-of-text)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top_k", "--top-k", type=_top_k_arg, default=200,
                   help="sample from the k most likely tokens only (default 200; 'none' = all)")
    p.add_argument("--top_p", "--top-p", type=float, default=None, help="nucleus sampling, in (0, 1]")
    p.add_argument("--seed", type=int, default=1337, help="fixes sampling (default 1337)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, mps, or auto")
    p.add_argument("--attention", choices=ATTENTIONS, default=None,
                   help="attention implementation (default: the checkpoint's); all give the same output")
    p.add_argument("--no-kv-cache", "--no_kv_cache", dest="kv_cache", action="store_false",
                   help="recompute the whole context every step (slow; for comparison)")
    p.add_argument("--no-stop", "--no_stop", dest="stop", action="store_false",
                   help="do not stop at end-of-text (BPE models stop there by default)")
    return p


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available here; use --device cpu")
    try:
        torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r} is not a device; use cpu, cuda or auto") from None
    return name


def read_prompt(args: argparse.Namespace, stdin: TextIO) -> str:
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise UserError(f"prompt file not found: {path}")
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read prompt file {path}: {type(e).__name__}") from None
    if args.prompt == "-":
        return stdin.read()
    return args.prompt


def _main(argv: list[str] | None, stdout: TextIO, stdin: TextIO) -> None:
    args = build_parser().parse_args(argv)
    check_sampling_args(args.temperature, args.top_k, args.top_p, args.max_new_tokens)
    if args.num_samples < 1:
        raise UserError(f"--num_samples must be >= 1, got {args.num_samples}")
    device = resolve_device(args.device)
    prompt = read_prompt(args, stdin)

    model, tokenizer = load_model(args.ckpt, device=device, attention=args.attention)
    ids = start_ids(tokenizer, prompt)
    stop_token = tokenizer.eot_id if args.stop else None
    idx = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)

    if args.num_samples == 1:
        stream = TextStreamer(tokenizer, stdout, stop_token)
        stdout.write(prompt)
        stdout.flush()
        try:
            generate(model, idx, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                     use_kv_cache=args.kv_cache, stop_token=stop_token, generator=generator,
                     on_token=lambda t: stream.push(t.tolist()), vocab_size=tokenizer.vocab_size)
        finally:  # an error or Ctrl-C mid-stream still ends the line, so the message starts on its own line
            stream.flush()
            stdout.write("\n")
            stdout.flush()
        return
    out = generate(model, idx, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                   use_kv_cache=args.kv_cache, stop_token=stop_token, generator=generator,
                   vocab_size=tokenizer.vocab_size)
    for i, row in enumerate(out.tolist()):
        stdout.write(f"---------- sample {i + 1}/{args.num_samples} ----------\n")
        stdout.write(prompt + decode_generated(tokenizer, row[len(ids):], stop_token) + "\n")
    stdout.flush()


def main(argv: list[str] | None = None, stdout: TextIO | None = None, stdin: TextIO | None = None) -> None:
    """sample.py: user mistakes (bad flags, bad checkpoint, bad prompt) end in one 'error:' line, exit code 2."""
    out = stdout if stdout is not None else sys.stdout
    if stdout is None and hasattr(out, "reconfigure"):
        out.reconfigure(errors="replace")  # a model can emit characters the console cannot show
    run_cli(lambda: _main(argv, out, stdin if stdin is not None else sys.stdin))
