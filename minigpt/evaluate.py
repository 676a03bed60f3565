"""Exact evaluation: the mean loss over every token of a split or a text, not an estimate from random windows.

    python eval.py --ckpt out/default --text some.txt      # nats per token and bits per character
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from minigpt.errors import UserError, run_cli
from minigpt.model import GPT


@torch.inference_mode()
def evaluate_tokens(model: GPT, tokens: np.ndarray | torch.Tensor, batch_size: int = 32,
                    device: str | torch.device | None = None) -> tuple[float, int]:
    """(total negative log-likelihood in nats, number of predicted tokens) over the whole sequence.

    The sequence is cut into consecutive windows of block_size + 1 tokens that overlap by one, so every token
    after the first is predicted exactly once, with the context since its window began.
    """
    T = model.config.block_size
    device = device or next(model.parameters()).device
    tokens = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    n = len(tokens) - 1  # predictions
    if n < 1:
        raise UserError("nothing to evaluate: the text has fewer than 2 tokens; use a longer text")

    def nll(starts: list[int], size: int) -> float:
        x = torch.stack([tokens[s:s + size] for s in starts]).to(device)  # (B, size)
        y = torch.stack([tokens[s + 1:s + size + 1] for s in starts]).to(device)
        logits, _ = model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()

    was_training = model.training
    model.eval()
    full = list(range(0, n - T + 1, T))  # windows with T predictions each
    total = sum(nll(full[i:i + batch_size], T) for i in range(0, len(full), batch_size))
    rest = n - len(full) * T
    if rest:
        total += nll([len(full) * T], rest)
    model.train(was_training)
    return total, n


def main(argv: list[str] | None = None) -> None:
    from minigpt.sampling import load_model  # the same checkpoint loader sample.py uses

    parser = argparse.ArgumentParser(description="Evaluate a checkpoint on a text file: nats/token, bits/char.")
    parser.add_argument("--ckpt", default=None, help="checkpoint file or run directory (default: newest run)")
    parser.add_argument("--text", required=True, help="text file to evaluate on")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    path = Path(args.text)
    if not path.is_file():
        raise UserError(f"text file not found: {path}; pass an existing --text file")
    text = path.read_text(encoding="utf-8", errors="strict")
    model, tokenizer = load_model(args.ckpt, device=args.device)
    tokens = tokenizer.encode(text)
    nats, n = evaluate_tokens(model, tokens, args.batch_size)
    # bits per character counts every character after the first token's, the ones that were predicted
    predicted_chars = max(1, len(text) - len(tokenizer.decode(tokens[:1])))
    print(f"{path}: {n:,} tokens, {nats / n:.4f} nats/token, {nats / math.log(2) / predicted_chars:.4f} bits/char")


def entry() -> None:
    run_cli(main)
