"""Data sources, preparation and tokenizers. Fast, offline: tiktoken BPEs are built locally and given as tokenizer
files, URLs are served from 127.0.0.1."""

from __future__ import annotations

import hashlib
import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import tiktoken

import minigpt.data.encoding as encoding_mod
import minigpt.data.prepare as prepare_mod
import minigpt.data.sources as sources_mod
import minigpt.data.token_files as token_files_mod
from minigpt.core.errors import CheckpointError, DataError, UnknownCharactersError, UserError
from minigpt.core.hf_tokenizer import HFTokenizer
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer, TiktokenTokenizer, get_tokenizer, tokenizer_from_dict
from minigpt.data.prepare import load_prepared, prepare_data
from minigpt.data.sources import iter_documents, resolve_source
from minigpt.data.token_files import token_dtype
from support import spm_bpe

GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
MERGES = [b"th", b"the", b" t", b" the", b"in", b"ing", b"an", b"and", b" a", b"er", b"on", b"es", b"\n\n"]

TEXT = (
    """First Citizen:
Before we proceed any further, hear me speak.

All:
Speak, speak.

First Citizen:
You are all resolved rather to die than to famish?

All:
Resolved. resolved.

First Citizen:
First, you know Caius Marcius is chief enemy to the people.
"""
    * 8
)


def make_encoding(name: str = "test_bpe", eot: int | None = None) -> tiktoken.Encoding:
    ranks = {bytes([i]): i for i in range(256)} | {m: 256 + i for i, m in enumerate(MERGES)}
    return tiktoken.Encoding(
        name=name,
        pat_str=GPT2_PAT,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": len(ranks) if eot is None else eot},
    )


def tokenizer_file(path: Path, enc: tiktoken.Encoding) -> Path:
    """A tokenizer file (minigpt's JSON format) holding this BPE: no download."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(TiktokenTokenizer(enc).to_dict()))
    return path


@pytest.fixture
def bpe():
    """A tiny BPE (no download)."""
    return make_encoding()


@pytest.fixture
def bpe_file(tmp_path, bpe) -> str:
    """The tiny BPE as a tokenizer file: the tokenizer setting that uses it."""
    return str(tokenizer_file(tmp_path / "tokenizers" / "test_bpe.json", bpe))


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


def documents(p) -> list[list[int]]:
    """The token ids of each document of a BPE preparation (each ends with end-of-text), train then val."""
    docs = []
    for split in (p.train, p.val):
        ids = split.tolist()
        while ids:
            k = ids.index(p.tokenizer.eot_id)
            docs.append(ids[:k])
            ids = ids[k + 1 :]
    return docs


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))


def write_jsonl(path: Path, texts: list[str]) -> Path:
    return write(path, "".join(json.dumps({"text": t}) + "\n" for t in texts))


# ------------------------------------------------------------------------------------------------- tokenizers


def test_tokenizer_dict_round_trip(bpe):
    text = "the thing and the other, ünïcødé 🙂\n"
    for tok in (CharTokenizer.from_texts([text]), ByteTokenizer(), TiktokenTokenizer(bpe)):
        d = json.loads(json.dumps(tok.to_dict()))  # must be plain JSON
        back = tokenizer_from_dict(d)
        assert (back.name, back.vocab_size, back.eot_id) == (tok.name, tok.vocab_size, tok.eot_id)
        assert back.encode(text) == tok.encode(text)
        assert back.decode(tok.encode(text)) == text


def test_tiktoken_tokenizer(bpe, bpe_file):
    tok = get_tokenizer(bpe_file)
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
    assert isinstance(e.value, UserError) and not isinstance(e.value, ValueError)
    assert "','" in str(e.value) and "'W'" in str(e.value) and "'ö'" in str(e.value) and "byte" in str(e.value)


def test_byte_tokenizer_any_text():
    tok = ByteTokenizer()
    text = "plain, ünïcødé, 日本語, emoji 🙂🚀, \x00 nul"
    assert tok.encode(text) == list(text.encode())
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([0xFF, 0x68, 0x69]) == "\ufffdhi"  # broken UTF-8 decodes, never raises
    assert tok.encode("\ud800")  # even a lone surrogate encodes
    assert tok.eot_id is None and tok.vocab_size == 256


def test_get_tokenizer_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="char.*byte.*gpt2.*tokenizer JSON file"):
        get_tokenizer("nope")
    with pytest.raises(DataError, match="tokenizer file not found"):
        get_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(DataError, match="not JSON"):
        get_tokenizer(str(write(tmp_path / "garbage.json", "{nope")))
    with pytest.raises(DataError, match="does not hold a minigpt tokenizer.*unknown tokenizer type 'sentencepiece'"):
        get_tokenizer(str(write(tmp_path / "other.json", '{"type": "sentencepiece"}')))
    with pytest.raises(ValueError, match="texts") as e:  # a caller's mistake (a bug), not the user's
        get_tokenizer("char")
    assert not isinstance(e.value, UserError)

    import requests

    def offline(name):
        raise requests.exceptions.ConnectionError("Failed to resolve host")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(DataError, match="TIKTOKEN_CACHE_DIR") as e:
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
    assert p.tokenizer.decode(p.train.tolist()) == TEXT[: int(n * 0.9)]
    assert p.tokenizer.decode(p.val.tolist()) == TEXT[int(n * 0.9) :]
    m = p.meta
    assert m["dtype"] == "uint16" and p.train.dtype == np.uint16
    assert m["num_documents"] == 1 and m["num_chars"] == n and m["split"] == "tokens"
    assert m["vocab_size"] == len(set(TEXT)) and m["eot_id"] is None and m["tokenizer"] == "char"
    assert m["content_sha256"] == hashlib.sha256(TEXT.encode()).hexdigest()
    for key in (
        "source",
        "origin",
        "fingerprint",
        "created",
        "format_version",
        "train_tokens",
        "val_tokens",
        "val_fraction",
        "num_bytes",
    ):
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
    with pytest.raises(DataError, match="byte tokenizer"):  # char needs UTF-8
        prepare_data(str(src), "char", data_root=tmp_path / "data")


def test_bpe_folder_eot_between_documents(tmp_path, bpe, bpe_file):
    folder = docs_folder(tmp_path / "corpus")
    d = prepare_data(str(folder), bpe_file, data_root=tmp_path / "data")
    p = load_prepared(d)
    eot = bpe.eot_token
    assert p.tokenizer.eot_id == eot and p.meta["eot_id"] == eot
    assert p.meta["num_documents"] == 3 and p.meta["skipped"] == 1  # .hidden not listed, image.png binary
    assert p.meta["split"] == "documents" and p.meta["val_documents"] >= 1
    texts = [(folder / n).read_text() for n in ("a.txt", "c.md", "sub/b.txt")]  # sorted by relative path
    docs = []
    for split in (p.train, p.val):
        ids = split.tolist()
        assert ids[-1] == eot  # each split is whole documents, each followed by end-of-text
        while ids:
            k = ids.index(eot)
            docs.append(ids[:k])
            ids = ids[k + 1 :]
    assert sorted(p.tokenizer.decode(x) for x in docs) == sorted(texts)
    assert sorted(map(tuple, docs)) == sorted(tuple(bpe.encode_ordinary(t)) for t in texts)


def test_bpe_chunked_reading_is_exact(tmp_path, bpe, bpe_file, monkeypatch):
    monkeypatch.setattr(sources_mod, "CHUNK_BYTES", 64)  # many chunks per document
    src = write(tmp_path / "t.txt", TEXT + "no newline at the end")
    train, val = all_tokens(prepare_data(str(src), bpe_file, data_root=tmp_path / "data"))
    assert np.concatenate([train, val]).tolist() == bpe.encode_ordinary(src.read_text()) + [bpe.eot_token]
    monkeypatch.setattr(encoding_mod, "MAX_CARRY_CHARS", 200)  # a text with no newline to cut after: one line
    src = write(tmp_path / "line.txt", TEXT.replace("\n", "  "))
    train, val = all_tokens(prepare_data(str(src), bpe_file, data_root=tmp_path / "data"))
    assert np.concatenate([train, val]).tolist() == bpe.encode_ordinary(src.read_text()) + [bpe.eot_token]


def framed_spm_file(path: Path, template: str) -> HFTokenizer:
    """Llama 2's kind of tokenizer.json (SentencePiece BPE) whose post-processor writes `template` around a text."""
    import tokenizers as t

    backend = t.Tokenizer.from_str(spm_bpe("llama2").tokenizer_json)
    backend.post_processor = t.processors.TemplateProcessing(single=template, special_tokens=[("<s>", 1), ("</s>", 2)])
    path.write_text(backend.to_str())
    return HFTokenizer(backend.to_str(), eos_id=2)


@pytest.mark.parametrize("template", ["<s> $A", "<s> $A </s>"])
def test_a_tokenizer_json_encodes_a_document_read_in_chunks_as_the_whole_text(tmp_path, monkeypatch, template):
    # the document is read 64 bytes at a time; each piece encoded on its own got the post-processor's <s> (and a
    # SentencePiece "▁" where a word was cut): a <s> every 1 MiB of a long document
    monkeypatch.setattr(sources_mod, "CHUNK_BYTES", 64)
    tok = framed_spm_file(tmp_path / "tokenizer.json", template)
    src = write(tmp_path / "t.txt", "the thing and the other things, hello world and the end of it all\n" * 30)
    ids = np.concatenate(all_tokens(prepare_data(str(src), str(tmp_path / "tokenizer.json"), data_root=tmp_path)))
    assert ids.tolist() == tok.encode(src.read_text())
    # past WHOLE_CHARS a document is cut after a newline (bounded memory); it keeps one start and one end
    monkeypatch.setattr(encoding_mod, "WHOLE_CHARS", 300)
    d = prepare_data(str(src), str(tmp_path / "tokenizer.json"), data_root=tmp_path, force=True)
    ids = np.concatenate(all_tokens(d))
    assert ids[0] == 1 and (ids == 1).sum() == 1 and (ids == 2).sum() == template.count("</s>")
    assert (ids[-1] == 2) == template.endswith("</s>") and len(ids) > 100


@pytest.mark.parametrize("family", ["gpt2", "llama3", "qwen2"])
def test_a_byte_level_tokenizer_json_cuts_where_its_regex_never_merges(tmp_path, monkeypatch, family):
    # bpe:VOCAB's and GPT-2's own split (ByteLevel's regex); Llama 3's and Qwen2's (a Split regex, then ByteLevel,
    # Llama 3 with a <|begin_of_text|> before each text, Qwen2 with NFC first): cut where tiktoken's are, each
    # document's ids are the whole text's; pieces cut at the 64-byte reads lost their merges
    import tokenizers as t

    from minigpt.core.hf_tokenizer import SPLIT_REGEXES

    monkeypatch.setattr(sources_mod, "CHUNK_BYTES", 64)
    backend = t.Tokenizer(t.models.BPE())
    regex = SPLIT_REGEXES[0 if family == "llama3" else 1]
    split = t.pre_tokenizers.Split(t.Regex(regex), behavior="isolated")
    backend.pre_tokenizer = (
        t.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if family == "gpt2"
        else t.pre_tokenizers.Sequence([split, t.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    )
    backend.normalizer = t.normalizers.NFC() if family == "qwen2" else None
    backend.decoder = t.decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|begin_of_text|>"]
    alphabet = t.pre_tokenizers.ByteLevel.alphabet()
    backend.train_from_iterator(
        [TEXT], t.trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, special_tokens=specials)
    )
    if family == "llama3":
        backend.post_processor = t.processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 1)]
        )
    (tmp_path / "tokenizer.json").write_text(backend.to_str())
    tok = HFTokenizer(backend.to_str())
    assert tok.cuts_as_tiktoken and tok.frame == ([1] if family == "llama3" else [], [])
    src = write(tmp_path / "t.txt", TEXT * 3)
    ids = np.concatenate(all_tokens(prepare_data(str(src), str(tmp_path / "tokenizer.json"), data_root=tmp_path)))
    assert ids.tolist() == tok.encode(src.read_text()) + [0]  # <|endoftext|> after it
    # no such newline (one line; lines that start with "<"): cut before a space that follows a non-space; it was
    # cut past MAX_CARRY_CHARS anywhere, a word in two (and 16M characters, 2.7 GB, encoded at once)
    monkeypatch.setattr(encoding_mod, "MAX_CARRY_CHARS", 200)
    line = write(tmp_path / "line.txt", TEXT.replace("\n", "  ") + TEXT.replace("\n", " \n<"))
    ids = np.concatenate(all_tokens(prepare_data(str(line), str(tmp_path / "tokenizer.json"), data_root=tmp_path)))
    assert ids.tolist() == tok.encode(line.read_text()) + [0]
    backend.pre_tokenizer = t.pre_tokenizers.ByteLevel(add_prefix_space=True)  # a space before every piece: whole
    assert not HFTokenizer(backend.to_str()).cuts_as_tiktoken


def test_token_dtype_and_uint32(tmp_path):
    assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(200_019) == np.uint32
    enc = make_encoding("big_bpe", eot=70_000)  # a sparse id space: vocab_size 70001 without 70k ranks
    big = tokenizer_file(tmp_path / "big_bpe.json", enc)
    folder = docs_folder(tmp_path / "corpus")
    p = load_prepared(prepare_data(str(folder), str(big), data_root=tmp_path / "data"))
    assert p.meta["dtype"] == "uint32" and p.train.dtype == np.uint32 and p.meta["vocab_size"] == 70_001
    assert p.train[-1] == 70_000 and p.val[-1] == 70_000
    assert (p.path / "train.bin").stat().st_size == 4 * p.meta["train_tokens"]


def test_document_split_deterministic(tmp_path, monkeypatch):
    folder = tmp_path / "corpus"
    for i in range(20):
        write(folder / f"doc{i:02d}.txt", f"document number {i}\n" * (10 + i))
    a = load_prepared(prepare_data(str(folder), "char", data_root=tmp_path / "d1"))
    monkeypatch.setattr(token_files_mod, "COPY_TOKENS", 7)  # the split moves tokens a few at a time, over themselves
    b = load_prepared(prepare_data(str(folder), "char", data_root=tmp_path / "d2", force=True))
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    val_text = a.tokenizer.decode(a.val.tolist())
    val_docs = [i for i in range(20) if f"document number {i}\n" in val_text]
    assert val_text == "".join(f"document number {i}\n" * (10 + i) for i in val_docs)  # whole documents
    train_docs = sorted(set(range(20)) - set(val_docs))  # the rest, in order
    assert a.tokenizer.decode(a.train.tolist()) == "".join(f"document number {i}\n" * (10 + i) for i in train_docs)
    assert 0.05 < len(a.val) / (len(a.train) + len(a.val)) < 0.2
    # two documents: each side gets one
    two = tmp_path / "two"
    write(two / "x.txt", "x" * 1000)
    write(two / "y.txt", "y" * 10)
    p = load_prepared(prepare_data(str(two), "char", data_root=tmp_path / "d3"))
    assert len(p.val) > 0 and len(p.train) > 0 and p.meta["val_documents"] == 1


def test_a_folder_whose_text_is_one_large_file_says_its_validation_split_is_small(tmp_path, capsys):
    """Whole documents go to one side: a corpus file beside a README left validation the README alone (0.02%),
    whatever val_fraction asked for, without a word."""
    folder = tmp_path / "f"
    write(folder / "corpus.txt", TEXT * 40)
    write(folder / "README.md", "a short readme\n")
    p = load_prepared(prepare_data(str(folder), "char", data_root=tmp_path / "data", val_fraction=0.3))
    assert p.meta["val_documents"] == 1 and len(p.val) == len("a short readme\n")
    assert (
        "note: the validation split is 0.02% of the tokens where val_fraction asks for 30%" in capsys.readouterr().err
    )
    write(folder / "more.txt", TEXT * 40)  # three documents near a third each: no note
    prepare_data(str(folder), "char", data_root=tmp_path / "data", val_fraction=0.3)
    assert "note:" not in capsys.readouterr().err


def test_cache_and_source_change(tmp_path, monkeypatch):
    src = write(tmp_path / "t.txt", TEXT)
    d = prepare_data(str(src), "char", data_root=tmp_path / "data")
    calls = []
    real = prepare_mod.write_tokens
    monkeypatch.setattr(prepare_mod, "write_tokens", lambda *a, **k: calls.append(1) or real(*a, **k))
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


def test_force_replaces_a_valid_preparation(tmp_path):
    """force=True redoes a preparation that is whole (one an older minigpt encoded otherwise): the new one was
    made, then dropped because the old one verified, and the message counted tokens the folder did not hold."""
    from minigpt.data.verify import scan_tokens

    src = write(tmp_path / "t.txt", TEXT)
    d = prepare_data(str(src), "char", data_root=tmp_path / "data")
    right = [ids.copy() for ids in all_tokens(d)]  # (not the memmaps of the file rewritten below)
    meta = json.loads((d / "meta.json").read_text())  # other, consistent tokens: what another encoding wrote
    right[0][::-1].tofile(d / "train.bin")
    meta["train_crc32"] = scan_tokens(d / "train.bin", np.dtype(meta["dtype"]))[0]
    (d / "meta.json").write_text(json.dumps(meta))
    assert prepare_data(str(src), "char", data_root=tmp_path / "data", force=True) == d
    assert np.array_equal(all_tokens(d)[0], right[0])
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [d.name]  # nothing left beside it


def test_a_preparation_of_format_3_is_made_again(tmp_path, monkeypatch):
    """Format 3 cut a word, and added a tokenizer.json's start token, every 1 MiB of a bpe:VOCAB or tokenizer.json
    document: such a preparation (here: other, consistent tokens) is made again by this version, not reused."""
    from minigpt.data.verify import scan_tokens

    src = write(tmp_path / "t.txt", TEXT)
    monkeypatch.setattr(prepare_mod, "FORMAT_VERSION", 3)
    d = prepare_data(str(src), "char", data_root=tmp_path / "data")
    right = [ids.copy() for ids in all_tokens(d)]
    meta = json.loads((d / "meta.json").read_text())
    right[0][::-1].tofile(d / "train.bin")
    meta["train_crc32"] = scan_tokens(d / "train.bin", np.dtype(meta["dtype"]))[0]
    (d / "meta.json").write_text(json.dumps(meta))
    monkeypatch.undo()
    assert prepare_data(str(src), "char", data_root=tmp_path / "data") == d
    assert np.array_equal(all_tokens(d)[0], right[0]) and load_prepared(d).meta["format_version"] > 3


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


def test_a_run_that_finds_its_preparation_installed_by_another_meanwhile_takes_it(tmp_path, monkeypatch):
    """Two runs preparing one source at once: the second to finish found the first's directory where it renamed
    its own (ENOTEMPTY, a traceback).  Here the other run is a real process that finishes first."""
    import errno

    src = write(tmp_path / "t.txt", TEXT)
    root = tmp_path / "data"
    other = (
        f"from minigpt.data.prepare import prepare_data; prepare_data({str(src)!r}, 'char', data_root={str(root)!r})"
    )

    def after_the_other_run(tmp, out):
        subprocess.run([sys.executable, "-c", other], check=True, capture_output=True)
        raise OSError(errno.ENOTEMPTY, "Directory not empty", str(tmp))  # what renaming onto its directory does

    monkeypatch.setattr(prepare_mod, "install_dir", after_the_other_run)
    d = prepare_data(str(src), "char", data_root=root)
    assert load_prepared(d).meta["num_chars"] == len(TEXT)
    assert sorted(p.name for p in root.iterdir()) == [d.name]  # this run's copy is gone, the other's kept


def test_incomplete_dir_is_not_used(tmp_path):
    src = write(tmp_path / "t.txt", TEXT)
    d = prepare_data(str(src), "char", data_root=tmp_path / "data")
    (d / "meta.json").unlink()  # as if written by hand or damaged
    with pytest.raises(DataError, match="no prepared data"):
        load_prepared(d)
    assert prepare_data(str(src), "char", data_root=tmp_path / "data") == d
    assert len(load_prepared(d).train) == int(len(TEXT) * 0.9)


def test_a_prepared_folder_or_its_file_as_the_source_is_refused(tmp_path):
    """Its meta.json and tokenizer.json were read as the text (or train.bin's ids as characters), without a word."""
    src = write(tmp_path / "t.txt", TEXT)
    d = prepare_data(str(src), "char", data_root=tmp_path / "data")
    for source in (d, d / "train.bin", d / "meta.json"):
        with pytest.raises(DataError, match=f"{source} is prepared data .*pass the corpus it was prepared from"):
            prepare_data(str(source), "char", data_root=tmp_path / "other")
    assert not (tmp_path / "other").exists() or not list((tmp_path / "other").iterdir())
    # a text beside another tool's train.bin and meta.json (no val.bin, tokenizer.json) is a corpus
    mine = write(tmp_path / "mine" / "input.txt", TEXT)
    write(mine.parent / "train.bin", b"\0\1"), write(mine.parent / "meta.json", "{}")
    assert load_prepared(prepare_data(str(mine), "char", data_root=tmp_path / "other")).meta["num_chars"] == len(TEXT)


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


def test_a_jsonl_edited_with_its_old_time_is_read_again_and_a_bad_one_names_its_row(tmp_path, hf_cache):
    """`datasets` finds its cached copy of a local file by modification time alone: an edit given the old time back
    (cp -p, rsync -a) was prepared from the old rows, silently."""
    import os

    src = write_jsonl(tmp_path / "c.jsonl", ["the quick brown fox\n"] * 20)
    before = os.stat(src)
    d = prepare_data(str(src), "char", data_root=tmp_path / "data")
    write_jsonl(src, ["the QUICK brown fox\n"] * 20)  # the same size
    os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))
    p = load_prepared(prepare_data(str(src), "char", data_root=tmp_path / "data"))
    assert p.meta["num_documents"] == 20 and "QUICK" in p.tokenizer.decode(p.train.tolist() + p.val.tolist())
    assert load_prepared(d).meta == p.meta
    # what the parser said, not "DatasetGenerationError: An error occurred while generating the dataset"
    write(src, '{"text": "a"}\n{bad\n')
    with pytest.raises(DataError, match=r"could not read .*c\.jsonl as json \(ArrowInvalid: JSON parse error.*row 1"):
        prepare_data(str(src), "char", data_root=tmp_path / "data")
    write(src, "")
    with pytest.raises(DataError, match=r"c\.jsonl as json \(it holds no rows\)"):
        prepare_data(str(src), "char", data_root=tmp_path / "data")
    header = write(tmp_path / "header.csv", "text\n")  # a CSV of its header alone
    with pytest.raises(DataError, match=r"header\.csv as csv \(it holds no rows\)"):
        prepare_data(str(header), "char", data_root=tmp_path / "data")


@pytest.mark.parametrize(
    "row, layout",
    [
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "chat"),
        ({"prompt": "1+1?", "chosen": "2", "rejected": "3"}, "preference"),
        ({"prompt": "1+1?", "answer": "2"}, "prompts"),
    ],
)
def test_another_objectives_rows_read_as_text_name_the_format_flag(tmp_path, hf_cache, row, layout):
    """--data.format left out on the docs' own chat, pair or prompt files said "set text_column" (no such flag)."""
    src = write_jsonl(tmp_path / "rows.jsonl", ["unused"])
    src.write_text(json.dumps(row) + "\n")
    with pytest.raises(
        DataError, match=rf"holds {layout} rows \(.*\), not text; train on them with --data.format {layout}"
    ):
        prepare_data(str(src), "char", data_root=tmp_path / "data")


def test_jsonl_dataset_bpe(tmp_path, monkeypatch, bpe, bpe_file):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    texts = [f"the {i} thing and the other\n" * 3 for i in range(12)]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    p = load_prepared(prepare_data(str(src), bpe_file, data_root=tmp_path / "data"))
    ids = p.train.tolist() + p.val.tolist()
    assert ids.count(bpe.eot_token) == 12 and p.val[-1] == bpe.eot_token
    assert sorted(p.tokenizer.decode(ids).split("<|endoftext|>"))[1:] == sorted(texts)


# -------------------------------------------------------------------------------------------- tokenizer files


def test_bpe_tokenizer_file(tmp_path, bpe, bpe_file, monkeypatch):
    folder = docs_folder(tmp_path / "corpus")
    d = prepare_data(str(folder), bpe_file, data_root=tmp_path / "data")
    assert d.name.startswith("corpus-test_bpe-")
    p = load_prepared(d)
    assert p.tokenizer.name == "test_bpe" and p.tokenizer.to_dict() == json.loads(Path(bpe_file).read_text())
    assert p.meta["tokenizer_key"] == "sha256:" + hashlib.sha256(Path(bpe_file).read_bytes()).hexdigest()
    texts = [(folder / n).read_text() for n in ("a.txt", "c.md", "sub/b.txt")]
    assert sorted(documents(p)) == sorted(bpe.encode_ordinary(t) for t in texts)

    # the cache knows a tokenizer file by its content: a copy elsewhere is the same tokenizer...
    calls = []
    real = prepare_mod.write_tokens
    monkeypatch.setattr(prepare_mod, "write_tokens", lambda *a, **k: calls.append(1) or real(*a, **k))
    copy = write(tmp_path / "elsewhere" / "test_bpe.json", Path(bpe_file).read_bytes())
    assert prepare_data(str(folder), str(copy), data_root=tmp_path / "data") == d and calls == []
    # ...and another content is another tokenizer, even under the same name and path
    fewer = tiktoken.Encoding(
        "test_bpe",
        pat_str=GPT2_PAT,
        special_tokens={"<|endoftext|>": 256},
        mergeable_ranks={bytes([i]): i for i in range(256)},
    )
    tokenizer_file(copy, fewer)
    d2 = prepare_data(str(folder), str(copy), data_root=tmp_path / "data")
    assert d2 != d and calls == [1]
    assert sorted(documents(load_prepared(d2))) == sorted(fewer.encode_ordinary(t) for t in texts)


def test_char_tokenizer_file_is_fixed(tmp_path):
    """Another run's char vocabulary, reused: not rebuilt from the corpus, and text outside it is refused."""
    big = load_prepared(prepare_data(str(write(tmp_path / "big.txt", TEXT)), "char", data_root=tmp_path / "data"))
    vocab = str(big.path / "tokenizer.json")
    small = write(tmp_path / "small.txt", "First Citizen: speak, speak.\n" * 40)
    p = load_prepared(prepare_data(str(small), vocab, data_root=tmp_path / "data"))
    assert p.tokenizer.chars == big.tokenizer.chars  # not the small corpus's characters
    assert p.meta["vocab_size"] == len(set(TEXT)) > len(set(small.read_text()))
    assert p.train.tolist() + p.val.tolist() == big.tokenizer.encode(small.read_text())
    assert p.tokenizer.decode(p.train.tolist() + p.val.tolist()) == small.read_text()

    folder = tmp_path / "other"
    write(folder / "ok.txt", "Speak, speak.\n" * 20)
    write(folder / "zz.txt", "Speak, speak.\n" * 20 + "Zürich\n")
    with pytest.raises(DataError) as e:
        prepare_data(str(folder), vocab, data_root=tmp_path / "data")
    message = str(e.value)
    assert "zz.txt has 2 character(s) not in the char tokenizer's vocabulary: 'Z', 'ü'" in message
    assert "byte tokenizer" in message and "\n" not in message
    assert not list((tmp_path / "data").glob(".*"))  # no temporary directory left behind


# ------------------------------------------------------------------------------- one writer for every source


def test_document_keys(tmp_path, hf_cache):
    folder = docs_folder(tmp_path / "corpus")
    c = resolve_source(str(folder))
    assert [(d.key, d.name) for d in iter_documents(c)] == [
        ("a.txt", str(folder / "a.txt")),
        ("c.md", str(folder / "c.md")),
        ("sub/b.txt", str(folder / "sub/b.txt")),
    ]
    assert c.skipped == 1  # image.png (binary); .hidden is not even listed
    src = write_jsonl(tmp_path / "rows.jsonl", ["one\n", "", "three\n"])
    c = resolve_source(str(src))
    docs = list(iter_documents(c))
    assert [d.key for d in docs] == ["row:0", "row:2"] and c.skipped == 1  # empty rows are no documents
    assert [b"".join(d.chunks) for d in docs] == [b"one\n", b"three\n"]
    assert docs[1].name == f"{src} row 2"


def test_files_and_rows_go_through_one_writer(tmp_path, hf_cache, bpe, bpe_file, monkeypatch):
    texts = [f"the {i} thing and the other, ünïcødé\n" * (3 + i % 4) for i in range(10)]
    calls = []
    real = prepare_mod.write_tokens
    monkeypatch.setattr(prepare_mod, "write_tokens", lambda *a, **k: calls.append(a[2].kind) or real(*a, **k))
    root = tmp_path / "data"

    # the same documents as files named like rows (sorted by name = row order) and as rows: the same keys, so
    # byte-for-byte the same preparation
    as_rows = tmp_path / "rows"
    for i, t in enumerate(texts):
        write(as_rows / f"row:{i}", t)
    jsonl = write_jsonl(tmp_path / "rows.jsonl", texts)
    for tokenizer in ("char", "byte", bpe_file):
        a = load_prepared(prepare_data(str(as_rows), tokenizer, data_root=root))
        b = load_prepared(prepare_data(str(jsonl), tokenizer, data_root=root))
        assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
        assert a.tokenizer.to_dict() == b.tokenizer.to_dict()
        for key in ("content_sha256", "num_documents", "num_bytes", "num_chars", "split", "val_documents"):
            assert a.meta[key] == b.meta[key], key
    assert calls == ["folder", "dataset"] * 3

    # under other names (other keys, so maybe another split) each document still has the same tokens
    named = tmp_path / "named"
    for i, t in enumerate(texts):
        write(named / f"doc-{i:02d}.txt", t)
    a = load_prepared(prepare_data(str(named), bpe_file, data_root=root))
    b = load_prepared(prepare_data(str(jsonl), bpe_file, data_root=root))
    assert sorted(documents(a)) == sorted(documents(b)) == sorted(bpe.encode_ordinary(t) for t in texts)
    assert len(a.train) + len(a.val) == len(b.train) + len(b.val)
    assert a.meta["content_sha256"] == b.meta["content_sha256"]


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
    # a data_root that cannot be written is one line, as for a local source (the download's mkdir: a traceback)
    with pytest.raises(DataError, match=r"cannot write the download in .*input.txt is a file, not a folder"):
        prepare_data(url, "char", data_root=downloads[0] / "data")


def test_url_404(tmp_path, server):
    with pytest.raises(DataError, match="HTTP 404.*download the file yourself"):
        prepare_data(f"{server.url}/missing.txt", "char", data_root=tmp_path / "data")
    assert list((tmp_path / "data" / "downloads").iterdir()) == []


def test_url_size_limit(tmp_path, server):
    with pytest.raises(DataError, match="limit"):
        sources_mod.download(f"{server.url}/input.txt", tmp_path / "dl", max_bytes=100)
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
    with pytest.raises(DataError, match="not UTF-8.*byte tokenizer"):
        prepare_data(str(latin1), "char", data_root=root)
    with pytest.raises(DataError, match="unknown tokenizer 'nope'.*char, byte.*gpt2.*cl100k_base"):
        prepare_data(str(latin1), "nope", data_root=root)
    with pytest.raises(DataError, match="too small"):
        prepare_data(str(write(tmp_path / "one.txt", "x")), "char", data_root=root)
    with pytest.raises(DataError, match="no prepared data"):
        load_prepared(tmp_path / "nothing")
    assert not list(root.glob(".*"))  # no temporary directories left behind


def test_error_types(tmp_path, hf_cache, monkeypatch):
    """User mistakes are UserErrors (not ValueErrors); a bug inside keeps its own type and traceback."""
    assert issubclass(DataError, UserError) and not issubclass(DataError, ValueError)
    assert issubclass(UnknownCharactersError, UserError)
    with pytest.raises(CheckpointError, match="unknown tokenizer type"):
        tokenizer_from_dict({"type": "nope"})
    with pytest.raises(CheckpointError, match="damaged tiktoken tokenizer dict"):
        tokenizer_from_dict({"type": "tiktoken", "name": "x"})
    with pytest.raises(CheckpointError, match="damaged tiktoken tokenizer dict"):
        tokenizer_from_dict(
            {"type": "tiktoken", "name": "x", "pat_str": "a", "mergeable_ranks": {"!!": 0}, "special_tokens": {}}
        )

    src = write(tmp_path / "t.txt", TEXT)
    d = prepare_data(str(src), "char", data_root=tmp_path / "data")
    write(d / "tokenizer.json", '{"type": "char", "chars": 7}')
    with pytest.raises(DataError, match="damaged or from another version.*damaged char tokenizer dict"):
        load_prepared(d)

    def bug(self, text):
        raise TypeError("a programming error")

    with monkeypatch.context() as m:
        m.setattr(CharTokenizer, "encode_array", bug)
        with pytest.raises(TypeError, match="a programming error"):
            prepare_data(str(src), "char", data_root=tmp_path / "data", force=True)

    import datasets

    jsonl = write_jsonl(tmp_path / "rows.jsonl", ["some text\n"] * 10)
    with monkeypatch.context() as m:
        m.setattr(datasets, "load_dataset", lambda *a, **k: bug(None, None))
        with pytest.raises(TypeError, match="a programming error"):
            prepare_data(str(jsonl), "char", data_root=tmp_path / "data")
    broken = write(tmp_path / "broken.jsonl", '{"text": "fine"}\n{not json\n')
    with pytest.raises(DataError, match="could not read .*broken.jsonl as json"):
        prepare_data(str(broken), "char", data_root=tmp_path / "data")
    assert not list((tmp_path / "data").glob(".*"))


def test_stdlib_source(tmp_path):
    c = resolve_source("stdlib")
    assert prepare_mod.DEFAULT_SOURCE == sources_mod.DEFAULT_SOURCE == "stdlib" and c.kind == "stdlib"
    assert len(c.files) > 300
    assert all(f.relpath.endswith(".py") for f in c.files)
    assert not any(
        part in ("test", "tests", "idle_test", "site-packages", "__pycache__")
        for f in c.files
        for part in f.relpath.split("/")[:-1]
    )
    assert [f.relpath for f in c.files] == sorted(f.relpath for f in c.files)
    assert 3e6 < sum(f.size for f in c.files) < 40e6
    p = load_prepared(prepare_data("stdlib", "byte", data_root=tmp_path / "data"))
    assert p.meta["num_documents"] > 300 and p.meta["train_tokens"] > 8 * p.meta["val_tokens"] / 2
    assert len(p.train) + len(p.val) == p.meta["num_bytes"]


def test_the_prepared_line_counts_documents_in_words(tmp_path, capsys):
    """ "from 1 documents" for a single file."""
    write(tmp_path / "one.txt", TEXT)
    prepare_data(str(tmp_path / "one.txt"), "char", data_root=tmp_path / "data")
    assert " from 1 document (" in capsys.readouterr().out
    write(tmp_path / "two" / "a.txt", TEXT)
    write(tmp_path / "two" / "b.txt", TEXT)
    prepare_data(str(tmp_path / "two"), "char", data_root=tmp_path / "data")
    assert " from 2 documents (" in capsys.readouterr().out
