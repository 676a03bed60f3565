"""The serve engine on the GPU: continuous batching (6 requests in 4 rows, some joining mid-way) decodes exactly
what generate() gives each prompt alone, for a llama block with GQA and a gpt block."""

from __future__ import annotations

import threading

import pytest
import torch

from minigpt.core.generation import generate
from minigpt.core.tokenizers import CharTokenizer
from minigpt.serve.engine import Engine, Request
from support import varied_gpt

CHARS = "\n !',.:;?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXY"
PROMPTS = ["hello there", "what is two plus two?", "a", "the cat sat on the mat, and then", "why", "Good day!"]
LENGTHS = [30, 50, 12, 40, 60, 25]


@pytest.mark.parametrize("arch, n_kv_head", [("llama", 2), ("gpt", 4)])
def test_batched_greedy_decoding_equals_generate_alone(cuda, arch, n_kv_head):
    tok = CharTokenizer(CHARS)
    model = varied_gpt(arch, n_kv_head=n_kv_head, vocab_size=tok.vocab_size, block_size=128).to(cuda)
    alone = [
        tok.decode(generate(model, torch.tensor([tok.encode(p)], device=cuda), n, temperature=0)[0, len(p) :].tolist())
        for p, n in zip(PROMPTS, LENGTHS)
    ]
    got, errors = [""] * len(PROMPTS), []
    done = [threading.Event() for _ in PROMPTS]

    def on_update(i: int):
        def update(u) -> None:
            got[i] += u.text
            if u.error:
                errors.append(u.error)
            if u.finish_reason is not None:
                done[i].set()

        return update

    engine = Engine(model, tok, max_batch=4, max_queue=16)
    engine.start()
    try:
        for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
            engine.submit(Request(prompt=tok.encode(p), max_tokens=n, temperature=0), on_update(i))
        assert all(e.wait(timeout=120) for e in done)
    finally:
        engine.stop()
    assert errors == [] and got == alone
