"""What users have on disk, read as the text it holds or refused in one line (minigpt.data.sources, prepare):
a `datasets` save_to_disk folder is its rows (its .json metadata was trained on), a .tar.gz or .zst file is
refused (read as tar headers or compressed bytes, exit 0), a folder that holds data_root leaves its preparations
out (they were read as text, a new preparation at each run), BPE says when bytes that are not UTF-8 became
U+FFFD (a Latin-1 file lost its accents without a word), and an empty folder says what it skipped."""

from __future__ import annotations

import gzip
import io
import json
import tarfile

import numpy as np
import pytest

from minigpt.core.errors import DataError
from minigpt.data.prepare import load_prepared, prepare_data

ROWS = [f"row {i}: the quick brown fox jumps over the lazy dog\n" for i in range(12)]


def texts(out) -> list[str]:
    data = load_prepared(out)
    return [data.tokenizer.decode(np.asarray(part).tolist()) for part in (data.train, data.val)]


def test_a_save_to_disk_folder_is_read_as_its_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    saved, root = tmp_path / "saved", tmp_path / "data"
    datasets.Dataset.from_dict({"text": ROWS, "n": list(range(12))}).save_to_disk(str(saved))
    # as a folder of text files it was prepared before: that preparation (its .json files) is not taken
    out = prepare_data(str(saved), "char", data_root=root)
    train, val = texts(out)
    assert sorted((train + val).splitlines(keepends=True)) == sorted(ROWS)
    assert load_prepared(out).meta["kind"] == "dataset" and load_prepared(out).meta["num_documents"] == 12
    meta = json.loads((out / "meta.json").read_text())
    meta["kind"] = "folder"  # what the same folder's preparation as text files recorded
    (out / "meta.json").write_text(json.dumps(meta))
    assert prepare_data(str(saved), "char", data_root=root) == out
    assert json.loads((out / "meta.json").read_text())["kind"] == "dataset"

    splits = tmp_path / "splits"  # a DatasetDict: its "train" split, as a hub dataset's
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": ROWS[:6]}), "test": datasets.Dataset.from_dict({"text": ["x"]})}
    ).save_to_disk(str(splits))
    train, val = texts(prepare_data(str(splits), "char", data_root=root))
    assert sorted((train + val).splitlines(keepends=True)) == sorted(ROWS[:6])
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ROWS})}).save_to_disk(str(tmp_path / "t"))
    with pytest.raises(DataError, match=r"save_to_disk folder \(ValueError: its splits are test, none is 'train'"):
        prepare_data(str(tmp_path / "t"), "char", data_root=root)


def test_archives_and_unread_compressions_are_refused_alone_and_skipped_in_a_folder(tmp_path):
    folder, root = tmp_path / "corpus", tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("".join(ROWS))
    with tarfile.open(folder / "more.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("b.txt")
        info.size = len(ROWS[0])
        tar.addfile(info, io.BytesIO(ROWS[0].encode()))
    (folder / "c.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"compressed text")  # no NUL byte: not "binary"
    for name, needle in [
        ("more.tar.gz", "more.tar.gz is an archive (.tar.gz); unpack it and pass the folder"),
        ("c.zst", "c.zst is .zst compressed, which is not read (.gz, .bz2 and .xz are); decompress it first"),
    ]:
        with pytest.raises(DataError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            prepare_data(str(folder / name), "byte", data_root=root)
    (folder / "d.txt.gz").write_bytes(gzip.compress(ROWS[1].encode()))  # compressed text is read
    meta = load_prepared(prepare_data(str(folder), "byte", data_root=root)).meta
    assert meta["num_documents"] == 2
    assert meta["skipped_files"] == {"archive": ["more.tar.gz"], "compressed": ["c.zst"]}


def test_a_folder_that_holds_data_root_leaves_its_preparations_out(tmp_path, monkeypatch):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("".join(ROWS[:6]))
    (tmp_path / "texts" / "b.txt").write_text("".join(ROWS[6:]))
    monkeypatch.chdir(tmp_path)
    first = prepare_data(".", "char", data_root="texts/cache")
    (tmp_path / "texts" / "cache" / "downloads").mkdir()
    (tmp_path / "texts" / "cache" / "downloads" / "x.txt").write_text("a download")
    second = prepare_data(".", "char", data_root="texts/cache")
    assert second == first and load_prepared(second).meta["num_documents"] == 2
    assert sorted("".join(texts(second)).splitlines(keepends=True)) == sorted(ROWS)


def test_bpe_says_when_bytes_that_are_not_utf8_became_replacement_characters(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    path = tmp_path / "latin1.txt"
    path.write_bytes("".join(ROWS).replace("quick", "caf\u00e9").encode("latin-1"))
    out = prepare_data(str(path), "bpe:300", data_root=tmp_path / "data")
    assert load_prepared(out).meta["invalid_utf8_bytes"] == 12
    err = capsys.readouterr().err
    assert f"note: 12 byte(s) that are not UTF-8 were read as U+FFFD (first in {path})" in err
    assert "convert it to UTF-8 (iconv -f cp1252 -t utf-8)" in err
    (tmp_path / "utf8.txt").write_text("".join(ROWS))
    out = prepare_data(str(tmp_path / "utf8.txt"), "bpe:300", data_root=tmp_path / "data")
    assert load_prepared(out).meta["invalid_utf8_bytes"] == 0 and "U+FFFD" not in capsys.readouterr().err


def test_an_empty_folder_says_what_it_skipped(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "e.txt").write_text("")
    (folder / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    (folder / ".notes.txt").write_text("hidden")
    for tokenizer in ("char", "bpe:300"):
        with pytest.raises(DataError) as e:
            prepare_data(str(folder), tokenizer, data_root=tmp_path / "data")
        assert str(e.value) == (
            f"corpus is empty: {folder} holds no text (skipped: 1 empty (e.txt), 1 binary (img.png)); hidden files "
            "and folders are not read; pass a source with text in it"
        )
