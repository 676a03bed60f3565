"""Preparation: tokenize a corpus into train.bin / val.bin token files (read with np.memmap), tokenizer.json, meta.json.

    from minigpt.data.prepare import prepare_data, load_prepared
    data = load_prepared(prepare_data("stdlib", "char"))   # data/stdlib-char-<hash>/
    data.train[:10], data.tokenizer.decode(data.val[:100])

One writer for every source: the documents of minigpt.data.sources (files, folders, URLs, dataset rows alike) are
read, decoded and tokenized a chunk at a time and their tokens appended to train.bin, so a corpus far larger
than memory works; then the validation documents' tokens are moved to val.bin. Everything is written into a
temporary sibling directory and installed whole when complete, with meta.json written last: a directory with a
valid meta.json is always a whole preparation, and an interrupted one leaves only a temporary directory that the
next run removes. A cache is checked before it is used (token file sizes, checksums and ids, the tokenizer file's
hash): a damaged one is prepared again, never trained on.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import shutil
import time
import zlib
from array import array
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from minigpt.core.errors import DataError, UnknownCharactersError, UserError, first_line, shown_chars
from minigpt.core.fsutil import fsync_dir, install_dir, remove_stale, temp_sibling, write_error, write_json
from minigpt.data.sources import DEFAULT_SOURCE, Corpus, Document, iter_documents, resolve_source, sha256_json, slugify
from minigpt.core.tokenizers import (ByteTokenizer, CharTokenizer, TiktokenTokenizer, Tokenizer, get_tokenizer,
                                resolve_tokenizer, tokenizer_from_dict)

__all__ = ["DEFAULT_SOURCE", "FORMAT_VERSION", "PreparedData", "load_prepared", "prepare_data", "token_dtype"]

# 2: dataset rows go to train or val by the hash of their key "row:{i}", as files by their path
# 3: meta.json holds checksums of the token files and the hash of tokenizer.json, checked before use
FORMAT_VERSION = 3
BATCH_CHARS = 8 << 20  # BPE encodes this much text per call, split across threads
MAX_CARRY_CHARS = 16 << 20  # text with no BPE-safe cut point is cut anyway past this (bounded memory)
COPY_TOKENS = 1 << 20  # the split moves tokens this many at a time
VERIFY_TOKENS = 16 << 20  # token files are checked this many tokens at a time (32-64 MB of memory)
_VERIFIED: set[tuple] = set()  # (directory, file stats) checked by this process: prepare + load read them once


@dataclass
class PreparedData:
    train: np.memmap
    val: np.memmap
    meta: dict[str, Any]
    tokenizer: Tokenizer
    path: Path | None = None


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def prepare_data(source: str = DEFAULT_SOURCE, tokenizer: str = "char", data_root: str | Path = "data",
                 val_fraction: float = 0.1, text_column: str = "text", num_proc: int | None = None,
                 force: bool = False) -> Path:
    """Tokenize `source` into data_root/<name>-<tokenizer>-<hash>/ and return that directory.

    tokenizer: "char" (vocabulary: the corpus's characters), "byte", a tiktoken encoding name, or the path of a
    tokenizer file (see minigpt.core.tokenizers; a char tokenizer file keeps its vocabulary).
    Returns at once when the directory already holds a preparation of the same, unchanged source with the same
    options (force=True redoes it). With several documents the validation split takes whole documents (a
    deterministic pseudo-random ~val_fraction of the tokens); a single document is split on tokens: the first
    1-val_fraction to train, the rest to val (as nanoGPT does). BPE tokenizers append end-of-text after each document.
    num_proc: threads for BPE encoding (default: all cores).
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}; use e.g. 0.1")
    spec = resolve_tokenizer(tokenizer)  # an unknown name or a missing file fails before any reading
    if not str(data_root).strip():  # Path("") is the current directory
        raise DataError("data_root is empty; set it to the folder for prepared data (default: data)")
    data_root = Path(data_root)
    corpus = resolve_source(source, data_root, text_column)
    tokenizer_key = _tokenizer_key(spec)
    fingerprint = sha256_json({"format": FORMAT_VERSION, "source": corpus.fingerprint(), "tokenizer": tokenizer_key,
                               "val_fraction": val_fraction, "text_column": text_column})
    # the directory: one per source and options (a built-in tokenizer by its name, a file by its content)
    label = spec.stem if isinstance(spec, Path) else spec
    placement = [corpus.origin, corpus.config, val_fraction, text_column]
    if isinstance(spec, Path):
        placement.append(tokenizer_key)
    out = data_root / f"{corpus.name}-{slugify(label)}-{sha256_json(placement)[:8]}"
    with _write_errors(data_root):
        data_root.mkdir(parents=True, exist_ok=True)
        remove_stale(data_root)
    if not force and (meta := _complete_meta(out, fingerprint)) is not None:
        if (problem := _verify(out, meta)) is None:
            print(f"data: using {out} ({meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens, "
                  f"{meta['tokenizer']}), prepared earlier from the same source and tokenizer")
            return out
        print(f"data: {out} is damaged ({problem}); preparing it again")

    tmp = temp_sibling(out)
    t0 = time.perf_counter()
    try:
        with _write_errors(data_root):
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            tok = _char_tokenizer(corpus) if spec == "char" else get_tokenizer(spec)
            stats = _write_tokens(tmp, tok, corpus, val_fraction, num_proc)
            seconds = time.perf_counter() - t0
            write_json(tmp / "tokenizer.json", tok.to_dict())
            meta = {"format_version": FORMAT_VERSION, "source": source, "kind": corpus.kind,
                    "origin": corpus.origin, **stats, "tokenizer": tok.name, "tokenizer_key": tokenizer_key,
                    "tokenizer_sha256": _file_sha256(tmp / "tokenizer.json"), "vocab_size": tok.vocab_size,
                    "eot_id": tok.eot_id, "dtype": token_dtype(tok.vocab_size).name, "val_fraction": val_fraction,
                    "text_column": text_column, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "prepare_seconds": round(seconds, 3), "fingerprint": fingerprint}
            write_json(tmp / "meta.json", meta)  # last: its presence marks a complete preparation
            fsync_dir(tmp)
            install_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never a partial directory that a later run could take
        raise
    if corpus.skipped_files:
        shown = ", ".join(f"{len(names)} {why} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                          for why, names in corpus.skipped_files.items())
        print(f"data: skipped {corpus.skipped} file(s) that hold no text: {shown}")
    mb = meta["num_bytes"] / 1e6
    tokens = meta["train_tokens"] + meta["val_tokens"]
    print(f"data: prepared {out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens from "
          f"{meta['num_documents']:,} documents ({mb:.1f} MB, {tok.name}) in {seconds:.1f}s: "
          f"{mb / max(seconds, 1e-9):.1f} MB/s, {tokens / max(seconds, 1e-9) / 1e6:.2f} M tokens/s")
    return out


def load_prepared(data_dir: str | Path) -> PreparedData:
    """Open a prepared directory: memmapped train/val tokens, meta.json, and the tokenizer from tokenizer.json."""
    data_dir = Path(data_dir)
    if not (data_dir / "meta.json").is_file():
        raise DataError(f"no prepared data at {data_dir} (no meta.json); prepare it first "
                        "(minigpt.data.prepare.prepare_data(source, tokenizer)), or train with a data source")
    try:
        meta = json.loads((data_dir / "meta.json").read_text())
        tokenizer = tokenizer_from_dict(json.loads((data_dir / "tokenizer.json").read_text()))
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format_version {meta.get('format_version')}, expected {FORMAT_VERSION}")
        dtype = np.dtype(meta["dtype"])
        train = np.memmap(data_dir / "train.bin", dtype=dtype, mode="r")
        val = np.memmap(data_dir / "val.bin", dtype=dtype, mode="r")
        if (problem := _verify(data_dir, meta)) is not None:
            raise ValueError(problem)
    except (OSError, ValueError, KeyError, TypeError, UserError) as e:  # (UserError: a damaged tokenizer.json)
        raise DataError(f"prepared data at {data_dir} is damaged or from another version ({first_line(e)}); "
                        "delete the directory and prepare again") from None
    return PreparedData(train, val, meta, tokenizer, data_dir)


# ------------------------------------------------------------------------------------------------- the writer


def _char_tokenizer(corpus: Corpus) -> CharTokenizer:
    """The char vocabulary is the set of the corpus's characters: a first pass over the documents."""
    chars: set[str] = set()
    for doc in iter_documents(corpus):
        for text in _decode(doc.chunks, doc.name, strict=True):
            chars.update(text)
    return CharTokenizer("".join(chars))


@dataclass
class _Stats:
    """What the writer counts while reading: the content hash (all documents' bytes, in order) and sizes."""

    content: Any
    num_bytes: int = 0
    num_chars: int | None = 0  # None for the byte tokenizer, which never decodes the text

    def read(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            self.content.update(chunk)
            self.num_bytes += len(chunk)
            yield chunk


def _write_tokens(out: Path, tok: Tokenizer, corpus: Corpus, val_fraction: float,
                  num_threads: int | None) -> dict[str, Any]:
    """Every document's tokens into out/train.bin, then the validation ones moved to out/val.bin (see _split)."""
    dtype = token_dtype(tok.vocab_size)
    stats = _Stats(hashlib.sha256(), num_chars=None if isinstance(tok, ByteTokenizer) else 0)
    keys, counts = array("Q"), array("q")  # per document: split key and token count (bounded: 16 bytes each)
    eot = None if tok.eot_id is None else np.array([tok.eot_id], dtype=np.int64)
    current = None
    with open(out / "train.bin", "wb") as f:
        for doc, ids in _encode(tok, _pieces(tok, corpus, stats), num_threads):
            if doc is not current:
                current = doc
                keys.append(int.from_bytes(hashlib.sha256(doc.key.encode()).digest()[:8], "little"))
                counts.append(0)
            if ids is None:  # the end of the document
                if eot is None:
                    continue
                ids = eot
            f.write(ids.astype(dtype, copy=False).data)  # (buffered: ndarray.tofile writes unbuffered)
            counts[-1] += len(ids)
    if not counts:
        what = f"column {corpus.text_column!r} of {corpus.source}" if corpus.is_dataset else corpus.origin
        raise DataError(f"corpus is empty: {what} holds no text; pass a source with text in it")
    split = _split(out / "train.bin", out / "val.bin", dtype, np.array(keys, dtype=np.uint64),
                   np.array(counts, dtype=np.int64), val_fraction)
    if split["train_tokens"] == 0 or split["val_tokens"] == 0:
        raise DataError(f"corpus too small: {sum(counts)} token(s), too few for a train/val split; "
                        "use a larger corpus")
    checks = {f"{name}_crc32": _scan_tokens(out / f"{name}.bin", dtype)[0] for name in ("train", "val")}
    return {"content_sha256": stats.content.hexdigest(), "num_documents": len(counts), "skipped": corpus.skipped,
            "skipped_files": {why: names[:20] for why, names in corpus.skipped_files.items()},
            "num_bytes": stats.num_bytes, "num_chars": stats.num_chars, **split, **checks}


def _pieces(tok: Tokenizer, corpus: Corpus, stats: _Stats) -> Iterator[tuple[Document, str | bytes | None]]:
    """(document, text or bytes to encode) for each piece of each document, then (document, None) at its end."""
    for doc in iter_documents(corpus):
        raw = stats.read(doc.chunks)
        if isinstance(tok, ByteTokenizer):
            yield from ((doc, b) for b in raw)  # raw bytes: any file is fine, nothing to decode
        else:
            texts = _decode(raw, doc.name, strict=isinstance(tok, CharTokenizer))
            if isinstance(tok, TiktokenTokenizer):
                texts = _bpe_safe_pieces(texts)
            for text in texts:
                stats.num_chars += len(text)
                yield doc, text
        yield doc, None


def _encode(tok: Tokenizer, pieces: Iterator[tuple[Document, str | bytes | None]],
            num_threads: int | None) -> Iterator[tuple[Document, np.ndarray | None]]:
    """Token arrays for the pieces, in order. Text is encoded in batches so BPE can use several threads."""
    batch: list[tuple[Document, str | bytes | None]] = []
    size = 0

    def flush() -> Iterator[tuple[Document, np.ndarray | None]]:
        texts = [p for _, p in batch if isinstance(p, str)]
        try:
            encoded = iter(tok.encode_batch(texts, num_threads) if texts else [])
        except UnknownCharactersError as e:  # a char tokenizer read from a file: its vocabulary is fixed
            doc = next(d for d, p in batch if isinstance(p, str) and any(c in p for c in e.chars))
            raise DataError(f"{doc.name} has {len(e.chars)} character(s) not in the char tokenizer's vocabulary: "
                            f"{shown_chars(e.chars)}; remove them, use a char tokenizer made from text that has "
                            "them, or the byte tokenizer, which encodes any text") from None
        for doc, p in batch:
            if p is None:
                yield doc, None
            elif isinstance(p, bytes):
                yield doc, np.frombuffer(p, dtype=np.uint8)  # byte tokenizer: the bytes are the ids
            else:
                yield doc, next(encoded)

    for doc, piece in pieces:
        batch.append((doc, piece))
        size += 0 if piece is None else len(piece)
        if size >= BATCH_CHARS:
            yield from flush()
            batch, size = [], 0
    yield from flush()


def _decode(chunks: Iterable[bytes], name: str, strict: bool) -> Iterator[str]:
    """UTF-8 text, chunk by chunk. strict (char): invalid UTF-8 is an error (the vocabulary would be wrong); else
    (BPE) replaced by U+FFFD, as tiktoken itself decodes, so one bad byte does not stop a long preparation."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict" if strict else "replace")
    offset = 0
    try:
        for chunk in chunks:
            if text := decoder.decode(chunk):
                yield text
            offset += len(chunk)
        if text := decoder.decode(b"", final=True):
            yield text
    except UnicodeDecodeError as e:
        raise DataError(f"{name} is not UTF-8 text (near byte {offset + e.start}); use the byte tokenizer "
                        "(tokenizer: byte), which reads any file") from None


def _bpe_safe_pieces(chunks: Iterable[str], max_carry: int | None = None) -> Iterator[str]:
    """Re-cut text just after a newline that follows a non-space character and precedes a letter or digit: the
    gpt2/cl100k/o200k pre-tokenizers never merge across such a point, so encoding the pieces one by one gives the
    tokens of the whole document. A text with no such point is cut anyway past max_carry characters (bounded
    memory; the tokens there may then differ a little from encoding the whole document)."""
    max_carry = MAX_CARRY_CHARS if max_carry is None else max_carry
    carry = ""
    for chunk in chunks:
        text = carry + chunk
        cut = _last_safe_cut(text, start=max(len(carry) - 1, 0))  # the carry had no safe point: skip it
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
    return 0


# -------------------------------------------------------------------------------------------------- the split


def _split(train_path: Path, val_path: Path, dtype: np.dtype, keys: np.ndarray, counts: np.ndarray,
           val_fraction: float) -> dict[str, Any]:
    """Move the validation tokens from train.bin (which holds every document's tokens, in order) to val.bin.

    Several documents: whole documents, chosen by _choose_val_docs. One document: its last val_fraction of
    tokens (nanoGPT: first 90% / last 10%).
    """
    n = int(counts.sum())
    if len(counts) == 1:
        n_train = min(max(int(n * (1 - val_fraction)), 1), n - 1) if n >= 2 else n
        train_runs, val_runs = [(0, n_train)], [(n_train, n)]
        is_val = np.zeros(1, dtype=bool)
    else:
        is_val = _choose_val_docs(keys, counts, val_fraction)
        # runs of consecutive documents on the same side, as token ranges
        ends = np.cumsum(counts)
        firsts = np.concatenate([[0], np.flatnonzero(np.diff(is_val.astype(np.int8))) + 1])
        lasts = np.concatenate([firsts[1:], [len(counts)]]) - 1
        runs = [(int(ends[a] - counts[a]), int(ends[b])) for a, b in zip(firsts, lasts)]
        train_runs = [r for r, a in zip(runs, firsts) if not is_val[a]]
        val_runs = [r for r, a in zip(runs, firsts) if is_val[a]]
    n_val = _move_runs(train_path, val_path, dtype, train_runs, val_runs) if n else 0
    return {"split": "tokens" if len(counts) == 1 else "documents", "val_documents": int(is_val.sum()),
            "train_tokens": n - n_val, "val_tokens": n_val}


def _move_runs(train_path: Path, val_path: Path, dtype: np.dtype, train_runs: list[tuple[int, int]],
               val_runs: list[tuple[int, int]]) -> int:
    """Append the val_runs token ranges of train.bin to val.bin, then compact the train_runs to the front of
    train.bin in place (each moves towards the start, so nothing is overwritten before it is read)."""
    tokens = np.memmap(train_path, dtype=dtype, mode="r+")
    n_val = 0
    with open(val_path, "wb") as f:
        for start, end in val_runs:
            for i in range(start, end, COPY_TOKENS):
                f.write(tokens[i:min(i + COPY_TOKENS, end)].data)
            n_val += end - start
        f.flush()
        os.fsync(f.fileno())
    w = 0
    for start, end in train_runs:
        for i in range(start, end, COPY_TOKENS):
            k = min(COPY_TOKENS, end - i)
            if w != i:
                tokens[w:w + k] = tokens[i:i + k]
            w += k
    tokens.flush()
    del tokens
    with open(train_path, "r+b") as f:
        f.truncate(w * dtype.itemsize)
        os.fsync(f.fileno())
    return n_val


def _choose_val_docs(keys: np.ndarray, counts: np.ndarray, val_fraction: float) -> np.ndarray:
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


# ---------------------------------------------------------------------------------------------------- caching


def _tokenizer_key(spec: str | Path) -> str:
    """The tokenizer's identity for the cache: a built-in tokenizer's name, a tokenizer file's content hash."""
    if isinstance(spec, str):
        return spec
    try:
        return "sha256:" + hashlib.sha256(spec.read_bytes()).hexdigest()
    except OSError as e:
        raise DataError(f"cannot read tokenizer file {spec} ({e.strerror or type(e).__name__})") from None


@contextmanager
def _write_errors(data_root: Path) -> Iterator[None]:
    """A full disk, a quota or a read-only/forbidden data_root: one DataError naming the folder and the fix."""
    try:
        yield
    except OSError as e:
        if (error := write_error(e, data_root, "prepared data")) is not None:
            raise error from None
        raise


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _scan_tokens(path: Path, dtype: np.dtype) -> tuple[int, int]:
    """(CRC-32 of the file, largest token id in it), reading VERIFY_TOKENS at a time (bounded memory). CRC-32,
    not sha256: this runs at every start over the whole split, and it only has to catch damage, not forgery."""
    crc, top = 0, -1
    tokens = np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)
    for i in range(0, len(tokens), VERIFY_TOKENS):
        part = np.ascontiguousarray(tokens[i:i + VERIFY_TOKENS])
        crc = zlib.crc32(part.data, crc)
        top = max(top, int(part.max()))
    del tokens
    return crc, top


def _verify(out: Path, meta: dict[str, Any]) -> str | None:
    """What is wrong with the prepared files at out compared with meta.json, or None when they match: sizes,
    checksums and the largest token id of train.bin/val.bin, and the hash of tokenizer.json. Reads both token
    files whole (about 1 s per GB), once per process: a check that passed is remembered by the files' stats."""
    try:
        dtype = np.dtype(meta["dtype"])
        files = [out / "train.bin", out / "val.bin", out / "tokenizer.json", out / "meta.json"]
        key = (str(out.resolve()), *((s.st_size, s.st_mtime_ns, s.st_ino) for s in map(os.stat, files)))
        if key in _VERIFIED:
            return None
        if _file_sha256(out / "tokenizer.json") != meta["tokenizer_sha256"]:
            return "tokenizer.json differs from the one it was prepared with"
        for name in ("train", "val"):
            path = out / f"{name}.bin"
            if path.stat().st_size != meta[f"{name}_tokens"] * dtype.itemsize:
                return f"{name}.bin holds {path.stat().st_size // dtype.itemsize:,} tokens, meta.json says " \
                       f"{meta[f'{name}_tokens']:,}"
            crc, top = _scan_tokens(path, dtype)
            if top >= meta["vocab_size"]:
                return f"{name}.bin holds token id {top}, outside the vocabulary of {meta['vocab_size']}"
            if crc != meta[f"{name}_crc32"]:
                return f"{name}.bin's checksum differs from meta.json's"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{type(e).__name__}: {first_line(e)}"
    _VERIFIED.add(key)
    return None


def _complete_meta(out: Path, fingerprint: str) -> dict[str, Any] | None:
    """meta.json of a whole preparation with this fingerprint at out, else None (its files: see _verify)."""
    try:
        meta = json.loads((out / "meta.json").read_text())
        if isinstance(meta, dict) and meta.get("format_version") == FORMAT_VERSION \
                and meta.get("fingerprint") == fingerprint:
            return meta
    except (OSError, ValueError):
        pass
    return None
