"""The serve tests' fixtures: a tiny random chat model and base model (tests/support.py's varied_gpt)."""

from __future__ import annotations

import pytest
from serve_support import BLOCK, CHARS

from minigpt import GPT
from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.tokenizers import CharTokenizer
from support import varied_gpt


@pytest.fixture(scope="session")
def chat_model() -> tuple[GPT, ChatTokenizer]:
    """Llama blocks with grouped-query attention, a char vocabulary and the ChatML template."""
    tokenizer = ChatTokenizer.for_base(CharTokenizer(CHARS))
    return varied_gpt("llama", n_kv_head=2, vocab_size=tokenizer.vocab_size, block_size=BLOCK), tokenizer


@pytest.fixture(scope="session")
def base_model() -> tuple[GPT, CharTokenizer]:
    """GPT-2 blocks (learned positions), a char vocabulary, no chat template."""
    return varied_gpt("gpt", vocab_size=len(CHARS), block_size=BLOCK, seed=1), CharTokenizer(CHARS)
