"""Preparation: tokenize a corpus into train.bin / val.bin token files (read with np.memmap), tokenizer.json, meta.json.

    from minigpt.data.prepare import prepare_data, load_prepared
    data = load_prepared(prepare_data("stdlib", "char"))   # data/stdlib-char-<hash>/
    data.train[:10], data.tokenizer.decode(data.val[:100])

This module decides whether a preparation is needed and installs it; the work is done by
  minigpt.data.sources      the documents of a source (files, folders, URLs, dataset rows alike)
  minigpt.data.encoding     documents -> token arrays, a chunk at a time
  minigpt.data.token_files  token arrays -> train.bin, then the validation split moved to val.bin
  minigpt.data.verify       the prepared files checked against meta.json
Everything is written into a temporary sibling directory and installed whole when complete, with meta.json
written last: a directory with a valid meta.json is always a whole preparation, and an interrupted one leaves only
a temporary directory that the next run removes. A cache is checked before it is used (token file sizes,
checksums and ids, the tokenizer file's hash): a damaged one is prepared again, never trained on.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from minigpt.core.errors import DataError, UserError, first_line
from minigpt.core.fsutil import fsync_dir, install_dir, remove_stale, temp_sibling, write_errors, write_json
from minigpt.core.tokenizers import BPE_PREFIX, Tokenizer, get_tokenizer, resolve_tokenizer, tokenizer_from_dict
from minigpt.core.user_files import DOCUMENT_BYTES, loads, read_user_bytes
from minigpt.data.bpe import plan_split, train_bpe
from minigpt.data.encoding import char_vocabulary
from minigpt.data.progress import Progress
from minigpt.data.sources import (
    DATA_ROOT_FIX,
    DECOMPRESSORS,
    DEFAULT_SOURCE,
    Corpus,
    resolve_source,
    sha256_json,
    slugify,
)
from minigpt.data.token_files import skipped_summary, token_dtype, write_tokens
from minigpt.data.verify import file_sha256, verify_prepared

__all__ = ["DEFAULT_SOURCE", "FORMAT_VERSION", "PreparedData", "load_prepared", "prepare_data"]

# 2: dataset rows go to train or val by the hash of their key "row:{i}", as files by their path
# 3: meta.json holds checksums of the token files and the hash of tokenizer.json, checked before use
# 4: bpe:VOCAB and tokenizer.json documents encode as their whole text (3 cut a word, and added a tokenizer.json's
#    start token, at every 1 MiB read), and so does a text with no newline to cut after (cut every 16M characters);
#    bump it whenever the tokens of a source change, or old ones are reused
FORMAT_VERSION = 4
PREPARED_FILES = ("train.bin", "val.bin", "tokenizer.json", "meta.json")  # what a preparation writes


@dataclass
class PreparedData:
    """A prepared directory, opened: its train/val token ids as read-only memmaps, meta.json and tokenizer."""

    train: np.memmap
    val: np.memmap
    meta: dict[str, Any]
    tokenizer: Tokenizer
    path: Path | None = None


def prepare_data(
    source: str = DEFAULT_SOURCE,
    tokenizer: str = "char",
    data_root: str | Path = "data",
    val_fraction: float = 0.1,
    text_column: str = "text",
    num_proc: int | None = None,
    force: bool = False,
) -> Path:
    """Tokenize `source` into data_root/<name>-<tokenizer>-<hash>/ and return that directory.

    tokenizer: "char" (vocabulary: the corpus's characters), "byte", a tiktoken encoding name, "bpe:VOCAB" (a
    byte-level BPE trained on the training documents, minigpt.data.bpe), or the path of a tokenizer file (see
    minigpt.core.tokenizers; a char tokenizer file keeps its vocabulary).
    Returns at once when the directory already holds a preparation of the same, unchanged source with the same
    options (force=True redoes it). With several documents the validation split takes whole documents (a
    deterministic pseudo-random ~val_fraction of the tokens); a single document is split on tokens: the first
    1-val_fraction to train, the rest to val (as nanoGPT does). BPE tokenizers append end-of-text after each document.
    num_proc: threads for BPE encoding (default: all cores).
    """
    # the settings' rules: (refused when, the message); an empty path would be the current directory (Path(""))
    for refused, message in (
        (
            not 0.0 < val_fraction < 1.0,
            f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}; use e.g. 0.1",
        ),
        (
            not str(source).strip(),
            "the data source is empty; pass a file, folder, URL or datasets name (or stdlib) "
            "-- is the shell variable you meant to use unset?",
        ),
        (not str(data_root).strip(), "data_root is empty; set it to the folder for prepared data (default: data)"),
    ):
        if refused:
            raise DataError(message)
    spec = resolve_tokenizer(tokenizer)  # an unknown name or a missing file fails before any reading
    data_root = Path(data_root)
    corpus = resolve_source(source, data_root, text_column)
    if (prepared := _prepared_source(corpus)) is not None:  # else its meta.json and tokenizer.json were the text
        raise DataError(
            f"{source} is prepared data (token ids in {prepared}, not text); pass the corpus it was prepared from "
            'as the data source (meta.json\'s "source"): with the same tokenizer and data_root it is reused'
        )
    if corpus.kind == "folder":  # one that holds data_root: its preparations would be read, a new one at each run
        corpus.files = [f for f in corpus.files if not _prepared_file(f.path, data_root.resolve())]
    tokenizer_key = _tokenizer_key(spec)
    fingerprint = sha256_json(
        {
            "format": FORMAT_VERSION,
            "source": corpus.fingerprint(),
            "tokenizer": tokenizer_key,
            "val_fraction": val_fraction,
            "text_column": text_column,
        }
    )
    # the directory: one per source and options (a built-in tokenizer by its name, a file by its content)
    label = spec.stem if isinstance(spec, Path) else spec
    placement = [corpus.origin, corpus.config, val_fraction, text_column]
    if isinstance(spec, Path):
        placement.append(tokenizer_key)
    out = data_root / f"{corpus.name}-{slugify(label)}-{sha256_json(placement)[:8]}"
    with write_errors(f"prepared data in {data_root}", DATA_ROOT_FIX):
        data_root.mkdir(parents=True, exist_ok=True)
        remove_stale(data_root)
    if not force and (meta := _complete_meta(out, fingerprint, corpus.kind)) is not None:
        if (problem := verify_prepared(out, meta)) is None:
            if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":  # said once under DDP, by rank 0
                print(
                    f"data: using {out} ({meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens, "
                    f"{meta['tokenizer']}), prepared earlier from the same source and tokenizer"
                )
            return out
        print(f"data: {out} is damaged ({problem}); preparing it again")

    tmp = temp_sibling(out)
    t0 = time.perf_counter()
    try:
        with write_errors(f"prepared data in {data_root}", DATA_ROOT_FIX):
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            planned = None
            if spec == "char":
                tok = char_vocabulary(corpus)
            elif str(spec).startswith(BPE_PREFIX):  # trained here, on the training text only
                planned = plan_split(corpus, val_fraction)
                tok = train_bpe(corpus, planned, spec)
            else:
                tok = get_tokenizer(spec)
            # the bytes read are text's (decompressed): a compressed file's size is no total for them
            sized = not any(f.path.suffix.lower() in DECOMPRESSORS for f in corpus.files)
            total = sum(f.size for f in corpus.files) if sized else None
            progress = Progress(total, f"{corpus.name} ({tok.name})")
            try:
                stats = write_tokens(tmp, tok, corpus, val_fraction, num_proc, planned, progress)
            finally:
                progress.close()
            seconds = time.perf_counter() - t0
            write_json(tmp / "tokenizer.json", tok.to_dict())
            meta = {
                "format_version": FORMAT_VERSION,
                "source": source,
                "kind": corpus.kind,
                "origin": corpus.origin,
                **stats,
                "tokenizer": tok.name,
                "tokenizer_key": tokenizer_key,
                "tokenizer_sha256": file_sha256(tmp / "tokenizer.json"),
                "vocab_size": tok.vocab_size,
                "eot_id": tok.eot_id,
                "dtype": token_dtype(tok.vocab_size).name,
                "val_fraction": val_fraction,
                "text_column": text_column,
                "created": datetime.now(UTC).isoformat(timespec="seconds"),
                "prepare_seconds": round(seconds, 3),
                "fingerprint": fingerprint,
            }
            write_json(tmp / "meta.json", meta)  # last: its presence marks a complete preparation
            fsync_dir(tmp)
            install_unless_prepared(tmp, out, fingerprint, corpus.kind, keep=not force)
    finally:  # never a partial directory that a later run could take (once installed, tmp is gone)
        shutil.rmtree(tmp, ignore_errors=True)
    if corpus.skipped_files:
        print(f"data: skipped {corpus.skipped} file(s) that hold no text: {skipped_summary(corpus)}")
    mb = meta["num_bytes"] / 1e6
    tokens = meta["train_tokens"] + meta["val_tokens"]
    print(
        f"data: prepared {out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens from "
        f"{meta['num_documents']:,} document{'s' * (meta['num_documents'] != 1)} ({mb:.1f} MB, {tok.name}) in "
        f"{seconds:.1f}s: "
        f"{mb / max(seconds, 1e-9):.1f} MB/s, {tokens / max(seconds, 1e-9) / 1e6:.2f} M tokens/s"
    )
    if meta.get("invalid_utf8_bytes"):
        print(  # BPE reads them as U+FFFD (as tiktoken decodes), not an error: one stray byte keeps a long preparation
            f"note: {meta['invalid_utf8_bytes']:,} byte(s) that are not UTF-8 were read as U+FFFD (first in "
            f"{meta['invalid_utf8_in']}): text in another encoding (Latin-1, cp1252) loses those characters; convert "
            "it to UTF-8 (iconv -f cp1252 -t utf-8) and prepare again",
            file=sys.stderr,
        )
    if meta["split"] == "documents" and meta["val_tokens"] < val_fraction * tokens / 4:
        print(  # whole documents go to one side: a few large ones leave validation to the small ones
            f"note: the validation split is {meta['val_tokens'] / tokens:.2%} of the tokens where "
            f"val_fraction asks for {val_fraction:.0%}: documents go whole to one side, and most of the text is "
            "in documents larger than that; split the large files into smaller ones for a fuller validation split",
            file=sys.stderr,
        )
    return out


def install_unless_prepared(tmp: Path, out: Path, fingerprint: str, kind: str, keep: bool = True) -> None:
    """Install tmp at out, unless another process (a second run on the same source) has installed the same
    preparation meanwhile: that one is kept, whole, for whoever reads it already (both renaming onto out made the
    second rename fail, ENOTEMPTY, a traceback).  keep=False (force): tmp replaces even a valid one, which is the
    one force was asked to redo."""

    def prepared_meanwhile() -> bool:
        meta = _complete_meta(out, fingerprint, kind)
        return meta is not None and verify_prepared(out, meta) is None

    if keep and prepared_meanwhile():
        return
    try:
        install_dir(tmp, out)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not prepared_meanwhile():
            raise


def load_prepared(data_dir: str | Path) -> PreparedData:
    """Open a prepared directory: memmapped train/val tokens, meta.json, and the tokenizer from tokenizer.json."""
    data_dir = Path(data_dir)
    try:
        meta = loads(read_user_bytes(data_dir / "meta.json", DOCUMENT_BYTES))
        tokenizer = tokenizer_from_dict(loads(read_user_bytes(data_dir / "tokenizer.json", DOCUMENT_BYTES)))
        problem = (
            f"format_version {meta.get('format_version')}, expected {FORMAT_VERSION}"
            if meta.get("format_version") != FORMAT_VERSION
            else verify_prepared(data_dir, meta)
        )
        if problem is None:
            dtype = np.dtype(meta["dtype"])
            train = np.memmap(data_dir / "train.bin", dtype=dtype, mode="r")
            val = np.memmap(data_dir / "val.bin", dtype=dtype, mode="r")
    # one line for whatever is wrong: no meta.json, a damaged file (UserError: tokenizer.json), another version
    except (OSError, ValueError, KeyError, TypeError, UserError) as e:
        problem = first_line(e)
    if problem is not None:  # (without meta.json nothing was prepared there: a preparation is installed whole)
        raise DataError(
            f"prepared data at {data_dir} is damaged or from another version ({problem}); delete the "
            "directory and prepare again"
            if (data_dir / "meta.json").is_file()
            else f"no prepared data at {data_dir} (no meta.json); prepare it first "
            "(minigpt.data.prepare.prepare_data(source, tokenizer)), or train with a data source"
        )
    return PreparedData(train, val, meta, tokenizer, data_dir)


# ---------------------------------------------------------------------------------------------------- caching


def _tokenizer_key(spec: str | Path) -> str:
    """The tokenizer's identity for the cache: a built-in tokenizer's name, a tokenizer file's content hash."""
    if isinstance(spec, str):
        return spec
    try:
        return "sha256:" + file_sha256(spec)
    except OSError as e:
        raise DataError(f"cannot read tokenizer file {spec} ({e.strerror or type(e).__name__})") from None


def _prepared_source(corpus: Corpus) -> Path | None:
    """The prepared folder (all of PREPARED_FILES) that a local source is or is a file of, else None."""
    if corpus.kind in ("stdlib", "url") or (corpus.is_dataset and not corpus.builder):
        return None
    folder = Path(corpus.origin)
    folder = folder if folder.is_dir() else folder.parent
    return folder if all((folder / name).is_file() for name in PREPARED_FILES) else None


def _prepared_file(path: Path, data_root: Path) -> bool:
    """Whether `path` is a file of a preparation in data_root (a folder with meta.json) or a download there."""
    folder = path.parent
    return folder.parent == data_root and (folder.name == "downloads" or (folder / "meta.json").is_file())


def _complete_meta(out: Path, fingerprint: str, kind: str) -> dict[str, Any] | None:
    """meta.json of a whole preparation with this fingerprint at out, else None (its files: see verify_prepared).
    The kind of source too: a save_to_disk folder, read as a folder of text files before, has the same files."""
    try:
        meta = loads(read_user_bytes(out / "meta.json", DOCUMENT_BYTES))
        if (
            isinstance(meta, dict)
            and meta.get("format_version") == FORMAT_VERSION
            and meta.get("fingerprint") == fingerprint
            and meta.get("kind") == kind
        ):
            return meta
    except (OSError, ValueError):
        pass
    return None
