"""Hardening II, the data side: one test per class of hostile input (issue 14).

URL downloads that are cut short or are HTML pages, an empty source, prepared caches that were damaged,
compressed and UTF-16/32 files in folders, numeric settings out of range, more devices than validation
batches, a full or read-only disk while preparing, and checkpoint tokenizers that were edited.
"""

from __future__ import annotations

import bz2
import errno
import gzip
import http.client
import http.server
import json
import os
import threading
import types

import numpy as np
import pytest
import torch

import minigpt.data.download as download_mod
import minigpt.data.prepare as prepare_mod
import minigpt.data.verify as verify_mod
from minigpt import GPT, GPTConfig, load_model
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.errors import CheckpointError, ConfigError, DataError, UserError
from minigpt.core.tokenizers import CharTokenizer, TiktokenTokenizer, tokenizer_from_dict
from minigpt.data.prepare import load_prepared, prepare_data
from minigpt.training.datamodule import TokenDataModule
from minigpt.training.optim import OptimConfig

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(300))


def files_in(folder) -> list[str]:
    """Every entry, hidden ones (temporary files) included."""
    return sorted(os.listdir(folder)) if folder.exists() else []


# ----------------------------------------------------------------------------------------------- 1. URL sources


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[str, bytes, int | None]] = {}  # path -> (content type, body, Content-Length sent)

    def do_GET(self):
        content_type, body, length = self.routes[self.path]
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)  # then the connection closes (HTTP/1.0): a short body just ends

    def log_message(self, *a):
        pass


@pytest.fixture
def web():
    _Handler.routes = {
        "/ok.txt": ("text/plain", TEXT.encode(), None),
        "/cut.txt": ("text/plain", TEXT.encode()[:1000], len(TEXT)),  # the connection dropped mid-way
        "/login": ("text/html; charset=utf-8", b"<html><body>Please sign in</body></html>", None),
        "/sneaky.txt": ("text/plain", b"\n  <!DOCTYPE html>\n<html><body>Access denied</body></html>", None),
    }
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_url_downloads_must_be_complete_and_not_html(tmp_path, web):
    root = tmp_path / "data"
    for path, needle in [
        ("/cut.txt", f"incomplete: 1,000 of its {len(TEXT):,} bytes"),
        ("/login", "HTML page (Content-Type text/html)"),
        ("/sneaky.txt", "HTML page (its content starts like HTML)"),
    ]:
        with pytest.raises(DataError, match=r"download it yourself") as e:
            prepare_data(web + path, "char", data_root=root)
        assert needle in str(e.value)
        assert files_in(root / "downloads") == []  # nothing cached, not even a temporary file
    d = prepare_data(web + "/ok.txt", "char", data_root=root)  # a whole text file is fine
    assert load_prepared(d).meta["num_chars"] == len(TEXT)


# ------------------------------------------------------------------------------------------- 2. an empty source


def test_empty_source_is_refused_not_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text(TEXT)  # what an empty source would silently have trained on
    for source in ["", "  "]:
        with pytest.raises(DataError, match="the data source is empty.*unset"):
            prepare_data(source, "char", data_root=tmp_path / "data")
    with pytest.raises(DataError, match="data_root is empty"):
        prepare_data(str(tmp_path / "notes.txt"), "char", data_root="")
    assert files_in(tmp_path) == ["notes.txt"]


# ------------------------------------------------------------------------------------- 3. prepared caches checked


def test_damaged_caches_are_prepared_again_and_refused_when_loaded(tmp_path, capsys):
    src = tmp_path / "t.txt"
    src.write_text(TEXT)
    root = tmp_path / "data"
    d = prepare_data(str(src), "char", data_root=root)
    good = {name: (d / name).read_bytes() for name in ("train.bin", "val.bin", "tokenizer.json")}
    vocab = load_prepared(d).meta["vocab_size"]
    verify_mod._VERIFIED.clear()  # (a check that passed is remembered by file stats, which coarse clocks may keep)

    def damages():
        yield (
            "zeroed train.bin",
            "train.bin's checksum",
            lambda: (d / "train.bin").write_bytes(bytes(len(good["train.bin"]))),
        )
        yield (
            "id out of range",
            f"val.bin holds token id 65535, outside the vocabulary of {vocab}",
            lambda: (d / "val.bin").write_bytes(b"\xff\xff" + good["val.bin"][2:]),
        )
        yield "truncated", "train.bin holds", lambda: (d / "train.bin").write_bytes(good["train.bin"][:-2])
        reordered = dict(reversed(list(json.loads(good["tokenizer.json"]).items())))
        yield (
            "reordered tokenizer.json",
            "tokenizer.json differs",
            lambda: (d / "tokenizer.json").write_text(json.dumps(reordered)),
        )

    for what, reason, damage in damages():
        damage()
        with pytest.raises(DataError, match="damaged") as e:
            load_prepared(d)  # loaded directly: refused
        assert reason in str(e.value), what
        capsys.readouterr()
        assert prepare_data(str(src), "char", data_root=root) == d  # through the cache: prepared again
        assert f"is damaged ({reason}" in capsys.readouterr().out, what
        assert {name: (d / name).read_bytes() for name in good} == good, what

    # the source edited at the same size, its mtime put back: its content hash tells
    st = src.stat()
    src.write_text(TEXT.replace("fox", "cat"))
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert prepare_data(str(src), "char", data_root=root) == d
    assert "prepared" in capsys.readouterr().out
    assert "cat" in load_prepared(d).tokenizer.decode(np.asarray(load_prepared(d).train[:200]).tolist())
    # only its modification time changed (a touch, a checkout): the content hash says it is the same
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert prepare_data(str(src), "char", data_root=root) == d
    assert "prepared earlier from the same source" in capsys.readouterr().out


# -------------------------------------------------------------------------------------------- 4. folder corpora


def test_folders_read_compressed_and_utf16_text_and_say_what_they_skip(tmp_path, capsys):
    texts = {
        "plain.txt": "plain words here\n" * 40,
        "packed.txt.gz": "gzipped words, ünïcødé\n" * 40,
        "more.txt.bz2": "bzipped words\n" * 40,
        "wide.txt": "utf-16 wörds\n" * 40,
        "wider.txt": "utf-32 wörds\n" * 40,
    }
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "plain.txt").write_text(texts["plain.txt"])
    (folder / "packed.txt.gz").write_bytes(gzip.compress(texts["packed.txt.gz"].encode()))
    (folder / "more.txt.bz2").write_bytes(bz2.compress(texts["more.txt.bz2"].encode()))
    (folder / "wide.txt").write_bytes(texts["wide.txt"].encode("utf-16"))  # (with a BOM)
    (folder / "wider.txt").write_bytes(b"\0\0\xfe\xff" + texts["wider.txt"].encode("utf-32-be"))
    (folder / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0binary")
    (folder / "empty.txt").write_text("")
    (folder / "old.zip").write_bytes(b"PK\x03\x04 not read")
    p = load_prepared(prepare_data(str(folder), "char", data_root=tmp_path / "data"))
    assert p.meta["num_documents"] == 5 and p.meta["skipped"] == 3
    assert set(p.tokenizer.chars) == set("".join(texts.values()))  # no compressed bytes, no NULs, no BOM
    text = p.tokenizer.decode(np.concatenate([p.train, p.val]).tolist())
    assert all(t in text for t in texts.values())
    out = capsys.readouterr().out
    assert (
        "data: skipped 3 file(s) that hold no text: 1 empty (empty.txt), 1 binary (image.png), 1 archive "
        "(old.zip)" in out
    )

    # a .gz file on its own, with the byte tokenizer: the text's bytes, not the compressed ones
    single = folder / "packed.txt.gz"
    p = load_prepared(prepare_data(str(single), "byte", data_root=tmp_path / "data"))
    assert bytes(np.concatenate([p.train, p.val]).tolist()) == texts["packed.txt.gz"].encode()
    # damaged containers and encodings: one line naming the file
    (tmp_path / "cut.txt.gz").write_bytes(single.read_bytes()[:-8])
    with pytest.raises(DataError, match=r"cut.txt.gz is not a valid .gz file .*repair or remove it"):
        prepare_data(str(tmp_path / "cut.txt.gz"), "byte", data_root=tmp_path / "data")
    (tmp_path / "odd.txt").write_bytes(b"\xff\xfeh\0i\0\0\xd8")  # a lone surrogate
    with pytest.raises(DataError, match="UTF-16-LE byte-order mark but is not valid"):
        prepare_data(str(tmp_path / "odd.txt"), "char", data_root=tmp_path / "data")
    with pytest.raises(DataError, match="old.zip is an archive.*unpack it"):
        prepare_data(str(folder / "old.zip"), "byte", data_root=tmp_path / "data")


# --------------------------------------------------------------------------------- 5. numeric settings in range


def test_every_numeric_setting_is_range_checked_where_declared(tmp_path, capsys):
    for field, value in [
        ("batch_size", 0),
        ("val_batches", 0),
        ("val_batch_size", 0),
        ("val_fraction", 1.0),
        ("val_fraction", float("nan")),
        ("num_workers", -1),
        ("block_size", 0),
        ("seed", -1),
        ("seed", 2**32),
    ]:
        with pytest.raises(ConfigError, match=rf"^data\.{field}: must .*, got .*; use e\.g\. "):
            TokenDataModule(**{field: value})
    for field, value in [
        ("learning_rate", 0.0),
        ("learning_rate", float("inf")),
        ("min_lr_ratio", -0.5),
        ("min_lr_ratio", 1.5),
        ("weight_decay", -1.0),
        ("beta1", 1.0),
        ("beta2", -0.1),
        ("warmup_steps", -1),
        ("decay_steps", 0),
        ("min_lr_ratio", float("nan")),
    ]:
        with pytest.raises(ConfigError, match=rf"^optim\.{field}: .*; "):
            OptimConfig(**{field: value})
    from minigpt.cli import eval as eval_cli
    from minigpt.cli import sample as sample_cli

    for main, argv, needle in [
        (sample_cli.main, ["--seed", "-1"], "--seed must be in [0, 4294967295], got -1"),
        (sample_cli.main, ["--num_samples", "0"], "--num_samples must be >= 1"),
        (eval_cli.main, ["--text", "x", "--batch_size", "0"], "--batch_size must be >= 1"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and f"error: {needle}" in capsys.readouterr().err


# ------------------------------------------------------------------------- 6. devices > validation batches


def test_more_devices_than_validation_batches_is_one_error(tmp_path):
    (tmp_path / "t.txt").write_text(TEXT)
    dm = TokenDataModule(str(tmp_path / "t.txt"), data_root=str(tmp_path / "data"), block_size=16, val_batches=2)
    dm.trainer = types.SimpleNamespace(global_rank=0, world_size=4)  # as under DDP on 4 devices
    with pytest.raises(ConfigError, match="data.val_batches: 2 validation batch.* by 4 devices.*at least 4"):
        dm.setup("fit")
    dm.trainer = types.SimpleNamespace(global_rank=1, world_size=2)
    dm.setup("fit")  # two batches, two devices: one each
    assert len(dm.val_dataloader()) == 1


# ------------------------------------------------------------------------------- 7. disk full, read-only folder


def test_a_full_or_read_only_disk_is_one_line_and_leaves_no_partial_cache(tmp_path, monkeypatch):
    src = tmp_path / "t.txt"
    src.write_text(TEXT)
    root = tmp_path / "data"
    d = prepare_data(str(src), "char", data_root=root)
    before = files_in(root)
    src.write_text(TEXT + "a new line\n")  # the source changed: a new preparation starts, and fails
    for code, strerror in [
        (errno.ENOSPC, "No space left on device"),
        (errno.EROFS, "Read-only file system"),
        (errno.EDQUOT, "Disk quota exceeded"),
    ]:

        def full(*a, code=code, **k):  # this iteration's code (bound now, not when called)
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(prepare_mod, "write_json", full)
        with pytest.raises(
            DataError,
            match=rf"^cannot write prepared data in {root} \({strerror}\); free space "
            r"there, or set data_root",
        ):
            prepare_data(str(src), "char", data_root=root)
        assert files_in(root) == before  # no temporary directory left
        assert load_prepared(d).meta["num_chars"] == len(TEXT)  # and the old preparation untouched
    monkeypatch.undo()
    assert load_prepared(prepare_data(str(src), "char", data_root=root)).meta["num_chars"] == len(TEXT) + 11

    def full_download(path, write):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(download_mod, "atomic_write", full_download)
    monkeypatch.setattr(download_mod.urllib.request, "urlopen", lambda *a, **k: _FakeResponse())
    with pytest.raises(DataError, match=r"cannot write the download in .*downloads \(No space left on device\)"):
        prepare_data("http://127.0.0.1:9/t.txt", "char", data_root=root)


class _FakeResponse:
    headers = http.client.HTTPMessage()
    headers["Content-Length"] = "3"  # (a body of unproven length is refused before anything is written)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ---------------------------------------------------------------------------- 8. tampered checkpoint tokenizers


def test_tampered_tokenizers_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"listed twice: 'a'"):
        tokenizer_from_dict({"type": "char", "chars": "aabc"})
    with pytest.raises(CheckpointError, match="a lone surrogate"):
        tokenizer_from_dict({"type": "char", "chars": "ab\ud800"})
    ranks = {bytes([i]): i for i in range(256)}
    d = TiktokenTokenizer(
        __import__("tiktoken").Encoding(
            "t", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 256}
        )
    ).to_dict()
    tokenizer_from_dict(d)  # as written: fine
    for tamper in [
        lambda d: d["mergeable_ranks"].update({"YQ==": 5}),  # b"a" given the rank of b"\x05"
        lambda d: d["special_tokens"].update({"<|endoftext|>": 7}),
    ]:
        bad = json.loads(json.dumps(d))
        tamper(bad)
        with pytest.raises(CheckpointError, match="two tokens share an id"):
            tokenizer_from_dict(bad)

    # a char model whose tokenizer lost characters (ids past them would decode as other characters)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=5))
    save_file(model_checkpoint(model, CharTokenizer("abcde")), tmp_path / "ok.ckpt")
    load_model(tmp_path / "ok.ckpt")
    save_file(model_checkpoint(model, CharTokenizer("abc")), tmp_path / "short.ckpt")
    with pytest.raises(CheckpointError, match="char tokenizer has 3 characters but the model 5 tokens"):
        load_model(tmp_path / "short.ckpt")
    ckpt = model_checkpoint(model, CharTokenizer("abcde"))
    ckpt["minigpt"]["tokenizer"]["chars"] = "abcdd"
    save_file(ckpt, tmp_path / "dup.ckpt")
    with pytest.raises(UserError, match="listed twice: 'd'"):
        load_model(tmp_path / "dup.ckpt")
