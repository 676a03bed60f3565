"""Token files: a corpus's tokens written to train.bin, then the validation split moved to val.bin.

Both are flat arrays of token ids (`token_dtype`: uint16, or uint32 for a vocabulary over 65,536), read with
np.memmap. Every document's tokens are appended to train.bin as they are encoded (minigpt.data.encoding), so a
corpus far larger than memory works; only a key and a token count per document are kept. Then the validation
documents' tokens are copied to val.bin and train.bin is compacted in place (see `split_tokens`).
"""

from __future__ import annotations

import hashlib
import os
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from minigpt.core.errors import DataError
from minigpt.core.tokenizers import ByteTokenizer, Tokenizer
from minigpt.data.encoding import CUT, ReadStats, document_tokens
from minigpt.data.progress import Progress
from minigpt.data.sources import Corpus, Document
from minigpt.data.verify import scan_tokens

__all__ = [
    "choose_val_docs",
    "document_key",
    "empty_corpus",
    "skipped_summary",
    "split_tokens",
    "token_dtype",
    "write_tokens",
]

COPY_TOKENS = 1 << 20  # the split moves tokens this many at a time


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def document_key(doc: Document) -> int:
    """The number a document is placed by in the split: a hash of its key (its path, or its row)."""
    return int.from_bytes(hashlib.sha256(doc.key.encode()).digest()[:8], "little")


def write_tokens(
    out: Path,
    tok: Tokenizer,
    corpus: Corpus,
    val_fraction: float,
    num_threads: int | None,
    planned: Any = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Every document's tokens into out/train.bin, then the validation ones moved to out/val.bin (see
    split_tokens). Returns what meta.json records of them: counts, sizes, the content hash and the checksums.
    planned: a minigpt.data.bpe.DocumentSplit decided before tokenizing (for a tokenizer trained on the training
    text), kept exactly instead of splitting on token counts."""
    dtype = token_dtype(tok.vocab_size)
    stats = ReadStats(hashlib.sha256(), num_chars=None if isinstance(tok, ByteTokenizer) else 0)
    keys, counts = array("Q"), array("q")  # per document: split key and token count (bounded: 16 bytes each)
    eot = None if tok.eot_id is None else np.array([tok.eot_id], dtype=np.int64)
    current, cut_tokens, total = None, None, 0
    cut_chars = planned.train_chars if planned is not None else None
    with open(out / "train.bin", "wb") as f:
        for doc, ids in document_tokens(tok, corpus, stats, num_threads, cut_chars):
            if doc is not current:
                current = doc
                keys.append(document_key(doc))
                counts.append(0)
            if ids is CUT:  # the single document's planned end of training text
                cut_tokens = counts[-1]
                continue
            if ids is None:  # the end of the document
                if eot is None:
                    continue
                ids = eot
            f.write(ids.astype(dtype, copy=False).data)  # (buffered: ndarray.tofile writes unbuffered)
            counts[-1] += len(ids)
            total += len(ids)
            if progress is not None:
                progress.update(stats.num_bytes, total)
    if not counts:
        raise empty_corpus(corpus)
    keys_array = np.array(keys, dtype=np.uint64)
    if planned is not None and not np.array_equal(keys_array, planned.keys):
        raise DataError(
            f"{corpus.origin} changed while it was being prepared (its documents differ from the first "
            "pass); prepare it again once it is complete"
        )
    split = split_tokens(
        out / "train.bin",
        out / "val.bin",
        dtype,
        keys_array,
        np.array(counts, dtype=np.int64),
        val_fraction,
        is_val=planned.is_val if planned is not None else None,
        n_train=cut_tokens,
    )
    if split["train_tokens"] == 0 or split["val_tokens"] == 0:
        raise DataError(f"corpus too small: {sum(counts)} token(s), too few for a train/val split; use a larger corpus")
    checks = {f"{name}_crc32": scan_tokens(out / f"{name}.bin", dtype)[0] for name in ("train", "val")}
    return {
        "content_sha256": stats.content.hexdigest(),
        "num_documents": len(counts),
        "skipped": corpus.skipped,
        "skipped_files": {why: names[:20] for why, names in corpus.skipped_files.items()},
        "num_bytes": stats.num_bytes,
        "num_chars": stats.num_chars,
        "invalid_utf8_bytes": stats.invalid_utf8_bytes,
        "invalid_utf8_in": stats.invalid_utf8_in,
        **split,
        **checks,
    }


def skipped_summary(corpus: Corpus) -> str:
    """The files the last pass over `corpus` skipped, by why: "2 binary (a.png, b.pyc), 1 empty (c.txt)"."""
    return ", ".join(
        f"{len(names)} {why} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
        for why, names in corpus.skipped_files.items()
    )


def empty_corpus(corpus: Corpus) -> DataError:
    """The error for a corpus with no document, after a pass over it: what its files were, if it skipped any."""
    what = f"column {corpus.text_column!r} of {corpus.source}" if corpus.is_dataset else corpus.origin
    folder = corpus.kind == "folder"  # (a single file is the one it skipped)
    skipped = f" (skipped: {skipped_summary(corpus)})" if folder and corpus.skipped_files else ""
    hidden = "; hidden files and folders are not read" if folder else ""
    return DataError(f"corpus is empty: {what} holds no text{skipped}{hidden}; pass a source with text in it")


def split_tokens(
    train_path: Path,
    val_path: Path,
    dtype: np.dtype,
    keys: np.ndarray,
    counts: np.ndarray,
    val_fraction: float,
    is_val: np.ndarray | None = None,
    n_train: int | None = None,
) -> dict[str, Any]:
    """Move the validation tokens from train.bin (which holds every document's tokens, in order) to val.bin.

    Several documents: whole documents, chosen by choose_val_docs (or given: is_val). One document: its last
    val_fraction of tokens (nanoGPT: first 90% / last 10%), or all but its first n_train tokens when given.
    """
    n = int(counts.sum())
    if len(counts) == 1:
        if n_train is None:
            n_train = min(max(int(n * (1 - val_fraction)), 1), n - 1) if n >= 2 else n
        train_runs, val_runs = [(0, n_train)], [(n_train, n)]
        is_val = np.zeros(1, dtype=bool)
    else:
        is_val = choose_val_docs(keys, counts, val_fraction) if is_val is None else is_val
        # runs of consecutive documents on the same side, as token ranges
        ends = np.cumsum(counts)
        firsts = np.concatenate([[0], np.flatnonzero(np.diff(is_val.astype(np.int8))) + 1])
        lasts = np.concatenate([firsts[1:], [len(counts)]]) - 1
        runs = [(int(ends[a] - counts[a]), int(ends[b])) for a, b in zip(firsts, lasts)]
        train_runs = [r for r, a in zip(runs, firsts) if not is_val[a]]
        val_runs = [r for r, a in zip(runs, firsts) if is_val[a]]
    n_val = _move_runs(train_path, val_path, dtype, train_runs, val_runs) if n else 0
    return {
        "split": "tokens" if len(counts) == 1 else "documents",
        "val_documents": int(is_val.sum()),
        "train_tokens": n - n_val,
        "val_tokens": n_val,
    }


def _move_runs(
    train_path: Path,
    val_path: Path,
    dtype: np.dtype,
    train_runs: list[tuple[int, int]],
    val_runs: list[tuple[int, int]],
) -> int:
    """Append the val_runs token ranges of train.bin to val.bin, then compact the train_runs to the front of
    train.bin in place (each moves towards the start, so nothing is overwritten before it is read).  Through one
    buffer of COPY_TOKENS, not a memmap, whose pages would count in the RSS as the file is walked."""
    size = dtype.itemsize
    buffer = memoryview(bytearray(COPY_TOKENS * size))

    def read(f, token: int, n: int) -> memoryview:
        f.seek(token * size)
        view, got = buffer[: n * size], 0
        while got < len(view):
            more = f.readinto(view[got:])
            if not more:
                raise DataError(
                    f"{train_path} became shorter while the validation split was moved out of it; "
                    "prepare the data again"
                )
            got += more
        return view

    n_val = 0
    with open(train_path, "r+b") as tokens:
        with open(val_path, "wb") as f:
            for start, end in val_runs:
                for i in range(start, end, COPY_TOKENS):
                    f.write(read(tokens, i, min(COPY_TOKENS, end - i)))
                n_val += end - start
            f.flush()
            os.fsync(f.fileno())
        w = 0
        for start, end in train_runs:
            for i in range(start, end, COPY_TOKENS):
                k = min(COPY_TOKENS, end - i)
                if w != i:
                    chunk = read(tokens, i, k)
                    tokens.seek(w * size)
                    tokens.write(chunk)
                w += k
        tokens.flush()
        tokens.truncate(w * size)
        os.fsync(tokens.fileno())
    return n_val


def choose_val_docs(keys: np.ndarray, counts: np.ndarray, val_fraction: float) -> np.ndarray:
    """Which documents go to val: a deterministic pseudo-random set of about val_fraction of the tokens.
    Documents are visited in the order of their key's hash (not the listing order, so adding a file or row moves
    few others) and taken when that brings the val size closer to the target; each side gets >= 1 document."""
    target = val_fraction * float(counts.sum())
    is_val = np.zeros(len(counts), dtype=bool)
    total = 0.0
    for i in np.argsort(keys, kind="stable"):
        if total >= target:
            break
        if total + counts[i] / 2 <= target:
            is_val[i] = True
            total += counts[i]
    if not is_val.any():
        is_val[int(np.argmin(counts))] = True
    if is_val.all():
        is_val[int(np.argmax(counts))] = False
    return is_val
