"""Encoding: a corpus's documents as a stream of token arrays, a chunk at a time (bounded memory).

    stats = ReadStats(hashlib.sha256())
    for doc, ids in document_tokens(tokenizer, corpus, stats, num_threads=None):
        ...  # ids: an array of token ids of `doc`, or None once `doc` has ended

Documents are decoded from UTF-8 incrementally (strictly for the char tokenizer, whose vocabulary must be exact;
with U+FFFD replacements for BPE, as tiktoken decodes), cut where a BPE cannot merge across, and encoded in
batches so BPE uses several threads. The byte tokenizer takes the raw bytes as ids, without decoding.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from minigpt.core.errors import DataError, UnknownCharactersError, shown_chars
from minigpt.core.hf_tokenizer import HFTokenizer
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer, TiktokenTokenizer, Tokenizer
from minigpt.data.sources import Corpus, Document, iter_documents

__all__ = ["CUT", "ReadStats", "char_vocabulary", "decoded_text", "document_tokens"]

BATCH_CHARS = 8 << 20  # BPE encodes this much text per call, split across threads
MAX_CARRY_CHARS = 16 << 20  # text with no BPE-safe cut point is cut anyway past this (bounded memory)
# a tokenizer.json whose safe cut points are unknown (SentencePiece's) reads a document whole up to this many
# characters (a book); past it the text is cut after a newline, its ids there a token or so off the whole text's.
# Longer pieces cost memory: a 100 MB document peaked at 1.35 GB (2M), 2.05 GB (4M), 3.4 GB (16M)
WHOLE_CHARS = 2 << 20
CUT = object()  # in place of token ids: a document's text so far is its training text (see document_tokens)
_REPLACED = [0]  # bytes that were not UTF-8, replaced by U+FFFD so far (counted by the error handler below)


def _replace_counted(e: UnicodeError) -> tuple[str, int]:
    """Python's "replace" for decoding (one U+FFFD per invalid sequence), counting the bytes it replaces."""
    assert isinstance(e, UnicodeDecodeError)
    _REPLACED[0] += e.end - e.start
    return "\ufffd", e.end


codecs.register_error("minigpt-replace-counted", _replace_counted)


@dataclass
class ReadStats:
    """What is counted while the documents are read: the content hash (all documents' bytes, in order) and sizes."""

    content: Any  # a hashlib hash object
    num_bytes: int = 0
    num_chars: int | None = 0  # None for the byte tokenizer, which never decodes the text
    invalid_utf8_bytes: int = 0  # bytes that were not UTF-8, read as U+FFFD (BPE)
    invalid_utf8_in: str | None = None  # the first document that had any

    def read(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            self.content.update(chunk)
            self.num_bytes += len(chunk)
            yield chunk


def char_vocabulary(corpus: Corpus) -> CharTokenizer:
    """The char tokenizer of a corpus, whose vocabulary is the set of its characters: a first pass over it."""
    chars: set[str] = set()
    for doc in iter_documents(corpus):
        for text in _decode(doc.chunks, doc.name, strict=True):
            chars.update(text)
    return CharTokenizer("".join(chars))


def document_tokens(
    tok: Tokenizer, corpus: Corpus, stats: ReadStats, num_threads: int | None, cut_chars: int | None = None
) -> Iterator[tuple[Document, Any]]:
    """(document, token ids) for each piece of each document, in order, then (document, None) at its end.
    Counts what it reads into `stats`; num_threads: BPE encoding threads (None: all cores).  cut_chars (a single
    document's planned training text, minigpt.data.bpe): the text is cut there, encoded on each side separately,
    and (document, CUT) marks the cut."""
    tokens = _encode(tok, _pieces(tok, corpus, stats, cut_chars), num_threads)
    return _framed_once(tokens, *map(len, tok.frame)) if isinstance(tok, HFTokenizer) else tokens


def decoded_text(doc: Document) -> Iterator[str]:
    """A document's text as BPE reads it (invalid UTF-8 replaced), chunk by chunk."""
    return _decode(doc.chunks, doc.name, strict=False)


def _pieces(tok: Tokenizer, corpus: Corpus, stats: ReadStats, cut_chars: int | None) -> Iterator[tuple[Document, Any]]:
    """(document, text or bytes to encode) for each piece of each document, then (document, None) at its end."""
    for doc in iter_documents(corpus):
        raw = stats.read(doc.chunks)
        if isinstance(tok, ByteTokenizer):
            yield from ((doc, b) for b in raw)  # raw bytes: any file is fine, nothing to decode
        else:
            texts = _decode(raw, doc.name, strict=isinstance(tok, CharTokenizer), stats=stats)
            if isinstance(tok, TiktokenTokenizer) or (isinstance(tok, HFTokenizer) and tok.cuts_as_tiktoken):
                texts = _bpe_safe_pieces(texts)
            elif isinstance(tok, HFTokenizer):  # cut points unknown (SentencePiece adds a space to each piece): whole
                texts = _bpe_safe_pieces(texts, safe_cut=_past_whole_chars)
            left = cut_chars
            for text in texts:
                stats.num_chars += len(text)
                if left is not None and left <= len(text):  # the cut falls in this piece
                    if text[:left]:
                        yield doc, text[:left]
                    yield doc, CUT
                    text, left = text[left:], None
                elif left is not None:
                    left -= len(text)
                if text:
                    yield doc, text
        yield doc, None


def _encode(
    tok: Tokenizer, pieces: Iterator[tuple[Document, str | bytes | None]], num_threads: int | None
) -> Iterator[tuple[Document, np.ndarray | None]]:
    """Token arrays for the pieces, in order. Text is encoded in batches so BPE can use several threads."""
    batch: list[tuple[Document, str | bytes | None]] = []
    size = 0

    def flush() -> Iterator[tuple[Document, np.ndarray | None]]:
        texts = [p for _, p in batch if isinstance(p, str)]
        try:
            encoded = iter(tok.encode_batch(texts, num_threads) if texts else [])
        except UnknownCharactersError as e:  # a char tokenizer read from a file: its vocabulary is fixed
            doc = next(d for d, p in batch if isinstance(p, str) and any(c in p for c in e.chars))
            raise DataError(
                f"{doc.name} has {len(e.chars)} character(s) not in the char tokenizer's vocabulary: "
                f"{shown_chars(e.chars)}; remove them, use a char tokenizer made from text that has "
                "them, or the byte tokenizer, which encodes any text"
            ) from None
        for doc, p in batch:
            if p is None or p is CUT:
                yield doc, p
            elif isinstance(p, bytes):
                yield doc, np.frombuffer(p, dtype=np.uint8)  # byte tokenizer: the bytes are the ids
            else:
                yield doc, next(encoded)

    for doc, piece in pieces:
        batch.append((doc, piece))
        size += len(piece) if isinstance(piece, (str, bytes)) else 0
        if size >= BATCH_CHARS:
            yield from flush()
            batch, size = [], 0
    yield from flush()


def _decode(chunks: Iterable[bytes], name: str, strict: bool, stats: ReadStats | None = None) -> Iterator[str]:
    """UTF-8 text, chunk by chunk. strict (char): invalid UTF-8 is an error (the vocabulary would be wrong); else
    (BPE) replaced by U+FFFD, as tiktoken itself decodes, so one bad byte does not stop a long preparation: counted
    into stats (a Latin-1 file loses every accented letter: said once the preparation ends)."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict" if strict else "minigpt-replace-counted")
    offset, replaced = 0, _REPLACED[0]
    try:
        for chunk in chunks:
            if text := decoder.decode(chunk):
                yield text
            offset += len(chunk)
        if text := decoder.decode(b"", final=True):
            yield text
        if stats is not None and _REPLACED[0] > replaced:
            stats.invalid_utf8_bytes += _REPLACED[0] - replaced
            stats.invalid_utf8_in = stats.invalid_utf8_in or name
    except UnicodeDecodeError as e:
        raise DataError(
            f"{name} is not UTF-8 text (near byte {offset + e.start}); use the byte tokenizer "
            "(tokenizer: byte), which reads any file"
        ) from None


def _bpe_safe_pieces(
    chunks: Iterable[str], max_carry: int | None = None, safe_cut: Callable[[str, int], int] | None = None
) -> Iterator[str]:
    """Re-cut text just after a newline that follows a non-space character and precedes a letter or digit, or
    where a text has none (one long line; lines that all start with "<" or a space), just before a space that
    follows a non-space character: the gpt2/cl100k/o200k pre-tokenizers never merge across such a point, so
    encoding the pieces one by one gives the tokens of the whole document. A text with neither is cut anyway past
    max_carry characters (bounded memory; the tokens there may then differ a little from the whole document's)."""
    max_carry = MAX_CARRY_CHARS if max_carry is None else max_carry
    safe_cut = safe_cut or _last_safe_cut
    carry = ""
    for chunk in chunks:
        text = carry + chunk
        cut = safe_cut(text, max(len(carry) - 1, 0))  # the carry had no safe point: skip it
        if cut == 0 and len(text) > max_carry:
            cut = len(text)
        if cut:
            yield text[:cut]
        carry = text[cut:]
    if carry:
        yield carry


def _last_safe_cut(text: str, start: int = 0) -> int:
    i = text.rfind("\n", start)
    while i > 0:
        if i + 1 < len(text) and not text[i - 1].isspace() and text[i + 1].isalnum():
            return i + 1
        i = text.rfind("\n", start, i)
    # no token of these regexes runs from a non-space character into the space after it, and none looks behind:
    # the space starts the same tokens as at a text's start (without this, 16M characters of a text with no such
    # newline were encoded as one call: 2.7 GB at peak for a 20 MB one-line file)
    last = _SPACE_AFTER_NON_SPACE.match(text, start)
    return last.end() - 1 if last else 0


_SPACE_AFTER_NON_SPACE = re.compile(r".*\S ", re.DOTALL)  # greedy: up to the last such space (backtracking in C)


def _past_whole_chars(text: str, start: int) -> int:
    """After the last newline once a document is past WHOLE_CHARS (else after its end), never before: no cut."""
    return 0 if len(text) <= WHOLE_CHARS else (text.rfind("\n", start) + 1 or len(text))


def _framed_once(tokens: Iterator[tuple[Document, Any]], start: int, end: int) -> Iterator[tuple[Document, Any]]:
    """A document encoded in pieces by a tokenizer.json whose post-processor writes `start` tokens before each text
    and `end` after it (Llama's <s>): each piece got them, and the document keeps only its first start and last end.
    A piece is held until the next one (or the document's end) says whether it was the last."""
    held: list[tuple[Document, Any]] = []  # the document's latest piece and any CUT after it
    seen = False  # a piece of this document came before
    for doc, ids in tokens:
        if isinstance(ids, np.ndarray):
            if held:
                (piece_doc, last), *rest = held
                yield piece_doc, last[: len(last) - end]  # not the document's last piece
                yield from rest
            held, seen = [(doc, ids[start:] if seen else ids)], True
        elif held:
            held.append((doc, ids))
            if ids is None:
                yield from held
                held, seen = [], False
        else:
            yield doc, ids
            seen = seen and ids is not None
