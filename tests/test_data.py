"""Data preparation and tokenizers. Fast, offline: tiktoken BPEs are built locally, URLs served from 127.0.0.1."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import tiktoken

import minigpt.data as data_mod
from minigpt.data import DataError, load_prepared, prepare_data, resolve_source, token_dtype
from minigpt.tokenizers import (ByteTokenizer, CharTokenizer, TiktokenTokenizer, UnknownCharactersError,
                                get_tokenizer, register_tiktoken_encoding, tokenizer_from_dict,
                                unregister_tiktoken_encoding)

GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
MERGES = [b"th", b"the", b" t", b" the", b"in", b"ing", b"an", b"and", b" a", b"er", b"on", b"es", b"\n\n"]

TEXT = """First Citizen:
Before we proceed any further, hear me speak.

All:
Speak, speak.

First Citizen:
You are all resolved rather to die than to famish?

All:
Resolved. resolved.

First Citizen:
First, you know Caius Marcius is chief enemy to the people.
""" * 8


def make_encoding(name: str = "test_bpe", eot: int | None = None) -> tiktoken.Encoding:
    ranks = {bytes([i]): i for i in range(256)} | {m: 256 + i for i, m in enumerate(MERGES)}
    return tiktoken.Encoding(name=name, pat_str=GPT2_PAT, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": len(ranks) if eot is None else eot})


@pytest.fixture
def bpe():
    """A tiny BPE registered as tokenizer "test_bpe" (no download)."""
    enc = make_encoding()
    register_tiktoken_encoding(enc)
    yield enc
    unregister_tiktoken_encoding(enc.name)


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def docs_folder(root: Path) -> Path:
    write(root / "a.txt", "the thing and the other thing\n" * 20)
    write(root / "sub" / "b.txt", "another document, here in a sub folder\n" * 15)
    write(root / "c.md", "a third one: ünïcødé and more text\n" * 25)
    write(root / ".hidden", "skip me")
    write(root / "image.png", b"\x89PNG\r\n\x1a\n\x00\x00binary")
    return root


def all_tokens(d: Path) -> tuple[np.ndarray, np.ndarray]:
    p = load_prepared(d)
    return np.asarray(p.train), np.asarray(p.val)


# ------------------------------------------------------------------------------------------------- tokenizers


def test_tokenizer_dict_round_trip(bpe):
    text = "the thing and the other, ünïcødé 🙂\n"
    for tok in (CharTokenizer.from_texts([text]), ByteTokenizer(), TiktokenTokenizer(bpe)):
        d = json.loads(json.dumps(tok.to_dict()))  # must be plain JSON
        back = tokenizer_from_dict(d)
        assert (back.name, back.vocab_size, back.eot_id) == (tok.name, tok.vocab_size, tok.eot_id)
        assert back.encode(text) == tok.encode(text)
        assert back.decode(tok.encode(text)) == text


def test_tiktoken_tokenizer(bpe):
    tok = get_tokenizer("test_bpe")
    assert tok.eot_id == bpe.eot_token and tok.vocab_size == bpe.n_vocab
    assert tok.encode("the") == [257]
    assert tok.eot_id not in tok.encode("<|endoftext|>")  # special tokens in text are plain text
    d = tok.to_dict()
    assert set(d) >= {"name", "pat_str", "mergeable_ranks", "special_tokens"}


def test_char_tokenizer_unknown_characters():
    tok = CharTokenizer.from_texts(["hello world"])
    assert tok.vocab_size == len(set("hello world")) and tok.chars == "".join(sorted(set("hello world")))
    assert tok.decode(tok.encode("hello")) == "hello"
    with pytest.raises(UnknownCharactersError) as e:
        tok.encode("hello, Wörld")
    assert isinstance(e.value, ValueError)
    assert "','" in str(e.value) and "'W'" in str(e.value) and "'ö'" in str(e.value) and "byte" in str(e.value)


def test_byte_tokenizer_any_text():
    tok = ByteTokenizer()
    text = "plain, ünïcødé, 日本語, emoji 🙂🚀, \x00 nul"
    assert tok.encode(text) == list(text.encode())
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([0xFF, 0x68, 0x69]) == "\ufffdhi"  # broken UTF-8 decodes, never raises
    assert tok.encode("\ud800")  # even a lone surrogate encodes
    assert tok.eot_id is None and tok.vocab_size == 256


def test_get_tokenizer_errors(monkeypatch):
    with pytest.raises(ValueError, match="char.*byte.*gpt2"):
        get_tokenizer("nope")
    with pytest.raises(ValueError, match="texts"):
        get_tokenizer("char")

    import requests

    def offline(name):
        raise requests.exceptions.ConnectionError("Failed to resolve host")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(ValueError, match="TIKTOKEN_CACHE_DIR") as e:
        get_tokenizer("gpt2")
    assert "\n" not in str(e.value)

    def bug(name):
        raise TypeError("a programming error")

    monkeypatch.setattr(tiktoken, "get_encoding", bug)
    with pytest.raises(TypeError):  # not swallowed
        get_tokenizer("gpt2")


# ---------------------------------------------------------------------------------------------- preparation


def test_char_single_document_split(tmp_path):
    src = write(tmp_path / "tinyshakespeare.txt", TEXT)
    d = prepare_data(str(src), "char", data_root=tmp_path / "data")
    assert d.parent == tmp_path / "data" and d.name.startswith("tinyshakespeare-char-")
    assert sorted(p.name for p in d.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    p = load_prepared(d)
    n = len(TEXT)
    assert len(p.train) == int(n * 0.9) and len(p.val) == n - int(n * 0.9)  # nanoGPT: first 90% / last 10%
    assert p.tokenizer.decode(p.train.tolist()) == TEXT[:int(n * 0.9)]
    assert p.tokenizer.decode(p.val.tolist()) == TEXT[int(n * 0.9):]
    m = p.meta
    assert m["dtype"] == "uint16" and p.train.dtype == np.uint16
    assert m["num_documents"] == 1 and m["num_chars"] == n and m["split"] == "tokens"
    assert m["vocab_size"] == len(set(TEXT)) and m["eot_id"] is None and m["tokenizer"] == "char"
    import hashlib
    assert m["content_sha256"] == hashlib.sha256(TEXT.encode()).hexdigest()
    for key in ("source", "origin", "fingerprint", "created", "format_version", "train_tokens", "val_tokens",
                "val_fraction", "num_bytes"):
        assert key in m


def test_val_fraction(tmp_path):
    src = write(tmp_path / "t.txt", TEXT)
    p = load_prepared(prepare_data(str(src), "char", data_root=tmp_path / "data", val_fraction=0.25))
    assert len(p.train) == int(len(TEXT) * 0.75)
    with pytest.raises(DataError, match="val_fraction"):
        prepare_data(str(src), "char", data_root=tmp_path / "data", val_fraction=1.0)


def test_byte_any_file(tmp_path):
    raw = "héllo wörld 🙂\n".encode() * 50 + b"\xff\xfe invalid utf-8 \x00\x80\n" * 10
    src = write(tmp_path / "mixed.bin.txt", raw)
    train, val = all_tokens(prepare_data(str(src), "byte", data_root=tmp_path / "data"))
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == raw
    with pytest.raises(DataError, match="--data.tokenizer byte"):  # char needs UTF-8
        prepare_data(str(src), "char", data_root=tmp_path / "data")


def test_bpe_folder_eot_between_documents(tmp_path, bpe):
    folder = docs_folder(tmp_path / "corpus")
    d = prepare_data(str(folder), "test_bpe", data_root=tmp_path / "data")
    p = load_prepared(d)
    eot = bpe.eot_token
    assert p.tokenizer.eot_id == eot and p.meta["eot_id"] == eot
    assert p.meta["num_documents"] == 3 and p.meta["skipped_files"] == 1  # .hidden not listed, image.png binary
    assert p.meta["split"] == "documents" and p.meta["val_documents"] >= 1
    texts = [(folder / n).read_text() for n in ("a.txt", "c.md", "sub/b.txt")]  # sorted by relative path
    docs = []
    for split in (p.train, p.val):
        ids = split.tolist()
        assert ids[-1] == eot  # each split is whole documents, each followed by end-of-text
        while ids:
            k = ids.index(eot)
            docs.append(ids[:k])
            ids = ids[k + 1:]
    assert sorted(p.tokenizer.decode(x) for x in docs) == sorted(texts)
    assert sorted(map(tuple, docs)) == sorted(tuple(bpe.encode_ordinary(t)) for t in texts)


def test_bpe_chunked_reading_is_exact(tmp_path, bpe, monkeypatch):
    monkeypatch.setattr(data_mod, "CHUNK_BYTES", 64)  # many chunks per document
    src = write(tmp_path / "t.txt", TEXT + "no newline at the end")
    train, val = all_tokens(prepare_data(str(src), "test_bpe", data_root=tmp_path / "data"))
    assert np.concatenate([train, val]).tolist() == bpe.encode_ordinary(src.read_text()) + [bpe.eot_token]


def test_token_dtype_and_uint32(tmp_path):
    assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(200_019) == np.uint32
    enc = make_encoding("big_bpe", eot=70_000)  # a sparse id space: vocab_size 70001 without 70k ranks
    register_tiktoken_encoding(enc)
    try:
        folder = docs_folder(tmp_path / "corpus")
        p = load_prepared(prepare_data(str(folder), "big_bpe", data_root=tmp_path / "data"))
    finally:
        unregister_tiktoken_encoding("big_bpe")
    assert p.meta["dtype"] == "uint32" and p.train.dtype == np.uint32 and p.meta["vocab_size"] == 70_001
    assert p.train[-1] == 70_000 and p.val[-1] == 70_000
    assert (p.path / "train.bin").stat().st_size == 4 * p.meta["train_tokens"]


def test_document_split_deterministic(tmp_path):
    folder = tmp_path / "corpus"
    for i in range(20):
        write(folder / f"doc{i:02d}.txt", f"document number {i}\n" * (10 + i))
    a = load_prepared(prepare_data(str(folder), "char", data_root=tmp_path / "d1"))
    b = load_prepared(prepare_data(str(folder), "char", data_root=tmp_path / "d2", force=True))
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    val_text = a.tokenizer.decode(a.val.tolist())
    val_docs = [i for i in range(20) if f"document number {i}\n" in val_text]
    assert val_text == "".join(f"document number {i}\n" * (10 + i) for i in val_docs)  # whole documents
    assert 0.05 < len(a.val) / (len(a.train) + len(a.val)) < 0.2
    # two documents: each side gets one
    two = tmp_path / "two"
    write(two / "x.txt", "x" * 1000)
    write(two / "y.txt", "y" * 10)
    p = load_prepared(prepare_data(str(two), "char", data_root=tmp_path / "d3"))
    assert len(p.val) > 0 and len(p.train) > 0 and p.meta["val_documents"] == 1


def test_cache_and_source_change(tmp_path, monkeypatch):
    src = write(tmp_path / "t.txt", TEXT)
    d = prepare_data(str(src), "char", data_root=tmp_path / "data")
    calls = []
    real = data_mod._write_tokens
    monkeypatch.setattr(data_mod, "_write_tokens", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert prepare_data(str(src), "char", data_root=tmp_path / "data") == d
    assert prepare_data(f"{tmp_path}/./t.txt", "char", data_root=tmp_path / "data") == d  # same file
    assert calls == []
    prepare_data(str(src), "char", data_root=tmp_path / "data", force=True)
    assert calls == [1]
    with open(src, "a") as f:  # edit the source: prepared again
        f.write("a new line!\n")
    assert prepare_data(str(src), "char", data_root=tmp_path / "data") == d
    assert calls == [1, 1]
    assert load_prepared(d).meta["num_chars"] == len(TEXT) + 12
    # another tokenizer or val_fraction is another directory
    assert prepare_data(str(src), "byte", data_root=tmp_path / "data") != d
    assert prepare_data(str(src), "char", data_root=tmp_path / "data", val_fraction=0.2) != d


def test_crash_leaves_old_preparation(tmp_path, monkeypatch):
    folder = docs_folder(tmp_path / "corpus")
    root = tmp_path / "data"
    d = prepare_data(str(folder), "char", data_root=root)
    old_meta = load_prepared(d).meta
    write(folder / "new.txt", "one more document\n" * 10)  # the source changed: a new preparation starts

    real = CharTokenizer.encode_array
    calls = []

    def flaky(self, text):
        calls.append(1)
        if len(calls) >= 2:
            raise RuntimeError("killed mid-preparation")
        return real(self, text)

    monkeypatch.setattr(CharTokenizer, "encode_array", flaky)
    with pytest.raises(RuntimeError, match="killed"):
        prepare_data(str(folder), "char", data_root=root)
    assert load_prepared(d).meta == old_meta  # the old, complete preparation is untouched
    assert sorted(p.name for p in root.iterdir()) == [d.name]  # and nothing else is left
    monkeypatch.setattr(CharTokenizer, "encode_array", real)

    # a preparation killed for real leaves its temporary dir: the next run removes it
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = root / f".{d.name}.tmp-{dead.pid}"
    write(leftover / "train.bin", b"\0" * 10)
    assert prepare_data(str(folder), "char", data_root=root) == d
    assert load_prepared(d).meta["num_documents"] == 4
    assert sorted(p.name for p in root.iterdir()) == [d.name]


def test_incomplete_dir_is_not_used(tmp_path):
    src = write(tmp_path / "t.txt", TEXT)
    d = prepare_data(str(src), "char", data_root=tmp_path / "data")
    (d / "meta.json").unlink()  # as if written by hand or damaged
    with pytest.raises(DataError, match="no prepared data"):
        load_prepared(d)
    assert prepare_data(str(src), "char", data_root=tmp_path / "data") == d
    assert len(load_prepared(d).train) == int(len(TEXT) * 0.9)


def test_jsonl_dataset_source(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    rows = [{"id": i, "text": f"row {i}: the quick brown fox\n" * (i % 3 + 1)} for i in range(30)]
    rows.append({"id": 99, "text": ""})  # empty rows are no documents
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = load_prepared(prepare_data(str(src), "char", data_root=tmp_path / "data"))
    assert p.meta["kind"] == "dataset" and p.meta["num_documents"] == 30 and p.meta["split"] == "documents"
    text = p.tokenizer.decode(p.train.tolist()) + p.tokenizer.decode(p.val.tolist())
    assert sorted(text.split("\n")) == sorted("".join(r["text"] for r in rows).split("\n"))
    assert p.meta["num_chars"] == sum(len(r["text"]) for r in rows)
    with pytest.raises(DataError, match=r"'body' not found.*columns present: id, text"):
        prepare_data(str(src), "char", data_root=tmp_path / "data", text_column="body")


def test_jsonl_dataset_bpe(tmp_path, monkeypatch, bpe):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    texts = [f"the {i} thing and the other\n" * 3 for i in range(12)]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    p = load_prepared(prepare_data(str(src), "test_bpe", data_root=tmp_path / "data"))
    ids = p.train.tolist() + p.val.tolist()
    assert ids.count(bpe.eot_token) == 12 and p.val[-1] == bpe.eot_token
    assert sorted(p.tokenizer.decode(ids).split("<|endoftext|>"))[1:] == sorted(texts)


def test_hub_name_resolution_is_lazy():
    c = resolve_source("Salesforce/wikitext:wikitext-2-raw-v1")
    assert (c.kind, c.origin, c.config) == ("dataset", "Salesforce/wikitext", "wikitext-2-raw-v1")
    assert c.name == "wikitext-wikitext-2-raw-v1"
    assert resolve_source("roneneldan/TinyStories").config is None


class _Server:
    def __init__(self, root: Path):
        self.requests = 0
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a, **k):
                super().__init__(*a, directory=str(root), **k)

            def do_GET(self):
                server.requests += 1
                super().do_GET()

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()


@pytest.fixture
def server(tmp_path):
    s = _Server(write(tmp_path / "www" / "input.txt", TEXT).parent)
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def test_url_source(tmp_path, server):
    url = f"{server.url}/input.txt"
    d = prepare_data(url, "char", data_root=tmp_path / "data")
    assert server.requests == 1 and d.name.startswith("input-char-")
    downloads = list((tmp_path / "data" / "downloads").iterdir())
    assert len(downloads) == 1 and downloads[0].name.endswith("-input.txt")
    assert downloads[0].read_text() == TEXT
    meta = load_prepared(d).meta
    assert (meta["kind"], meta["origin"], meta["source"]) == ("url", url, url)
    assert prepare_data(url, "char", data_root=tmp_path / "data") == d
    assert prepare_data(url, "byte", data_root=tmp_path / "data") != d
    assert server.requests == 1  # downloaded once


def test_url_404(tmp_path, server):
    with pytest.raises(DataError, match="HTTP 404.*download the file yourself"):
        prepare_data(f"{server.url}/missing.txt", "char", data_root=tmp_path / "data")
    assert list((tmp_path / "data" / "downloads").iterdir()) == []


def test_url_size_limit(tmp_path, server):
    with pytest.raises(DataError, match="limit"):
        data_mod.download(f"{server.url}/input.txt", tmp_path / "dl", max_bytes=100)
    assert list((tmp_path / "dl").iterdir()) == []


def test_errors(tmp_path):
    root = tmp_path / "data"
    with pytest.raises(DataError, match="corpus not found: .*nope.txt; pass an existing file/folder, a URL"):
        prepare_data(str(tmp_path / "nope.txt"), "char", data_root=root)
    with pytest.raises(DataError, match="empty"):
        prepare_data(str(write(tmp_path / "empty.txt", "")), "char", data_root=root)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="empty"):
        prepare_data(str(tmp_path / "empty_dir"), "byte", data_root=root)
    latin1 = write(tmp_path / "latin1.txt", "caf\xe9 cr\xe8me\n".encode("latin-1") * 10)
    with pytest.raises(DataError, match="not UTF-8.*--data.tokenizer byte"):
        prepare_data(str(latin1), "char", data_root=root)
    with pytest.raises(DataError, match="unknown tokenizer 'nope'.*char, byte.*gpt2.*cl100k_base"):
        prepare_data(str(latin1), "nope", data_root=root)
    with pytest.raises(DataError, match="too small"):
        prepare_data(str(write(tmp_path / "one.txt", "x")), "char", data_root=root)
    with pytest.raises(DataError, match="no prepared data"):
        load_prepared(tmp_path / "nothing")
    assert not list(root.glob(".*"))  # no temporary directories left behind


def test_stdlib_source(tmp_path):
    c = resolve_source("stdlib")
    assert data_mod.DEFAULT_SOURCE == "stdlib" and c.kind == "stdlib"
    assert len(c.files) > 300
    assert all(f.relpath.endswith(".py") for f in c.files)
    assert not any(part in ("test", "tests", "idle_test", "site-packages", "__pycache__")
                   for f in c.files for part in f.relpath.split("/")[:-1])
    assert [f.relpath for f in c.files] == sorted(f.relpath for f in c.files)
    assert 3e6 < sum(f.size for f in c.files) < 40e6
    p = load_prepared(prepare_data("stdlib", "byte", data_root=tmp_path / "data"))
    assert p.meta["num_documents"] > 300 and p.meta["train_tokens"] > 8 * p.meta["val_tokens"] / 2
    assert len(p.train) + len(p.val) == p.meta["num_bytes"]
