"""Sources: where a corpus's documents come from, and one stream of them whatever the source.

A source is one of
  "stdlib"          the running interpreter's standard library *.py files (built in, no download, ~12 MB);
  a file or folder  a text file is one document; a folder holds one document per text file (recursive, sorted;
                    hidden files/folders and binary files -- a NUL byte in the first 8 KB -- are skipped);
  an http(s) URL    downloaded once into data_root/downloads/, then handled as a local file;
  a *.parquet, *.json, *.jsonl or *.csv file: rows of a `datasets` table, one document per row of `text_column`;
  anything else     a Hugging Face hub dataset, "name" or "name:config" (e.g. "roneneldan/TinyStories",
                    "Salesforce/wikitext:wikitext-103-raw-v1"), split "train", one document per row.

    corpus = resolve_source("my_texts/")
    for doc in iter_documents(corpus):      # the same Document for a file and for a table row
        doc.key, doc.name, b"".join(doc.chunks)

Empty files, empty rows and a folder's binary files hold no document: they are skipped (and counted).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sysconfig
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minigpt.errors import DataError, first_line
from minigpt.fsutil import atomic_write, remove_stale

DEFAULT_SOURCE = "stdlib"
CHUNK_BYTES = 1 << 20  # documents are read (and then decoded and tokenized) this much at a time
DOWNLOAD_TIMEOUT_S = 30.0
DOWNLOAD_LIMIT_BYTES = 2 << 30
DATASET_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
# The test suites (test/, tests/, idlelib/idle_test/) are 19 of the stdlib's 31 MB of *.py; without them ~12 MB.
STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?(:[\w.-]+)?$")
# a missing source with one of these suffixes is a mistyped path, not a hub dataset name
_PATH_SUFFIXES = {".txt", ".text", ".md", ".rst", ".py", ".html", ".xml", ".gz", ".zip", *DATASET_BUILDERS}
# what a bug looks like: these keep their traceback even when raised from inside `datasets`
_BUGS = (TypeError, AttributeError, NameError, AssertionError, ImportError)


@dataclass
class SourceFile:
    relpath: str  # posix path relative to the corpus root: the document's key
    path: Path
    size: int
    mtime_ns: int


@dataclass
class Document:
    """One document of any source. The train/val split places it by a hash of its key, so the key must not
    depend on the rest of the corpus: a file's path relative to the corpus root, or "row:{i}" for table row i."""

    key: str
    name: str  # for messages: the file's path, or "<source> row i"
    chunks: Iterable[bytes]  # the content, CHUNK_BYTES at a time; a file is opened only when this is read


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
    text_column: str = "text"  # dataset: the column that holds each row's document
    skipped: int = 0  # files or rows that held no document, counted by the last iter_documents pass
    _dataset: Any = field(default=None, repr=False, compare=False)  # the loaded Dataset, kept for later passes

    @property
    def is_dataset(self) -> bool:
        return self.kind == "dataset"

    def fingerprint(self) -> str:
        """Changes when the content may have: file listing with sizes and mtimes; a hub dataset's name/config."""
        listing = [(f.relpath, f.size, f.mtime_ns) for f in self.files]
        return sha256_json({"origin": self.origin, "config": self.config, "files": listing})

    def load_dataset(self) -> Any:
        """The `datasets.Dataset` (split "train") of a dataset source."""
        if self._dataset is not None:
            return self._dataset
        import datasets  # imported lazily: slow to import, and only needed for dataset sources

        try:
            if self.builder:
                self._dataset = datasets.load_dataset(self.builder, data_files=[self.origin], split="train")
            else:
                self._dataset = datasets.load_dataset(self.origin, self.config, split="train")
        except _BUGS:
            raise
        except Exception as e:  # datasets raises many types (hub, network, parsing): report any as one line
            if self.builder:
                raise DataError(f"could not read {self.origin} as {self.builder} ({type(e).__name__}: "
                                f"{first_line(e)}); check the file's format") from None
            raise DataError(f"corpus not found: {self.source} (not a file, folder or URL; as a datasets hub name: "
                            f"{type(e).__name__}: {first_line(e)}); pass an existing file/folder, a URL, or a "
                            "datasets name (name or name:config) and check your network") from None
        return self._dataset


def resolve_source(source: str, data_root: str | Path = "data", text_column: str = "text") -> Corpus:
    """Parse a source string (see the module docstring). A URL is downloaded into data_root/downloads/ once."""
    source = str(source)
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"]).resolve()
        files = _walk(root, suffix=".py", skip_dirs=STDLIB_SKIP_DIRS)
        return Corpus(source, "stdlib", str(root), "stdlib", files)
    if source.startswith(("http://", "https://")):
        corpus = _local_corpus(source, download(source, Path(data_root) / "downloads"), text_column)
        corpus.name = slugify(Path(urllib.parse.urlparse(source).path).stem or "download")
        if not corpus.is_dataset:  # (a downloaded .parquet/.jsonl/.csv stays a dataset read from the local copy)
            corpus.kind, corpus.origin = "url", source
        return corpus
    path = Path(source).expanduser()
    if path.exists():
        return _local_corpus(source, path, text_column)
    looks_like_path = source.startswith(("/", ".", "~")) or path.suffix.lower() in _PATH_SUFFIXES
    if looks_like_path or not _HUB_NAME.match(source):
        raise DataError(f"corpus not found: {source}; pass an existing file/folder, a URL, or a datasets name")
    name, _, config = source.partition(":")
    return Corpus(source, "dataset", name, slugify(name.split("/")[-1] + (f"-{config}" if config else "")),
                  config=config or None, text_column=text_column)


def iter_documents(corpus: Corpus) -> Iterator[Document]:
    """The corpus's documents in a fixed order (files sorted by path, rows in table order). Every call reads the
    source again; files and rows with no document are skipped and counted in corpus.skipped."""
    corpus.skipped = 0
    if corpus.is_dataset:
        yield from _row_documents(corpus)
        return
    for f in corpus.files:
        if f.size == 0 or (corpus.skip_binary and _looks_binary(f.path)):
            corpus.skipped += 1
            continue
        yield Document(f.relpath, str(f.path), _read_chunks(f.path))


def _row_documents(corpus: Corpus) -> Iterator[Document]:
    ds = corpus.load_dataset()
    column = corpus.text_column
    if column not in ds.column_names:
        raise DataError(f"column {column!r} not found in {corpus.source}; columns present: "
                        f"{', '.join(ds.column_names)}; set text_column to the column that holds the text")
    feature = ds.features[column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"column {column!r} of {corpus.source} holds {feature}, not text; set text_column to the "
                        "name of a text column")
    i = 0
    for batch in ds.select_columns([column]).with_format("arrow").iter(batch_size=1000):
        for text in batch[column].to_pylist():
            if text:
                yield Document(f"row:{i}", f"{corpus.source} row {i}", _text_chunks(text))
            else:  # e.g. wikitext's blank lines
                corpus.skipped += 1
            i += 1


def _text_chunks(text: str) -> Iterator[bytes]:
    data = text.encode("utf-8")  # Arrow strings are valid UTF-8: this never fails
    for i in range(0, len(data), CHUNK_BYTES):
        yield data[i:i + CHUNK_BYTES]


def _read_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            yield chunk


def _looks_binary(path: Path) -> bool:
    """A NUL byte in the first 8 KB (git's heuristic): images, archives, compiled files."""
    try:
        with open(path, "rb") as f:
            return b"\0" in f.read(8192)
    except OSError:
        return True


def _local_corpus(source: str, path: Path, text_column: str) -> Corpus:
    path = path.resolve()
    if path.is_dir():
        return Corpus(source, "folder", str(path), slugify(path.name), _walk(path), skip_binary=True)
    st = path.stat()
    files = [SourceFile(path.name, path, st.st_size, st.st_mtime_ns)]
    builder = DATASET_BUILDERS.get(path.suffix.lower())
    return Corpus(source, "dataset" if builder else "file", str(path), slugify(path.stem), files, builder=builder,
                  text_column=text_column)


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


def slugify(text: str) -> str:
    """A short lowercase name safe in a file name."""
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")[:40] or "corpus"


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------- download


def download(url: str, dest_dir: Path, timeout: float = DOWNLOAD_TIMEOUT_S,
             max_bytes: int = DOWNLOAD_LIMIT_BYTES) -> Path:
    """Fetch url into dest_dir/<sha-of-url>-<basename> once; later calls return the cached file. The data goes to
    a temporary file renamed into place when complete, so a failed or killed download is never mistaken for one."""
    basename = slugify(Path(urllib.parse.urlparse(url).path).name) or "download"
    dest = dest_dir / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{basename}"
    if dest.is_file():
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    remove_stale(dest_dir)
    too_big = (f"{url} is over the {max_bytes / 2**30:.1f} GiB download limit; download it yourself and pass the "
               "file path")

    def copy(response: Any, f: Any) -> None:
        done = 0
        while chunk := response.read(CHUNK_BYTES):
            done += len(chunk)
            if done > max_bytes:
                raise DataError(too_big)
            f.write(chunk)

    try:
        request = urllib.request.Request(url, headers={"User-Agent": "minigpt"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            length = response.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > max_bytes:
                raise DataError(too_big)
            atomic_write(dest, lambda f: copy(response, f))
    except urllib.error.HTTPError as e:
        raise DataError(f"could not download {url}: HTTP {e.code} {e.reason}; check the URL, or download the file "
                        "yourself and pass its path") from None
    except (OSError, ValueError) as e:  # URLError, timeouts, connection resets, disk full; ValueError: bad URL
        reason = getattr(e, "reason", None) or first_line(e)
        raise DataError(f"could not download {url} ({reason}); check the URL and your network, or download the "
                        "file yourself and pass its path") from None
    return dest
