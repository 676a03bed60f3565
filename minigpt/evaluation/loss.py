"""Exact evaluation: the mean loss over every token of a split or a text, not an estimate from random windows.

Used at the end of training (the whole validation split) and by `eval.py` (minigpt/cli/eval.py) on a text file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from minigpt.core.config import GPTConfig
from minigpt.core.errors import UnknownCharactersError, UserError
from minigpt.core.model import GPT
from minigpt.core.tokenizer_base import Tokenizer
from minigpt.core.tokenizers import ByteTokenizer

# Bytes one batch's scoring may hold on a CPU: a GPT-2 shape (50,257 x 1024 per window) at batch 32 would take
# 6.6 GB for the logits alone, 13 GB with the loss's copies.  Fewer windows at once change the speed, not the result.
MEMORY_BUDGET = 512 * 2**20


def memory_budget(device: torch.device) -> int:
    """MEMORY_BUDGET, or on a GPU a quarter of its free memory if that is more: a small model's batches there are
    launches, not compute, and its full-split evaluation wants them large (the GPU recipe's val_batch_size 640)."""
    if device.type != "cuda":
        return MEMORY_BUDGET
    free, _ = torch.cuda.mem_get_info(device)
    return max(MEMORY_BUDGET, free // 4)


def bytes_per_token(config: GPTConfig) -> int:
    """Float32 bytes a scored token holds at a forward pass's peak (no gradients): its logits three times (the
    loss's float copy and log-softmax), a layer's activations (the residual and norms, q/k/v, the MLP's hidden) and,
    on the manual and einops paths, its row of every head's attention weights.  Counting the logits alone, a
    char-vocabulary model took thousands of windows at once: 4 GB where 16 windows took 0.5 GB, and were faster."""
    weights = config.n_head * config.block_size if config.attention != "sdpa" else 0
    return 4 * (3 * config.vocab_size + 6 * config.n_embd + 2 * config.mlp_hidden + weights)


def windows_per_batch(model: GPT, batch_size: int | None = None) -> int:
    """batch_size, or fewer: as many block_size windows as keep their scoring within memory_budget."""
    budget = memory_budget(model.lm_head.weight.device)
    fits = max(1, budget // (model.config.block_size * bytes_per_token(model.config)))
    return fits if batch_size is None else min(batch_size, fits)


@torch.inference_mode()
def evaluate_tokens(
    model: GPT,
    tokens: np.ndarray | torch.Tensor,
    batch_size: int | None = None,
    device: str | torch.device | None = None,
) -> tuple[float, int]:
    """(total negative log-likelihood in nats, number of predicted tokens) over the whole sequence.

    The sequence is cut into consecutive windows of block_size + 1 tokens that overlap by one, so every token
    after the first is predicted exactly once, with the context since its window began.  Up to batch_size windows
    run at once (None: as many as the logits budget allows; never more): the speed changes, not the result.
    """
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise UserError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    batch_size = windows_per_batch(model, batch_size)
    T = model.config.block_size
    device = device or next(model.parameters()).device
    tokens = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    n = len(tokens) - 1  # predictions
    if n < 1:
        raise UserError("nothing to evaluate: the text has fewer than 2 tokens; use a longer text")
    if int(tokens.min()) < 0 or int(tokens.max()) >= model.config.vocab_size:
        raise UserError(
            f"token ids from {int(tokens.min())} to {int(tokens.max())} are not all in the model's vocabulary (0 to "
            f"{model.config.vocab_size - 1}); encode the text with the model's own tokenizer"
        )

    def nll(starts: list[int], size: int) -> float:
        x = torch.stack([tokens[s : s + size] for s in starts]).to(device)  # (B, size)
        y = torch.stack([tokens[s + 1 : s + size + 1] for s in starts]).to(device)
        logits, _ = model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()

    was_training = model.training
    model.eval()
    try:
        full = list(range(0, n - T + 1, T))  # windows with T predictions each
        total = sum(nll(full[i : i + batch_size], T) for i in range(0, len(full), batch_size))
        rest = n - len(full) * T
        if rest:
            total += nll([len(full) * T], rest)
    finally:
        model.train(was_training)
    return total, n


def text_ids(tokenizer: Tokenizer, text: str, what: str) -> list[int]:
    """The ids of a text to score (eval.py's --text, a harness task's text): characters a char vocabulary lacks are
    one error, naming `what`."""
    try:
        return tokenizer.encode(text)
    except UnknownCharactersError as e:
        raise e.about(what, "a char-level model can only score text made of its training text's characters") from None


def bits_per_char_and_byte(nats: float, tokenizer: Tokenizer, ids: Sequence[int] | np.ndarray) -> tuple[float, float]:
    """The loss `nats` over `ids` in bits per character and per UTF-8 byte of the text they stand for: units every
    tokenizer shares, so runs with different tokenizers compare.  The first token is never predicted, so its text is
    not counted; end-of-text tokens are predicted but stand for no text, nor do a tokenizer.json's other special
    tokens (the start token its post-processor puts before each document: `<s>`, `<|begin_of_text|>`)."""
    ids = [int(i) for i in ids]
    text, first = tokenizer.decode_text(ids), tokenizer.decode_text(ids[:1])
    if not text.startswith(first):  # a byte-level first token that is part of a character: at least one byte
        first_chars, first_bytes = 0, 1
    else:
        first_chars, first_bytes = len(first), len(first.encode("utf-8"))
    chars, utf8 = max(1, len(text) - first_chars), max(1, len(text.encode("utf-8")) - first_bytes)
    if isinstance(tokenizer, ByteTokenizer):  # its ids are the bytes, UTF-8 or not (decoded, a bad byte is 3: U+FFFD)
        utf8 = max(1, sum(i != tokenizer.eot_id for i in ids[1:]))
    return nats / math.log(2) / chars, nats / math.log(2) / utf8
