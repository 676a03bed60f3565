"""The interface every tokenizer implements (minigpt.core.tokenizers: char, byte, tiktoken; minigpt.core.hf_tokenizer:
a Hugging Face tokenizer.json)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["ENDOFTEXT", "IncrementalDecoder", "Tokenizer", "decode_after"]

ENDOFTEXT = "<|endoftext|>"


class Tokenizer(ABC):
    """What the data pipeline, the trainer and the sampler need from a tokenizer."""

    name: str
    vocab_size: int
    eot_id: int | None  # appended after each document when not None
    end_ids: tuple[int, ...] = ()  # the ids that end a text besides eot_id (a HF folder's generation_config)

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """Plain str/int/list/dict only, enough to rebuild the tokenizer with tokenizer_from_dict."""

    def encode_text(self, text: str) -> list[int]:
        """A text of its own (a prompt to continue), with the start token the tokenizer writes before one (Llama's
        <s>); a chat tokenizer's encode leaves it out, as its template writes its own."""
        return self.encode(text)

    def decode_text(self, ids: Sequence[int]) -> str:
        """The text the ids stand for, without the tokens that stand for none (`textless`), as transformers'
        decode(..., skip_special_tokens=True) gives it."""
        textless = self.textless
        return self.decode([i for i in ids if i not in textless])

    @property
    def textless(self) -> frozenset[int]:
        """The ids that stand for no text: end-of-text here; a Hugging Face tokenizer's special tokens, but for those
        of one character; a chat tokenizer's markers.  decode_text and the text of a reply or a server's completion
        (IncrementalDecoder) leave them out, as transformers, vLLM and llama.cpp's server do."""
        return frozenset() if self.eot_id is None else frozenset({self.eot_id})

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids that end a generation: end-of-text (a chat's end of turn) and the source's other ends (a Hugging
        Face folder's generation_config eos_token_id), as transformers' generate stops at any of them."""
        return frozenset(i for i in (self.eot_id, *self.end_ids) if i is not None)

    def encode_array(self, text: str) -> np.ndarray:
        """encode() as an int64 array; subclasses override it with something faster."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_batch(self, texts: list[str], num_threads: int | None = None) -> list[np.ndarray]:
        return [self.encode_array(t) for t in texts]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


# ids of the text before a continuation decoded with it: a decoder may read back a few ids (SentencePiece's space,
# byte fallback's pieces of one character), never this many
CONTEXT_IDS = 6


def decode_after(tokenizer: Tokenizer, context: Sequence[int], ids: Sequence[int]) -> str:
    """The text `ids` add after `context` (a completion's prompt): decode(context + ids) less decode(context).  A
    SentencePiece decoder drops the space at the start of what it decodes, so ids decoded alone would lose the
    space a continuation starts with."""
    tail = list(context[-CONTEXT_IDS:])
    return tokenizer.decode(tail + list(ids))[len(tokenizer.decode(tail)) if tail else 0 :]


class IncrementalDecoder:
    """The text of ids that arrive one at a time: push(id) -> the text it adds, finish() -> the rest.  Each push
    decodes a window of the last few ids, not the whole text again (a long reply costs O(1) a token, not O(n)): the
    window starts where the previous piece did, so the decoder sees the ids before the new ones (SentencePiece's
    space, byte fallback's pieces of a character).  A piece never ends inside a UTF-8 character: a token that does
    (U+FFFD) waits for the one that completes it; finish() gives what is left, such a tail included.  `context`:
    ids already shown before these (a completion's prompt), as decode_after reads them.  A token that stands for no
    text (tokenizer.textless: a marker such as <|im_start|> that a small model writes mid-reply) adds none, as
    skip_special_tokens=True decodes it, unless keep_special (sample.py's raw continuation).  Joined, the pieces and
    finish() are decode_after(tokenizer, context, ids less those tokens): a reply's text is decode_text(ids)."""

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = (), keep_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.textless = frozenset() if keep_special else tokenizer.textless
        self.ids = list(context[-CONTEXT_IDS:])  # the window decoded at each push
        self.read = len(self.ids)  # the window's ids before this are given out already (or the context's)
        self.shown = tokenizer.decode(self.ids) if self.ids else ""  # decode(ids[:read])

    def push(self, token: int) -> str:
        if token in self.textless:
            return ""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if len(text) <= len(self.shown) or text.endswith("\ufffd"):
            return ""  # nothing yet, or a character still incomplete
        piece = text[len(self.shown) :]
        del self.ids[: self.read]  # the next window starts at this piece's first id
        self.read = len(self.ids)
        self.shown = self.tokenizer.decode(self.ids)
        return piece

    def finish(self) -> str:
        return self.tokenizer.decode(self.ids)[len(self.shown) :] if self.ids else ""
