"""The interface every tokenizer implements (minigpt.core.tokenizers: char, byte, tiktoken; minigpt.core.hf_tokenizer:
a Hugging Face tokenizer.json)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["ENDOFTEXT", "Tokenizer"]

ENDOFTEXT = "<|endoftext|>"


class Tokenizer(ABC):
    """What the data pipeline, the trainer and the sampler need from a tokenizer."""

    name: str
    vocab_size: int
    eot_id: int | None  # appended after each document when not None

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """Plain str/int/list/dict only, enough to rebuild the tokenizer with tokenizer_from_dict."""

    def encode_array(self, text: str) -> np.ndarray:
        """encode() as an int64 array; subclasses override it with something faster."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_batch(self, texts: list[str], num_threads: int | None = None) -> list[np.ndarray]:
        return [self.encode_array(t) for t in texts]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"
