"""Data: turn a text corpus into train.bin / val.bin token files (read with np.memmap), meta.json and tokenizer.json.

    from minigpt.data import prepare_data, load_prepared
    data = load_prepared(prepare_data("stdlib", "char"))   # data/stdlib-char-<hash>/
    data.train[:10], data.tokenizer.decode(data.val[:100])

A source is one of
  "stdlib"          the running interpreter's standard library *.py files (built in, no download, ~12 MB);
  a file or folder  a text file is one document; a folder holds one document per text file (recursive, sorted;
                    hidden files/folders and binary files -- a NUL byte in the first 8 KB -- are skipped);
  an http(s) URL    downloaded once into data_root/downloads/, then handled as a local file;
  a *.parquet, *.json, *.jsonl or *.csv file: rows of a `datasets` table, one document per row of `text_column`;
  anything else     a Hugging Face hub dataset, "name" or "name:config" (e.g. "roneneldan/TinyStories",
                    "Salesforce/wikitext:wikitext-103-raw-v1"), split "train", one document per row.

Preparation streams: files are read, decoded and tokenized CHUNK_BYTES at a time and tokens are appended to the
output files, so a corpus far larger than memory works. Everything is written into a temporary sibling directory
and renamed into place when complete, with meta.json written last: a directory with a valid meta.json is always a
whole preparation, and an interrupted one leaves only a temporary directory that the next run removes.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import shutil
import sysconfig
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from minigpt.tokenizers import (ByteTokenizer, CharTokenizer, TiktokenTokenizer, Tokenizer, get_tokenizer,
                                registered_tiktoken_encoding, tokenizer_from_dict, tokenizer_names)

DEFAULT_SOURCE = "stdlib"
FORMAT_VERSION = 1
CHUNK_BYTES = 1 << 20  # files are read, decoded and tokenized this much at a time
BATCH_CHARS = 8 << 20  # BPE encodes this much text per call, split across threads
DOWNLOAD_TIMEOUT_S = 30.0
DOWNLOAD_LIMIT_BYTES = 2 << 30
DATASET_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
# The test suites (test/, tests/, idlelib/idle_test/) are 19 of the stdlib's 31 MB of *.py; without them ~12 MB.
STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?(:[\w.-]+)?$")
_LEFTOVER = re.compile(r"^\..+\.(?:tmp|old)-(\d+)$")
# a missing source with one of these suffixes is a mistyped path, not a hub dataset name
_PATH_SUFFIXES = {".txt", ".text", ".md", ".rst", ".py", ".html", ".xml", ".gz", ".zip", *DATASET_BUILDERS}


class DataError(ValueError):
    """A problem with the user's data or data options; the one-line message names the problem and the fix."""


# ---------------------------------------------------------------------------------------------------- sources


@dataclass
class SourceFile:
    relpath: str  # posix path relative to the corpus root: the document's stable key
    path: Path
    size: int
    mtime_ns: int


@dataclass
class Corpus:
    """A resolved source: where the documents come from, and a cheap fingerprint to tell when they change."""

    source: str  # as the user gave it
    kind: str  # "stdlib" | "file" | "folder" | "url" | "dataset"
    origin: str  # absolute path, URL, or dataset name
    name: str  # short human name for the output directory
    files: list[SourceFile] = field(default_factory=list)  # text documents (stdlib/file/folder/url)
    skip_binary: bool = False  # folders: skip files that look binary
    builder: str | None = None  # dataset: "parquet"/"json"/"csv" for local files, None for the hub
    config: str | None = None  # dataset: hub config name

    @property
    def is_dataset(self) -> bool:
        return self.kind == "dataset"

    def fingerprint(self) -> str:
        """Changes when the content may have: file listing with sizes and mtimes; a hub dataset's name/config."""
        listing = [(f.relpath, f.size, f.mtime_ns) for f in self.files]
        return _sha256_json({"origin": self.origin, "config": self.config, "files": listing})

    def load_dataset(self) -> Any:
        """The `datasets.Dataset` (split "train") of a dataset source."""
        import datasets  # imported lazily: slow to import, and only needed for dataset sources

        try:
            if self.builder:
                return datasets.load_dataset(self.builder, data_files=[self.origin], split="train")
            return datasets.load_dataset(self.origin, self.config, split="train")
        except Exception as e:  # datasets raises many types (hub, network, parsing): report any as one line
            if self.builder:
                raise DataError(f"could not read {self.origin} as {self.builder} ({type(e).__name__}: "
                                f"{_first_line(e)}); check the file's format") from None
            raise DataError(f"corpus not found: {self.source} (not a file, folder or URL; as a datasets hub name: "
                            f"{type(e).__name__}: {_first_line(e)}); pass an existing file/folder, a URL, or a "
                            "datasets name (name or name:config) and check your network") from None


def resolve_source(source: str, data_root: str | Path = "data") -> Corpus:
    """Parse a source string (see the module docstring). A URL is downloaded into data_root/downloads/ once."""
    source = str(source)
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"]).resolve()
        files = _walk(root, suffix=".py", skip_dirs=STDLIB_SKIP_DIRS)
        return Corpus(source, "stdlib", str(root), "stdlib", files)
    if source.startswith(("http://", "https://")):
        corpus = _local_corpus(source, download(source, Path(data_root) / "downloads"))
        corpus.name = _name_of(Path(urllib.parse.urlparse(source).path).stem or "download")
        if not corpus.is_dataset:  # (a downloaded .parquet/.jsonl/.csv stays a dataset read from the local copy)
            corpus.kind, corpus.origin = "url", source
        return corpus
    path = Path(source).expanduser()
    if path.exists():
        return _local_corpus(source, path)
    looks_like_path = source.startswith(("/", ".", "~")) or path.suffix.lower() in _PATH_SUFFIXES
    if looks_like_path or not _HUB_NAME.match(source):
        raise DataError(f"corpus not found: {source}; pass an existing file/folder, a URL, or a datasets name")
    name, _, config = source.partition(":")
    return Corpus(source, "dataset", name, _name_of(name.split("/")[-1] + (f"-{config}" if config else "")),
                  config=config or None)


def _local_corpus(source: str, path: Path) -> Corpus:
    path = path.resolve()
    if path.is_dir():
        return Corpus(source, "folder", str(path), _name_of(path.name), _walk(path), skip_binary=True)
    st = path.stat()
    files = [SourceFile(path.name, path, st.st_size, st.st_mtime_ns)]
    builder = DATASET_BUILDERS.get(path.suffix.lower())
    return Corpus(source, "dataset" if builder else "file", str(path), _name_of(path.stem), files, builder=builder)


def _walk(root: Path, suffix: str | None = None, skip_dirs: Collection[str] = ()) -> list[SourceFile]:
    """Regular files under root, sorted by relative path; hidden files and folders are skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in skip_dirs]
        for fname in filenames:
            if fname.startswith(".") or (suffix and not fname.endswith(suffix)):
                continue
            path = Path(dirpath) / fname
            try:
                st = path.stat()
            except OSError:  # broken symlink, vanished file
                continue
            if path.is_file():
                found.append(SourceFile(path.relative_to(root).as_posix(), path, st.st_size, st.st_mtime_ns))
    return sorted(found, key=lambda f: f.relpath)


def _name_of(text: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")[:40] or "corpus"


def download(url: str, dest_dir: Path, timeout: float = DOWNLOAD_TIMEOUT_S,
             max_bytes: int = DOWNLOAD_LIMIT_BYTES) -> Path:
    """Fetch url into dest_dir/<sha-of-url>-<basename> once; later calls return the cached file. The data goes to
    a temporary file renamed into place when complete, so a failed or killed download is never mistaken for one."""
    basename = _name_of(Path(urllib.parse.urlparse(url).path).name) or "download"
    dest = dest_dir / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{basename}"
    if dest.is_file():
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale(dest_dir)
    tmp = dest_dir / f".{dest.name}.tmp-{os.getpid()}"
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "minigpt"})
        with urllib.request.urlopen(request, timeout=timeout) as response, open(tmp, "wb") as f:
            length = response.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > max_bytes:
                raise DataError(f"{url} is {int(length) / 2**30:.1f} GiB, over the {max_bytes / 2**30:.1f} GiB "
                                "download limit; download it yourself and pass the file path")
            done = 0
            while chunk := response.read(CHUNK_BYTES):
                done += len(chunk)
                if done > max_bytes:
                    raise DataError(f"{url} is over the {max_bytes / 2**30:.1f} GiB download limit; "
                                    "download it yourself and pass the file path")
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except DataError:
        tmp.unlink(missing_ok=True)
        raise
    except urllib.error.HTTPError as e:
        tmp.unlink(missing_ok=True)
        raise DataError(f"could not download {url}: HTTP {e.code} {e.reason}; check the URL, or download the file "
                        "yourself and pass its path") from None
    except (OSError, ValueError) as e:  # URLError, timeouts, connection resets, disk full; ValueError: bad URL
        tmp.unlink(missing_ok=True)
        reason = getattr(e, "reason", None) or _first_line(e) or type(e).__name__
        raise DataError(f"could not download {url} ({reason}); check the URL and your network, or download the "
                        "file yourself and pass its path") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


# ------------------------------------------------------------------------------------------------ preparation


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

    Returns at once when the directory already holds a preparation of the same, unchanged source with the same
    options (force=True redoes it). With several documents the validation split takes whole documents (a
    deterministic pseudo-random ~val_fraction of the data); a single document is split on tokens: the first
    1-val_fraction to train, the rest to val (as nanoGPT does). BPE tokenizers append end-of-text after each document.
    num_proc: processes for `datasets` sources (Dataset.map); threads for BPE-encoding files.
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}; use e.g. 0.1")
    if tokenizer not in tokenizer_names():
        raise DataError(f"unknown tokenizer {tokenizer!r}; choose one of: {', '.join(tokenizer_names())}")
    data_root = Path(data_root)
    corpus = resolve_source(source, data_root)
    fingerprint = _sha256_json({"format": FORMAT_VERSION, "source": corpus.fingerprint(),
                                "tokenizer": _tokenizer_key(tokenizer), "val_fraction": val_fraction,
                                "text_column": text_column})
    slug = f"{corpus.name}-{_name_of(tokenizer)}-" + _sha256_json([corpus.origin, corpus.config, val_fraction,
                                                                     text_column])[:8]
    out = data_root / slug
    data_root.mkdir(parents=True, exist_ok=True)
    _remove_stale(data_root)
    if not force and (meta := _complete_meta(out, fingerprint)) is not None:
        print(f"data: using {out} ({meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens, "
              f"{meta['tokenizer']}), prepared earlier from the same source and tokenizer")
        return out

    tmp = data_root / f".{slug}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    t0 = time.perf_counter()
    try:
        if corpus.is_dataset:
            tok, meta = _prepare_dataset(tmp, corpus, tokenizer, val_fraction, text_column, num_proc)
        else:
            tok, meta = _prepare_files(tmp, corpus, tokenizer, val_fraction, num_proc)
        seconds = time.perf_counter() - t0
        meta = {"format_version": FORMAT_VERSION, "source": source, "kind": corpus.kind, "origin": corpus.origin,
                **meta, "tokenizer": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
                "dtype": token_dtype(tok.vocab_size).name, "val_fraction": val_fraction, "text_column": text_column,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "prepare_seconds": round(seconds, 3), "fingerprint": fingerprint}
        _write_json(tmp / "tokenizer.json", tok.to_dict())
        _write_json(tmp / "meta.json", meta)  # last: its presence marks a complete preparation
        _fsync_dir(tmp)
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
        raise DataError(f"no prepared data at {data_dir} (no meta.json); run prepare first: "
                        "minigpt.data.prepare_data(source, tokenizer) or train with --data.source")
    try:
        meta = json.loads((data_dir / "meta.json").read_text())
        tokenizer = tokenizer_from_dict(json.loads((data_dir / "tokenizer.json").read_text()))
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format_version {meta.get('format_version')}, expected {FORMAT_VERSION}")
        dtype = np.dtype(meta["dtype"])
        train = np.memmap(data_dir / "train.bin", dtype=dtype, mode="r")
        val = np.memmap(data_dir / "val.bin", dtype=dtype, mode="r")
        if len(train) != meta["train_tokens"] or len(val) != meta["val_tokens"]:
            raise ValueError("token files do not match meta.json")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"prepared data at {data_dir} is damaged or from another version ({_first_line(e)}); "
                        "delete the directory and prepare again") from None
    return PreparedData(train, val, meta, tokenizer, data_dir)


# -- files: stdlib, file, folder, url


def _prepare_files(out: Path, corpus: Corpus, tokenizer: str, val_fraction: float,
                   num_proc: int | None) -> tuple[Tokenizer, dict[str, Any]]:
    docs = [f for f in corpus.files if f.size > 0]  # an empty file holds no document
    if corpus.skip_binary:
        docs = [f for f in docs if not _looks_binary(f.path)]
    if not docs:
        raise DataError(f"corpus is empty: {corpus.origin} holds no non-empty text file; pass a file or folder "
                        "with text in it")
    content = hashlib.sha256()
    num_chars = None if tokenizer == "byte" else 0  # (the byte tokenizer never decodes the text)
    first_pass = tokenizer == "char"
    if first_pass:
        # the vocabulary is the set of the corpus's characters (and the content hash is taken while reading)
        chars: set[str] = set()
        for doc in docs:
            for text in _decode(_read_chunks(doc.path, content), doc.path, tokenizer):
                chars.update(text)
                num_chars += len(text)
        tok: Tokenizer = CharTokenizer("".join(chars))
    else:
        tok = _build_tokenizer(tokenizer)

    def pieces() -> Iterator[tuple[int, str | bytes | None]]:
        """(document index, text or bytes to encode), then (index, None) at the end of each document."""
        nonlocal num_chars
        for i, doc in enumerate(docs):
            raw = _read_chunks(doc.path, None if first_pass else content)
            if isinstance(tok, ByteTokenizer):
                yield from ((i, b) for b in raw)  # raw bytes: any file is fine, nothing to decode
            else:
                texts = _decode(raw, doc.path, tokenizer)
                if isinstance(tok, TiktokenTokenizer):
                    texts = _bpe_safe_pieces(texts)
                for text in texts:
                    if not first_pass:
                        num_chars += len(text)
                    yield i, text
            yield i, None

    sizes = [doc.size for doc in docs]
    keys = [int.from_bytes(hashlib.sha256(doc.relpath.encode()).digest()[:8], "little") for doc in docs]
    counts = _write_tokens(out, tok, pieces(), sizes, np.array(keys, dtype=np.uint64), val_fraction, num_proc)
    return tok, {"content_sha256": content.hexdigest(), "num_documents": len(docs),
                 "skipped_files": len(corpus.files) - len(docs), "num_bytes": sum(sizes), "num_chars": num_chars,
                 **counts}


def _read_chunks(path: Path, hasher: Any = None) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            if hasher is not None:
                hasher.update(chunk)
            yield chunk


def _decode(chunks: Iterable[bytes], path: Path, tokenizer: str) -> Iterator[str]:
    """UTF-8 text, chunk by chunk. char: invalid UTF-8 is an error (the vocabulary would be wrong); BPE: replaced
    by U+FFFD, as tiktoken itself decodes, so one bad byte does not stop a long preparation."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict" if tokenizer == "char" else "replace")
    offset = 0
    try:
        for chunk in chunks:
            if text := decoder.decode(chunk):
                yield text
            offset += len(chunk)
        if text := decoder.decode(b"", final=True):
            yield text
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (near byte {offset + e.start}); use the byte tokenizer "
                        "(--data.tokenizer byte), which reads any file") from None


def _bpe_safe_pieces(chunks: Iterable[str], max_carry: int = 16 * CHUNK_BYTES) -> Iterator[str]:
    """Re-cut text just after a newline that follows a non-space character and precedes a letter or digit: the
    gpt2/cl100k/o200k pre-tokenizers never merge across such a point, so encoding the pieces one by one gives the
    tokens of the whole document. A text with no such point is cut anyway past max_carry characters (bounded
    memory; the tokens there may then differ a little from encoding the whole document)."""
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


def _looks_binary(path: Path) -> bool:
    """A NUL byte in the first 8 KB (git's heuristic): images, archives, compiled files."""
    try:
        with open(path, "rb") as f:
            return b"\0" in f.read(8192)
    except OSError:
        return True


# -- datasets: local parquet/json/csv, hub


def _prepare_dataset(out: Path, corpus: Corpus, tokenizer: str, val_fraction: float, text_column: str,
                     num_proc: int | None) -> tuple[Tokenizer, dict[str, Any]]:
    import datasets

    ds = corpus.load_dataset()
    if text_column not in ds.column_names:
        raise DataError(f"column {text_column!r} not found in {corpus.source}; columns present: "
                        f"{', '.join(ds.column_names)}; pass --data.text_column NAME")
    feature = ds.features[text_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"column {text_column!r} of {corpus.source} holds {feature}, not text; pass the name of a "
                        "text column with --data.text_column NAME")
    ds = ds.select_columns([text_column])
    if tokenizer == "char":
        chars = ds.map(_batch_chars, batched=True, input_columns=text_column, remove_columns=[text_column],
                       num_proc=num_proc, desc="char vocabulary")
        tok: Tokenizer = CharTokenizer("".join(chars["chars"]))
    else:
        tok = _build_tokenizer(tokenizer)
    id_type = "uint16" if token_dtype(tok.vocab_size) == np.uint16 else "uint32"
    features = datasets.Features({"ids": datasets.List(datasets.Value(id_type)), "n_tokens": datasets.Value("int64")})
    threads = 1 if num_proc and num_proc > 1 else None  # one process: BPE uses threads instead
    tokenized = ds.map(_TokenizeBatch(tok, threads), batched=True, input_columns=text_column,
                       remove_columns=[text_column], features=features, num_proc=num_proc,
                       desc=f"tokenizing ({tok.name})")
    sizes = tokenized.with_format("arrow")["n_tokens"].to_numpy().astype(np.int64)
    keep = np.flatnonzero(sizes > 0)  # empty rows (e.g. wikitext's blank lines) are no documents
    if len(keep) == 0:
        raise DataError(f"corpus is empty: column {text_column!r} of {corpus.source} holds no text; pass a "
                        "dataset with text in it")
    content = hashlib.sha256()
    num_chars = num_bytes = 0

    def pieces() -> Iterator[tuple[int, np.ndarray | None]]:
        # the text (for the content hash and sizes) and the token ids, read side by side in the same batches
        nonlocal num_chars, num_bytes
        texts = ds.with_format("arrow").iter(batch_size=1000)
        batches = tokenized.with_format("arrow").iter(batch_size=1000)
        doc = 0
        for text_batch, id_batch in zip(texts, batches):
            for text in text_batch[text_column].to_pylist():
                if text:
                    data = text.encode("utf-8", "surrogatepass")
                    content.update(data)
                    num_chars += len(text)
                    num_bytes += len(data)
            ids = id_batch["ids"].combine_chunks()
            flat = ids.flatten().to_numpy(zero_copy_only=False)
            bounds = np.concatenate([[0], np.cumsum(id_batch["n_tokens"].to_numpy())])
            for j in range(len(ids)):
                if bounds[j + 1] > bounds[j]:
                    yield doc, flat[bounds[j]:bounds[j + 1]]  # (end-of-text already appended by the map)
                    doc += 1

    keys = _mix64(keep.astype(np.uint64))
    counts = _write_tokens(out, tok, pieces(), sizes[keep].tolist(), keys, val_fraction, num_proc)
    return tok, {"content_sha256": content.hexdigest(), "num_documents": len(keep), "skipped_files": 0,
                 "num_rows": len(sizes), "num_bytes": num_bytes, "num_chars": num_chars, **counts}


def _batch_chars(texts: list[str | None]) -> dict[str, list[str]]:
    return {"chars": ["".join(set().union(*(t for t in texts if t)))]}


class _TokenizeBatch:
    """Dataset.map function (a class so it pickles for num_proc): ids of each text, end-of-text appended."""

    def __init__(self, tok: Tokenizer, num_threads: int | None):
        self.tok, self.num_threads = tok, num_threads

    def __call__(self, texts: list[str | None]) -> dict[str, list]:
        nonempty = [t for t in texts if t]
        encoded = iter(self.tok.encode_batch(nonempty, num_threads=self.num_threads))
        ids = []
        for t in texts:
            a = next(encoded) if t else np.zeros(0, dtype=np.int64)
            if t and self.tok.eot_id is not None:
                a = np.append(a, self.tok.eot_id)
            ids.append(a)
        return {"ids": ids, "n_tokens": [len(a) for a in ids]}


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a fixed pseudo-random order of row indices, vectorized."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


# -- writing and splitting


class _TokenFile:
    """Appends token arrays to a .bin file."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype, self.count = path, dtype, 0
        self.f = open(path, "wb")

    def write(self, ids: np.ndarray) -> None:
        if len(ids):
            ids.astype(self.dtype, copy=False).tofile(self.f)
            self.count += len(ids)

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def _write_tokens(out: Path, tok: Tokenizer, pieces: Iterator[tuple[int, Any]], sizes: Sequence[int],
                  keys: np.ndarray, val_fraction: float, num_threads: int | None) -> dict[str, Any]:
    """Encode the pieces (see _prepare_files) into out/train.bin and out/val.bin, splitting as prepare_data says."""
    dtype = token_dtype(tok.vocab_size)
    single = len(sizes) == 1
    is_val = np.zeros(len(sizes), dtype=bool) if single else _choose_val_docs(keys, sizes, val_fraction)
    train, val = _TokenFile(out / "train.bin", dtype), _TokenFile(out / "val.bin", dtype)
    eot = None if tok.eot_id is None else np.array([tok.eot_id], dtype=np.int64)
    try:
        for doc, ids in _encode(tok, pieces, num_threads):
            if ids is None:
                if eot is None:
                    continue
                ids = eot
            (val if is_val[doc] else train).write(ids)
    finally:
        train.close()
        val.close()
    if single:
        _split_tail(train, val, val_fraction)
    if train.count == 0 or val.count == 0:
        raise DataError(f"corpus too small: {train.count + val.count} token(s), too few for a train/val split; "
                        "use a larger corpus")
    return {"split": "tokens" if single else "documents", "val_documents": int(is_val.sum()),
            "train_tokens": train.count, "val_tokens": val.count}


def _encode(tok: Tokenizer, pieces: Iterator[tuple[int, Any]],
            num_threads: int | None) -> Iterator[tuple[int, np.ndarray | None]]:
    """Token arrays for the pieces, in order. Text is encoded in batches so BPE can use several threads."""
    batch: list[tuple[int, Any]] = []
    size = 0

    def flush() -> Iterator[tuple[int, np.ndarray | None]]:
        texts = [p for _, p in batch if isinstance(p, str)]
        encoded = iter(tok.encode_batch(texts, num_threads) if texts else [])
        for doc, p in batch:
            if p is None or isinstance(p, np.ndarray):
                yield doc, p
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


def _choose_val_docs(keys: np.ndarray, sizes: Sequence[int], val_fraction: float) -> np.ndarray:
    """Which documents go to val: a deterministic pseudo-random set of about val_fraction of the total size.
    Documents are visited in the order of their key's hash (a path's hash, not the listing order, so adding a file
    moves few others) and taken when that brings the val size closer to the target; each side gets >= 1 document."""
    sizes = np.asarray(sizes, dtype=np.int64)
    target = val_fraction * float(sizes.sum())
    is_val = np.zeros(len(sizes), dtype=bool)
    total = 0.0
    for i in np.argsort(keys, kind="stable"):
        if total >= target:
            break
        if total + sizes[i] / 2 <= target:
            is_val[i] = True
            total += sizes[i]
    if not is_val.any():
        is_val[int(np.argmin(sizes))] = True
    if is_val.all():
        is_val[int(np.argmax(sizes))] = False
    return is_val


def _split_tail(train: _TokenFile, val: _TokenFile, val_fraction: float) -> None:
    """One document: move the last val_fraction of train.bin's tokens to val.bin (nanoGPT: first 90% / last 10%)."""
    n = train.count
    if n < 2:
        return
    n_train = min(max(int(n * (1 - val_fraction)), 1), n - 1)
    itemsize = train.dtype.itemsize
    with open(train.path, "r+b") as src, open(val.path, "wb") as dst:
        src.seek(n_train * itemsize)
        shutil.copyfileobj(src, dst, CHUNK_BYTES)
        dst.flush()
        os.fsync(dst.fileno())
        src.truncate(n_train * itemsize)
        src.flush()
        os.fsync(src.fileno())
    train.count, val.count = n_train, n - n_train


# ---------------------------------------------------------------------------------------------------- helpers


def _build_tokenizer(name: str) -> Tokenizer:
    try:
        return get_tokenizer(name)
    except ValueError as e:  # e.g. a tiktoken encoding that cannot be downloaded
        raise DataError(str(e)) from None


def _tokenizer_key(name: str) -> str:
    """The tokenizer's identity for the cache: its name, plus a hash of the ranks for an in-process encoding."""
    encoding = registered_tiktoken_encoding(name)
    if encoding is None:
        return name
    return f"{name}@{_sha256_json(TiktokenTokenizer(encoding).to_dict())[:16]}"


def _complete_meta(out: Path, fingerprint: str) -> dict[str, Any] | None:
    """meta.json of a whole preparation with this fingerprint at out, else None."""
    try:
        meta = json.loads((out / "meta.json").read_text())
        itemsize = np.dtype(meta["dtype"]).itemsize
        if (meta.get("format_version") == FORMAT_VERSION and meta.get("fingerprint") == fingerprint
                and (out / "tokenizer.json").is_file()
                and (out / "train.bin").stat().st_size == meta["train_tokens"] * itemsize
                and (out / "val.bin").stat().st_size == meta["val_tokens"] * itemsize):
            return meta
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _install(tmp: Path, out: Path) -> None:
    """Put the complete tmp dir at out: the old preparation is renamed away first, then deleted."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.rename(out, old)
    os.rename(tmp, out)
    _fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)


def _remove_stale(folder: Path) -> None:
    """Delete the leftovers (.NAME.tmp-PID, .NAME.old-PID) of preparations or downloads whose process is gone."""
    for path in folder.glob(".*"):
        m = _LEFTOVER.match(path.name)
        if m and not _pid_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__
