"""Preparation shows its progress: a log line every few seconds when stderr is not a terminal (a bar when it is)."""

from __future__ import annotations

import io
import re

from minigpt.data import progress as progress_module
from minigpt.data.prepare import prepare_data
from minigpt.data.progress import Progress


def test_lines_give_bytes_of_the_total_tokens_and_rates():
    stream = io.StringIO()
    p = Progress(4_000_000, "corpus (gpt2)", stream=stream, every_s=0)
    p.update(1_000_000, 250_000)
    p.update(3_000_000, 700_000)
    p.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert re.fullmatch(
        r"data: corpus \(gpt2\): 3\.0 MB of 4\.0 MB \(75%, ETA \d+s\) read, 700,000 tokens, "
        r"[\d.]+ MB/s, [\d.]+ M tokens/s",
        lines[1],
    ), lines[1]


def test_no_line_before_the_interval():
    stream = io.StringIO()
    p = Progress(None, "rows", stream=stream, every_s=3600)
    p.update(10, 5)
    assert stream.getvalue() == ""


def test_preparation_logs_while_it_reads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(progress_module, "LOG_EVERY_S", 0)
    (tmp_path / "a.txt").write_text("to be or not to be\n" * 2000)
    prepare_data(str(tmp_path / "a.txt"), "char", data_root=tmp_path / "data")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("data: a (char): ")]
    assert lines and "of 0.0 MB (100%" in lines[-1] and "38,000 tokens" in lines[-1]


def test_a_compressed_source_gives_no_share_of_its_file_size(tmp_path, monkeypatch, capsys):
    """The bytes read are the decompressed text's: against the .gz's size the lines read 136%, ETA -4s."""
    import gzip

    monkeypatch.setattr(progress_module, "LOG_EVERY_S", 0)
    with gzip.open(tmp_path / "a.txt.gz", "wt") as f:
        f.write("to be or not to be\n" * 2000)
    prepare_data(str(tmp_path / "a.txt.gz"), "char", data_root=tmp_path / "data")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("data: a")]
    assert lines and all(" of " not in line and "%" not in line for line in lines), lines
    assert "0.0 MB read, 38,000 tokens" in lines[-1]
