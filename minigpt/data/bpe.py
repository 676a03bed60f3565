"""`bpe:VOCAB`: a byte-level BPE trained on the corpus's training documents, never on its validation ones.

    split = plan_split(corpus, val_fraction)           # which documents (or which prefix) are training text
    tokenizer = train_bpe(corpus, split, vocab_size)   # an HFTokenizer; its tokenizer.json is transformers'

A tokenizer trained on the validation text would flatter the validation loss, so the split is decided first,
from the documents' lengths in characters (the token counts it is usually decided from do not exist yet), and
the token files then keep exactly that split (minigpt.data.token_files).  The BPE is Hugging Face `tokenizers`'
(Rust, multi-threaded, deterministic for the same text): GPT-2's byte-level pre-tokenization, so any text
encodes, and `<|endoftext|>` as its one special token, after each document as with the tiktoken encodings.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from minigpt.core.errors import DataError
from minigpt.core.tokenizers import BPE_SPECIALS, HFTokenizer, bpe_vocab_size, tokenizers_library
from minigpt.data.encoding import decoded_text
from minigpt.data.sources import Corpus, iter_documents
from minigpt.data.token_files import choose_val_docs, document_key, empty_corpus

__all__ = ["DocumentSplit", "plan_split", "train_bpe"]

# The trainer's time grows with the square of a word's length (one character repeated 10,000 / 20,000 / 40,000
# times: 0.05 / 0.21 / 0.86 s), so a corpus that is one long run (1 MB: ~9 minutes) does not finish.
# Runs of TRAINING_RUN characters or more without a space (or of spaces only) are given to the trainer in pieces of
# that length; such a 1 MB run then trains in 0.1 s.  Ordinary text has no such runs (GPT-2's regex splits words
# much shorter), so its merges are the same (150 stdlib files, 4 MB: the same bpe:4096, byte for byte).
TRAINING_RUN = 256
LONG_RUN = re.compile(rf"\S{{{TRAINING_RUN},}}|\s{{{TRAINING_RUN},}}")


def short_runs(text: str) -> Iterator[str]:
    """`text` as pieces for the trainer: its long runs (LONG_RUN) cut every TRAINING_RUN characters."""
    start = 0
    for run in LONG_RUN.finditer(text):
        if run.start() > start:
            yield text[start : run.start()]
        yield from (text[i : min(i + TRAINING_RUN, run.end())] for i in range(run.start(), run.end(), TRAINING_RUN))
        start = run.end()
    if start < len(text):
        yield text[start:]


@dataclass
class DocumentSplit:
    """The train/val split, decided before any token exists: whole documents (is_val, one flag per document in
    corpus order), or for a single document its first train_chars characters."""

    keys: np.ndarray  # each document's split key (document_key), to check the corpus did not change meanwhile
    is_val: np.ndarray | None = None
    train_chars: int | None = None


def plan_split(corpus: Corpus, val_fraction: float) -> DocumentSplit:
    """A first pass over the corpus: each document's length in characters, and the split they give (the same
    rule as the token split: whole documents for several, the first 1 - val_fraction of a single one)."""
    keys, chars = [], []
    for doc in iter_documents(corpus):
        keys.append(document_key(doc))
        chars.append(sum(len(text) for text in decoded_text(doc)))
    train_chars = int(chars[0] * (1 - val_fraction)) if len(keys) == 1 else None
    if not keys or train_chars in (0, chars[0]):  # no text at all, or a single document too short to split
        raise (
            empty_corpus(corpus)
            if not keys
            else DataError(
                f"corpus too small: {chars[0]} character(s), too few for a train/val split; use a larger corpus"
            )
        )
    keys_array = np.array(keys, dtype=np.uint64)
    if train_chars is not None:
        return DocumentSplit(keys_array, train_chars=train_chars)
    return DocumentSplit(keys_array, is_val=choose_val_docs(keys_array, np.array(chars, dtype=np.int64), val_fraction))


def training_texts(corpus: Corpus, split: DocumentSplit) -> Iterator[str]:
    """The text of the training documents (or of the single document's training prefix), chunk by chunk."""
    for i, doc in enumerate(iter_documents(corpus)):
        if split.is_val is not None and split.is_val[i]:
            continue
        left = split.train_chars
        for text in decoded_text(doc):
            if left is not None:
                text, left = text[:left], left - min(left, len(text))
            if text:
                yield text
            if left == 0:
                break


def train_bpe(corpus: Corpus, split: DocumentSplit, spec: str, quiet: bool = False) -> HFTokenizer:
    """The byte-level BPE of `spec` ("bpe:VOCAB") trained on the training text of `split`.  Refuses, in one line,
    a vocabulary the text cannot fill (fewer distinct merges than asked for)."""
    vocab_size = bpe_vocab_size(spec)
    tk = tokenizers_library()
    backend = tk.Tokenizer(tk.models.BPE())
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex
    backend.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BPE_SPECIALS),
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=not quiet and sys.stderr.isatty(),
    )  # its own bars, on a terminal
    started = time.perf_counter()
    chars = 0

    def counted() -> Iterator[str]:
        nonlocal chars
        for text in training_texts(corpus, split):
            chars += len(text)
            yield from short_runs(text)

    backend.train_from_iterator(counted(), trainer=trainer)
    got = backend.get_vocab_size()
    if got < vocab_size:  # (no training text at all fills no merge: then no smaller bpe:VOCAB helps)
        merges = got - 256 - len(BPE_SPECIALS)
        fix = f"ask for bpe:{got} or fewer, or give more text" if merges else "use a larger corpus"
        raise DataError(
            f"{spec}: the training text ({chars:,} characters) fills only {got} tokens ({merges} merges); {fix}"
        )
    if not quiet:
        print(
            f"data: trained {spec} on {chars / 1e6:.1f} M characters of training text in "
            f"{time.perf_counter() - started:.1f}s"
        )
    return HFTokenizer(backend.to_str(), name=spec, eos_id=backend.token_to_id(BPE_SPECIALS[0]))
