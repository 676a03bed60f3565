"""Local corpus sources never hang (minigpt.data.sources; issue 30): FIFOs, sockets and devices are refused before
they are opened, as the source or inside a folder; symlinks to regular files are read."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from minigpt.core.errors import DataError
from minigpt.data.prepare import load_prepared, prepare_data
from support import deadline

REPO = Path(__file__).resolve().parents[2]
TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(300))


def test_fifos_sockets_and_devices_are_refused_without_opening_them(tmp_path):
    root = tmp_path / "data"
    fifo = tmp_path / "stream.txt"
    os.mkfifo(fifo)  # opening it for reading would block until a writer comes
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXT)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(folder / "s.txt"))
    try:
        for source, needle in [
            (
                fifo,
                f"{fifo} is a FIFO (named pipe), not a regular file: it could block or never end; pass a regular "
                "text file",
            ),
            ("/dev/zero", "/dev/zero is a character device, not a regular file"),  # would never end
            (folder, f"{folder / 's.txt'} is a socket, not a regular file"),
        ]:
            with deadline(30), pytest.raises(DataError) as e:
                prepare_data(str(source), "char", data_root=root)
            assert needle in str(e.value), source
            assert not root.exists()
    finally:
        sock.close()
    (folder / "s.txt").unlink()
    (folder / "linked.txt").symlink_to(fifo)  # a symlink is judged by what it points to
    with deadline(30), pytest.raises(DataError, match=r"linked.txt is a FIFO"):
        prepare_data(str(folder), "char", data_root=root)

    # a symlink to a regular file is a regular file, as the source and inside a folder
    (folder / "linked.txt").unlink()
    (tmp_path / "outside.txt").write_text(TEXT.upper())
    (folder / "linked.txt").symlink_to(tmp_path / "outside.txt")
    (tmp_path / "link.txt").symlink_to(folder / "a.txt")
    with deadline(60):
        assert load_prepared(prepare_data(str(folder), "char", data_root=root)).meta["num_chars"] == 2 * len(TEXT)
        assert load_prepared(prepare_data(str(tmp_path / "link.txt"), "char", data_root=root)).meta["num_chars"] == len(
            TEXT
        )


def test_train_on_a_fifo_is_one_error_line_not_a_hang(tmp_path):
    os.mkfifo(tmp_path / "stream.txt")
    result = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--data.source",
            str(tmp_path / "stream.txt"),
            "--data.data_root",
            str(tmp_path / "data"),
            "--out_dir",
            str(tmp_path / "run"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'stream.txt'} is a FIFO (named pipe), not a regular file: it could block or never "
        "end; pass a regular text file (save the data into one first)"
    )
    assert sorted(os.listdir(tmp_path)) == ["stream.txt"]


def test_a_symlinked_folder_is_read_once_and_a_link_back_up_does_not_loop(tmp_path):
    """A symlinked subfolder was left out without a word (symlinked files were read)."""
    from minigpt.data.sources import resolve_source

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "more.txt").write_text(TEXT)
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text(TEXT)
    (corpus / "linked").symlink_to(elsewhere, target_is_directory=True)
    (corpus / "sub" / "up").symlink_to(corpus, target_is_directory=True)  # a cycle
    with deadline(30):
        files = resolve_source(str(corpus), tmp_path / "data").files
    assert [f.relpath for f in files] == ["a.txt", "linked/more.txt"]
