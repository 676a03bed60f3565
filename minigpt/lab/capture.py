"""Attention lab, part 1: capture every layer's and head's attention weights for a prompt, and measure each head.

    tokens, weights = attention_maps(model, tokenizer, "def f(x):")   # weights: (L, H, T, T), rows sum to 1
    capture = capture_attention(model, tokenizer, "def f(x):")       # + per-head metrics, ids, config

The weights come from `GPT.attention_weights`, which forms them through the manual path whatever path the
model runs.  The per-head metrics help find the heads worth looking at:

- entropy: how spread out a query's attention is (nats; 0 = all on one token, ln(t+1) = uniform);
- mean distance: how far back a query looks on average, in tokens;
- first token: weight on position 0 (an "attention sink");
- previous token: weight on position t-1 (previous-token heads);
- induction: run on a random sequence repeated twice, [r, r]; from position i of the second copy, the weight
  on the token after the previous occurrence of token i (position i - len(r) + 1).  Induction heads score
  near 1, other heads near 1/i.

Rendering lives elsewhere: minigpt.lab.html (the page), minigpt.lab.figures (PNGs).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from minigpt.core.config import GPTConfig
from minigpt.core.errors import UserError
from minigpt.core.generation import prompt_ids
from minigpt.core.model import GPT
from minigpt.core.tokenizer_base import CONTEXT_IDS, decode_after
from minigpt.core.tokenizers import Tokenizer

__all__ = [
    "AttentionCapture",
    "attention_maps",
    "capture_attention",
    "head_metrics",
    "induction_scores",
    "induction_length",
    "lab_prompt_ids",
    "save_npz",
    "METRICS",
]

# name -> (column title, one-line meaning): the order of the page's table
METRICS: dict[str, tuple[str, str]] = {
    "entropy": ("entropy", "mean entropy of a query's attention, in nats (low = focused)"),
    "distance": ("mean distance", "mean number of tokens back a query looks"),
    "first": ("first token", "mean weight on the first token (attention sink)"),
    "previous": ("previous token", "mean weight on the previous token"),
    "induction": (
        "induction",
        "on a repeated random sequence, mean weight on the token after the previous occurrence of the current token",
    ),
}


# The (L, H, T, T) float32 weights a capture holds: a TinyLlama shape (22 x 32 heads) over 1,900 tokens is 10 GB
WEIGHTS_BUDGET = 2 * 2**30


def lab_prompt_ids(tokenizer: Tokenizer, text: str, config: GPTConfig) -> list[int]:
    """The prompt's ids, or a UserError naming the problem: empty, too long for the model or for the weights'
    memory budget, characters the vocabulary lacks, or ids the model lacks (another model's tokenizer)."""
    if not text:
        raise UserError("the prompt is empty; give some text with --prompt, --prompt-file or --prompt - (stdin)")
    ids = prompt_ids(tokenizer, text)  # unknown characters: the same one-line error as sample.py
    if (high := max(ids, default=0)) >= config.vocab_size:  # another model's tokenizer: not an IndexError deep inside
        raise UserError(
            f"token id {high} is outside the model's vocabulary (0 to {config.vocab_size - 1}); "
            "use the model's own tokenizer"
        )
    heads = config.n_layer * config.n_head
    fits = min(config.block_size, math.isqrt(WEIGHTS_BUDGET // (heads * 4)))  # refused, not approximated
    if len(ids) > fits:
        why = (
            f" but the model reads at most block_size={config.block_size}"
            if len(ids) > config.block_size
            else f": its attention weights ({config.n_layer} layers x {config.n_head} heads x {len(ids)}^2 floats) "
            f"would "
            f"take {heads * len(ids) ** 2 * 4 / 2**30:.1f} GiB, over the lab's {WEIGHTS_BUDGET / 2**30:.0f} GiB"
        )
        raise UserError(f"the prompt is {len(ids)} tokens{why}; shorten it to {fits} tokens or fewer")
    return ids


def token_strings(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """Each token's text: what it adds after the tokens before it (a SentencePiece piece decoded alone loses its
    space: "▁world" would show "world").  Tokens that each hold part of a multi-byte character (byte-level BPE, byte
    fallback) would each show U+FFFD, so each shows the text they make together and its part: "é(1/2)", "é(2/2)"."""
    strings, i = [], 0
    while i < len(ids):
        piece = tokenizer.decode([ids[i]])
        if "\ufffd" not in piece:  # a whole token: decoded after the ones before it, for its leading space
            piece = decode_after(tokenizer, ids[max(0, i - CONTEXT_IDS) : i], ids[i : i + 1])
        # UTF-8 characters are at most 4 bytes, so at most 4 tokens make one up
        spans = (tokenizer.decode(ids[i:j]) for j in range(i + 2, min(i + 4, len(ids)) + 1))
        whole = "\ufffd" in piece and next(((j, t) for j, t in enumerate(spans, 2) if "\ufffd" not in t), None)
        if not whole:  # a whole token, or bytes that make no character (an invalid byte, a character cut off)
            strings.append(piece)
            i += 1
            continue
        n, text = whole
        strings += [f"{text}({k}/{n})" for k in range(1, n + 1)]
        i += n
    return strings


def _weights(model: GPT, ids: list[int]) -> torch.Tensor:
    idx = torch.tensor([ids], dtype=torch.long, device=model.lm_head.weight.device)
    return model.attention_weights(idx)[:, 0].cpu()  # (L, H, T, T)


def attention_maps(model: GPT, tokenizer: Tokenizer, text: str) -> tuple[list[str], torch.Tensor]:
    """(model, tokenizer, text) -> (tokens, weights): the text's tokens as strings and every layer's and head's
    attention weights, float32 (L, H, T, T); row t holds query t's weights over keys 0..t."""
    ids = lab_prompt_ids(tokenizer, text, model.config)
    return token_strings(tokenizer, ids), _weights(model, ids)


# ---------------------------------------------------------------------------------------------------
# Per-head metrics, on weights (..., T, T)


def head_metrics(weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """weights (..., T, T) -> entropy, distance, first, previous: each (...), averaged over the queries 1..T-1
    (query 0 can only look at itself, so it would pull every head towards "focused on the first token")."""
    w = weights.float()
    T = w.size(-1)
    rows = slice(1, None) if T > 1 else slice(None)
    pos = torch.arange(T, dtype=torch.float32)
    entropy = -(w * w.clamp_min(1e-12).log()).sum(-1)  # (..., T)
    distance = (w * (pos[:, None] - pos[None, :]).clamp_min(0)).sum(-1)  # (..., T)
    first = w[..., :, 0]
    previous = torch.zeros_like(first)
    if T > 1:
        previous[..., 1:] = torch.diagonal(w, offset=-1, dim1=-2, dim2=-1)
    return {
        name: m[..., rows].mean(-1)
        for name, m in (("entropy", entropy), ("distance", distance), ("first", first), ("previous", previous))
    }


def induction_length(block_size: int) -> int:
    """Length of the random sequence r that is repeated: min(block_size // 2, 50); 0 if the block is too short."""
    n = min(block_size // 2, 50)
    return n if n >= 2 else 0


def induction_scores(weights: torch.Tensor, n: int) -> torch.Tensor:
    """weights (..., 2n, 2n) of a sequence [r, r] with len(r) = n -> (...): the mean weight from each position i
    of the second copy to position i - n + 1, the token that followed token i's first occurrence."""
    i = torch.arange(n, 2 * n)
    return weights[..., i, i - n + 1].float().mean(-1)


def random_repeated_ids(tokenizer: Tokenizer, n: int, seed: int = 0) -> list[int]:
    """[r, r] for n random token ids r (never the end-of-text token); the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    high = tokenizer.vocab_size - (1 if tokenizer.eot_id is not None else 0)
    r = torch.randint(0, high, (n,), generator=g)
    if tokenizer.eot_id is not None:
        r[r >= tokenizer.eot_id] += 1  # skip eot: a document boundary would reset what the model attends to
    return r.tolist() * 2


# ---------------------------------------------------------------------------------------------------
# One capture: what the page, the figures and the .npz are made from


@dataclass
class AttentionCapture:
    tokens: list[str]
    ids: list[int]
    weights: torch.Tensor  # float32 (L, H, T, T)
    metrics: dict[str, torch.Tensor]  # name -> (L, H); induction is NaN when block_size < 4
    config: dict = field(default_factory=dict)  # the model's GPTConfig as a dict
    induction_tokens: int = 0  # len(r) of the induction run

    @property
    def n_layer(self) -> int:
        return self.weights.size(0)

    @property
    def n_head(self) -> int:
        return self.weights.size(1)

    @property
    def kv_group(self) -> int:
        """Query heads per key/value head (1 without GQA): query head h reads key/value head h // kv_group."""
        return self.n_head // int(self.config.get("n_kv_head") or self.n_head)


def capture_attention(model: GPT, tokenizer: Tokenizer, text: str, seed: int = 0) -> AttentionCapture:
    """Run the prompt once and the repeated random sequence once; every layer's and head's weights and metrics."""
    ids = lab_prompt_ids(tokenizer, text, model.config)
    weights = _weights(model, ids)
    metrics = head_metrics(weights)
    n = induction_length(model.config.block_size)
    if n:
        metrics["induction"] = induction_scores(_weights(model, random_repeated_ids(tokenizer, n, seed)), n)
    else:
        metrics["induction"] = torch.full(weights.shape[:2], float("nan"))
    return AttentionCapture(
        tokens=token_strings(tokenizer, ids),
        ids=ids,
        weights=weights,
        metrics=metrics,
        config=asdict(model.config),
        induction_tokens=n,
    )


def save_npz(capture: AttentionCapture, path: str | Path) -> Path:
    """weights float32 (L, H, T, T), ids, tokens, the metrics (L, H) each, and the config as JSON text."""
    path = Path(path)
    np.savez_compressed(
        path,
        weights=capture.weights.numpy().astype(np.float32),
        ids=np.asarray(capture.ids, dtype=np.int64),
        tokens=np.asarray(capture.tokens, dtype=str),
        config=np.asarray(json.dumps(capture.config)),
        **{f"metric_{k}": v.numpy() for k, v in capture.metrics.items()},
    )
    return path
