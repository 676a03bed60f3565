"""Small models and tokenizers that several test packages build (importable as `support`: pyproject's pytest
pythonpath puts tests/ on sys.path).  Fixtures shared between files live in conftest.py."""

from __future__ import annotations

import math

import tiktoken
import torch

from minigpt import GPT, GPTConfig


def varied_gpt(arch: str = "gpt", n_kv_head: int = 4, attention: str = "sdpa", vocab_size: int = 60,
               block_size: int = 32, seed: int = 0, **config: object) -> GPT:
    """A 2-layer, width-32 random GPT with larger-than-init weights, in eval mode: its greedy output varies from
    token to token, so a cache that fed wrong positions or keys would change it (at init scale greedy repeats one
    token)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(arch=arch, n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=32, block_size=block_size,
                          vocab_size=vocab_size, attention=attention, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
            elif p.dim() >= 2:
                p.normal_(0, 2 / math.sqrt(p.shape[-1]))
    return model.eval()


def byte_bpe() -> tiktoken.Encoding:
    """A tiktoken byte-level BPE with no merges and an end-of-text token 256, built in-process (no download)."""
    return tiktoken.Encoding("tiny-bpe", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                             special_tokens={"<|endoftext|>": 256})


def random_ids(batch: int = 2, length: int = 5, vocab: int = 60, seed: int = 1) -> torch.Tensor:
    """(batch, length) token ids below vocab, the same for a seed."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
