"""Sources: where a corpus's documents come from, and one stream of them whatever the source.

A source is one of
  "stdlib"          the running interpreter's standard library *.py files (built in, no download, ~12 MB);
  a file or folder  a text file is one document; a folder holds one document per text file (recursive, sorted;
                    hidden files/folders and binary files -- a NUL byte in the first 8 KB -- are skipped);
  an http(s) URL    downloaded once into data_root/downloads/, then handled as a local file;
  a *.parquet/.json/.jsonl/.csv file or a save_to_disk folder: a `datasets` table, a document per `text_column`;
  anything else     a Hugging Face hub dataset, "name" or "name:config" (e.g. "roneneldan/TinyStories",
                    "Salesforce/wikitext:wikitext-103-raw-v1"), split "train", one document per row.

    corpus = resolve_source("my_texts/")
    for doc in iter_documents(corpus):      # the same Document for a file and for a table row
        doc.key, doc.name, b"".join(doc.chunks)

A file is read as text whatever its container or encoding: *.gz / *.bz2 / *.xz are decompressed, and UTF-16 or
UTF-32 with a byte-order mark is converted to UTF-8 (a UTF-8 BOM is dropped). Empty files, empty rows and a
folder's binary files (and archives) hold no document: they are skipped, counted and named in corpus.skipped_files.
Only regular files (or symlinks to them) are read: a FIFO, socket or device (/dev/zero) could block or never end,
so one given as the source or found in a folder is refused. A URL is fetched by minigpt.data.download. A hub name
is refused at once when the hub's host does not resolve (no network), rather than after `datasets`' retries.
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import gzip
import hashlib
import itertools
import json
import lzma
import os
import re
import socket
import stat
import sysconfig
import urllib.parse
import urllib.request
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minigpt.core.errors import DataError, first_line
from minigpt.core.fsutil import remove_stale, write_errors
from minigpt.core.user_files import check_json_file
from minigpt.data.download import DOWNLOAD_LIMIT_BYTES, DOWNLOAD_TIMEOUT_S, fetch
from minigpt.data.tables import dataset_failure, is_saved_dataset, load_local_dataset

DEFAULT_SOURCE = "stdlib"
# the fix named when data_root cannot take prepared data or a download (full, read-only, forbidden)
DATA_ROOT_FIX = "free space there, or set data_root (train.py --data.data_root) to a writable folder with room"
CHUNK_BYTES = 1 << 20  # documents are read (and then decoded and tokenized) this much at a time
DATASET_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
# compressed text is read through its decompressor (never as compressed bytes); archives hold many files: refused
DECOMPRESSORS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
ARCHIVES = {".zip", ".tar", ".tgz", ".tbz2", ".txz", ".7z", ".rar", *(f".tar{s}" for s in DECOMPRESSORS)}
UNREAD_COMPRESSIONS = {".zst", ".lz4", ".br", ".lz"}  # refused as archives are: never read as text
# BOM -> codec; UTF-32-LE's BOM starts with UTF-16-LE's, so the longer ones are tried first
BOMS = [
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
    (codecs.BOM_UTF8, "utf-8"),
]
# Local sources up to this size are fingerprinted by their content too, not only by size and mtime (which an edit
# can keep): sha256 of 256 MB costs about 0.2-0.6 s at each start; larger sources rely on size + mtime.
CONTENT_HASH_LIMIT = 256 << 20
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
    chunks: Iterable[bytes]  # the content as UTF-8 text's bytes (or a binary file's), CHUNK_BYTES at a time


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
    skipped_files: dict[str, list[str]] = field(default_factory=dict)  # why -> relpaths, of that pass
    _dataset: Any = field(default=None, repr=False, compare=False)  # the loaded Dataset, kept for later passes

    @property
    def is_dataset(self) -> bool:
        return self.kind == "dataset"

    def fingerprint(self) -> str:
        """Changes when the content may have: the files' listing with sizes and their content hash when they are
        small enough (CONTENT_HASH_LIMIT: an edit that keeps size and modification time), else the listing with
        sizes and modification times (a `touch` or a checkout then prepares again); a hub dataset's name/config."""
        hashed = bool(self.files) and sum(f.size for f in self.files) <= CONTENT_HASH_LIMIT
        listing = [(f.relpath, f.size) if hashed else (f.relpath, f.size, f.mtime_ns) for f in self.files]
        content = None
        if hashed:
            h = hashlib.sha256()
            for f in self.files:
                h.update(f"{f.relpath}\0{f.size}\0".encode())
                try:
                    with open(f.path, "rb") as fh:
                        while chunk := fh.read(CHUNK_BYTES):
                            h.update(chunk)
                except OSError as e:
                    raise DataError(
                        f"cannot read {f.path} ({e.strerror or type(e).__name__}); check its permissions"
                    ) from None
            content = h.hexdigest()
        return sha256_json({"origin": self.origin, "config": self.config, "files": listing, "content": content})

    def load_dataset(self) -> Any:
        """The `datasets.Dataset` (split "train") of a dataset source."""
        if self._dataset is not None:
            return self._dataset
        import datasets  # imported lazily: slow to import, and only needed for dataset sources

        if not self.builder:
            check_hub_reachable(self.source)  # (before the try below, which would wrap its DataError)
        try:
            if self.builder == "json":  # before `datasets`' parsers (ujson: no depth bound) see it
                check_json_file(self.origin)
            if self.builder:
                self._dataset = load_local_dataset(self.builder, self.origin)
            else:
                with hub_retries_quiet():
                    self._dataset = datasets.load_dataset(self.origin, self.config, split="train")
        except _BUGS:
            raise
        except Exception as e:  # datasets raises many types (hub, network, parsing): report any as one line
            why = dataset_failure(e)
            raise DataError(
                f"could not read {self.origin} as a datasets save_to_disk folder ({why})"
                if self.builder == "disk"
                else f"could not read {self.origin} as {self.builder} ({why}); check the file's format"
                if self.builder
                else f"corpus not found: {self.source} (not a file, folder or URL; as a datasets hub name: "
                f"{why}); pass an existing file/folder, a URL, or a datasets name (name or name:config) "
                "and check your network"
            ) from None
        return self._dataset


def check_hub_reachable(source: str) -> None:
    """Refuse the hub dataset `source` at once when the hub's host (huggingface_hub's ENDPOINT: HF_ENDPOINT) does
    not resolve: with no network or DNS, `datasets` retries for ~25 s before failing. Only the name is looked up
    (no request sent). Skipped in offline mode (datasets reads its cache) and behind a proxy (which resolves it)."""
    import datasets
    from huggingface_hub import constants

    endpoint = urllib.parse.urlsplit(constants.ENDPOINT)
    host = endpoint.hostname
    if datasets.config.HF_HUB_OFFLINE or not host or urllib.request.getproxies().keys() & {endpoint.scheme, "all"}:
        return
    try:
        socket.getaddrinfo(host, endpoint.port or (443 if endpoint.scheme == "https" else 80), type=socket.SOCK_STREAM)
    except (OSError, ValueError) as e:  # socket.gaierror; ValueError: an HF_ENDPOINT with a bad port or host name
        reason = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e)
        mirror = " (or check HF_ENDPOINT)" if os.environ.get("HF_ENDPOINT") else ""
        raise DataError(
            f"cannot reach the Hugging Face Hub ({host}: {reason}) to read the dataset {source}; connect to the "
            f"internet{mirror}, or set HF_HUB_OFFLINE=1 to read a copy that datasets has cached, or pass a local "
            "file or folder"
        ) from None


@contextlib.contextmanager
def hub_retries_quiet() -> Iterator[None]:
    """huggingface_hub logs each retry of a failed request as warnings ("Retrying in 8s"); a failure is reported
    as one line instead, so they are held back while a hub dataset loads. A user's HF_HUB_VERBOSITY is kept."""
    from huggingface_hub.utils import logging as hub_logging

    if os.environ.get("HF_HUB_VERBOSITY"):
        yield
        return
    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()
    try:
        yield
    finally:
        hub_logging.set_verbosity(verbosity)


def resolve_source(source: str, data_root: str | Path = "data", text_column: str = "text") -> Corpus:
    """Parse a source string (see the module docstring). A URL is downloaded into data_root/downloads/ once."""
    source = str(source)  # (not empty: prepare_data refuses that, as Path("") is the current directory)
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"]).resolve()
        files = _walk(root, suffix=".py", skip_dirs=STDLIB_SKIP_DIRS, follow_links=False)  # the corpus as it was
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
    return Corpus(
        source,
        "dataset",
        name,
        slugify(name.split("/")[-1] + (f"-{config}" if config else "")),
        config=config or None,
        text_column=text_column,
    )


def iter_documents(corpus: Corpus) -> Iterator[Document]:
    """The corpus's documents in a fixed order (files sorted by path, rows in table order). Every call reads the
    source again; files and rows with no document are skipped and counted in corpus.skipped."""
    corpus.skipped, corpus.skipped_files = 0, {}
    if corpus.is_dataset:
        yield from _row_documents(corpus)
        return
    for f in corpus.files:
        if suffix := _unread_suffix(f.path):  # (a file given alone is refused by _local_corpus)
            why = "archive" if suffix in ARCHIVES else "compressed"
        else:
            chunks = _text_file_chunks(f.path)
            # the first chunk (decompressed, converted to UTF-8) tells an empty or a binary file
            first = next(chunks, b"") if f.size else b""
            why = "empty" if not first else "binary" if corpus.skip_binary and b"\0" in first[:8192] else None
        if why:
            corpus.skipped += 1
            corpus.skipped_files.setdefault(why, []).append(f.relpath)
            continue
        yield Document(f.relpath, str(f.path), itertools.chain([first], chunks))


# the columns of the rows --data.format's other objectives read (minigpt.data.conversations, preferences, prompts)
ROW_LAYOUTS = [
    ("chat", {"messages"}),
    ("chat", {"instruction", "output"}),
    ("preference", {"prompt", "chosen", "rejected"}),
    ("prompts", {"prompt", "answer"}),
]


def _row_documents(corpus: Corpus) -> Iterator[Document]:
    ds = corpus.load_dataset()
    column = corpus.text_column
    feature = ds.features.get(column)
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        problem = (
            f"not found in {corpus.source}; columns present: {', '.join(ds.column_names)}"
            if feature is None
            else f"of {corpus.source} holds {feature}, not text"
        )
        names = set(ds.column_names)
        layout = next((fmt for fmt, columns in ROW_LAYOUTS if columns <= names), None)
        if feature is None and layout is not None:  # another objective's rows: say the flag, not a text column
            raise DataError(
                f"{corpus.source} holds {layout} rows ({', '.join(ds.column_names)}), not text; train on them with "
                f"--data.format {layout}, or set --data.text_column to the column that holds the text"
            )
        raise DataError(f"column {column!r} {problem}; set --data.text_column to the column that holds the text")
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
        yield data[i : i + CHUNK_BYTES]


def _text_file_chunks(path: Path) -> Iterator[bytes]:
    """A file's text as UTF-8 bytes, CHUNK_BYTES at a time: decompressed (DECOMPRESSORS by suffix), and converted
    from UTF-16/UTF-32 when it starts with their byte-order mark. Other bytes pass as they are (the tokenizer
    decides what invalid UTF-8 means). A binary file stays binary: its NUL bytes tell it (git's heuristic)."""
    opener = DECOMPRESSORS.get(path.suffix.lower(), open)
    try:
        with opener(path, "rb") as f:
            head = f.read(4)
            codec = next((c for bom, c in BOMS if head.startswith(bom)), None)
            if codec is None:
                chunk = head + f.read(CHUNK_BYTES - len(head))
                while chunk:
                    yield chunk
                    chunk = f.read(CHUNK_BYTES)
                return
            decoder = codecs.getincrementaldecoder(codec)("strict")
            text = decoder.decode(head[len(next(b for b, c in BOMS if c == codec)) :])
            while chunk := f.read(CHUNK_BYTES):
                text += decoder.decode(chunk)
                yield text.encode("utf-8", "surrogatepass")
                text = ""
            if text := text + decoder.decode(b"", final=True):
                yield text.encode("utf-8", "surrogatepass")
    # a UTF-16/32 file that is not, a damaged or truncated .gz/.bz2/.xz, or an unreadable file
    except (UnicodeDecodeError, OSError, EOFError, lzma.LZMAError) as e:
        what = f"a valid {path.suffix} file" if opener is not open else "readable"
        raise DataError(
            f"{path} starts with a {codec.upper()} byte-order mark but is not valid {codec.upper()} "
            f"({e.reason}); convert it to UTF-8 or remove it"
            if isinstance(e, UnicodeDecodeError)
            else f"{path} is not {what} ({first_line(e)}); repair or remove it"
        ) from None


def _local_corpus(source: str, path: Path, text_column: str) -> Corpus:
    path = path.resolve()
    if path.is_dir():  # a save_to_disk folder is its rows (its .json files were read as the text)
        disk = is_saved_dataset(path)
        kind, builder = ("dataset", "disk") if disk else ("folder", None)
        return Corpus(source, kind, str(path), slugify(path.name), _walk(path), not disk, builder, None, text_column)
    st = path.stat()
    _require_regular(source, st)
    if suffix := _unread_suffix(path):
        raise DataError(
            f"{path} is an archive ({suffix}); unpack it and pass the folder"
            if suffix in ARCHIVES
            else f"{path} is {suffix} compressed, which is not read (.gz, .bz2 and .xz are); decompress it first"
        )
    files = [SourceFile(path.name, path, st.st_size, st.st_mtime_ns)]
    builder = DATASET_BUILDERS.get(path.suffix.lower())
    return Corpus(
        source,
        "dataset" if builder else "file",
        str(path),
        slugify(path.stem),
        files,
        builder=builder,
        text_column=text_column,
    )


def _unread_suffix(path: Path) -> str | None:
    """The suffix of an archive or of a compression that is not read (.zip, .tar.gz, .zst), else None."""
    suffix = "".join(path.suffixes[-2 if path.suffix.lower() in DECOMPRESSORS else -1 :]).lower()  # .tar.gz
    return suffix if suffix in ARCHIVES or suffix in UNREAD_COMPRESSIONS else None


def _walk(
    root: Path, suffix: str | None = None, skip_dirs: Collection[str] = (), follow_links: bool = True
) -> list[SourceFile]:
    """Regular files under root, sorted by relative path; hidden files and folders are skipped.  Symlinked folders
    are followed as symlinked files are (a user's folder's were left out without a word), each folder once (a link
    back up would loop), in name order so the same path always takes a folder reached twice."""
    found, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=follow_links):
        try:
            st = os.stat(dirpath)
        except OSError:  # vanished
            dirnames[:] = []
            continue
        if (st.st_dev, st.st_ino) in seen:
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in skip_dirs)
        for fname in filenames:
            if fname.startswith(".") or (suffix and not fname.endswith(suffix)):
                continue
            path = Path(dirpath) / fname
            try:
                st = path.stat()
            except OSError:  # broken symlink, vanished file
                continue
            _require_regular(path, st)
            found.append(SourceFile(path.relative_to(root).as_posix(), path, st.st_size, st.st_mtime_ns))
    return sorted(found, key=lambda f: f.relpath)


# what a path that is not a regular file is, for the message that refuses it
_SPECIAL_FILES = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _require_regular(path: str | Path, st: os.stat_result) -> None:
    """Refuse a FIFO, socket or device (st: of a symlink's target): reading one blocks or never ends (/dev/zero)."""
    if not stat.S_ISREG(st.st_mode):
        raise DataError(
            f"{path} is {_SPECIAL_FILES.get(stat.S_IFMT(st.st_mode), 'a special file')}, not a regular "
            "file: it could block or never end; pass a regular text file (save the data into one first)"
        )


def slugify(text: str) -> str:
    """A short lowercase name safe in a file name."""
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")[:40] or "corpus"


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------- download


def download(
    url: str, dest_dir: Path, timeout: float = DOWNLOAD_TIMEOUT_S, max_bytes: int = DOWNLOAD_LIMIT_BYTES
) -> Path:
    """Fetch url once into dest_dir/<sha-of-url>-<basename> (download.fetch: kept only when whole), then reuse it."""
    basename = slugify(Path(urllib.parse.urlparse(url).path).name) or "download"
    dest = dest_dir / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{basename}"
    if dest.is_file():
        return dest
    with write_errors(f"the download in {dest_dir}", DATA_ROOT_FIX):  # (a data_root under a file, read-only, full)
        dest_dir.mkdir(parents=True, exist_ok=True)
    remove_stale(dest_dir)
    fetch(url, dest, timeout, max_bytes, write_fix=DATA_ROOT_FIX)
    return dest
