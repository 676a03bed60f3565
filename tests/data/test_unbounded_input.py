"""Hardening IV, the data side (issue 40): chat rows with the line separators JSON allows, JSON nested past the
bound in every place minigpt or `datasets` would parse it, a BPE trained on one endless "word", and chat templates
in files that never end.  The hostile files are written here, on the fly."""

from __future__ import annotations

import json

import pytest

from minigpt.core.errors import CheckpointError, DataError
from minigpt.core.tokenizers import get_tokenizer
from minigpt.data.bpe import TRAINING_RUN, plan_split, short_runs, train_bpe
from minigpt.data.conversations import read_conversations
from minigpt.data.sources import resolve_source
from minigpt.hf.chat_files import read_chat_template

DEEP = 100_000
SEPARATORS = ("\u2028", "\u2029", "\u0085", "\x1e", "\x1d", "\x1c", "\x0b", "\x0c")


def test_chat_rows_holding_line_separators_are_read_whole(tmp_path):
    """str.splitlines() cut these rows in two ("not JSON"); JSON Lines are split at "\\n" only."""
    rows = [
        {"messages": [{"role": "user", "content": f"one{sep}two"}, {"role": "assistant", "content": sep}]}
        for sep in SEPARATORS
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8")
    assert read_conversations(str(path)) == [r["messages"] for r in rows]


@pytest.mark.parametrize(
    "name, text, where",
    [
        ("deep.jsonl", '{"messages": ' + "[" * DEEP + "]" * DEEP + "}\n", "deep.jsonl line 1: not JSON"),
        ("deep.json", "[" + '{"a":' * DEEP + "1" + "}" * DEEP + "]", "deep.json: not JSON"),
    ],
    ids=["jsonl", "json"],
)
def test_chat_data_nested_past_the_bound_is_one_line(tmp_path, name, text, where):
    (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match=f"{where} .nested more than 100 levels deep") as e:
        read_conversations(str(tmp_path / name))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["deep.json", "deep.jsonl"])
def test_a_json_corpus_nested_past_the_bound_never_reaches_the_datasets_parser(tmp_path, name):
    """`datasets` parses JSON with ujson, which has no depth bound: a tokenizer.json gone 100,000 deep given as
    the corpus crashed the interpreter (a segfault, no message at all)."""
    (tmp_path / name).write_text("\n".join(['{"text": "fine"}', '{"a":' * DEEP + "1" + "}" * DEEP]))
    corpus = resolve_source(str(tmp_path / name), data_root=tmp_path / "data")
    with pytest.raises(DataError, match="could not read .* nested more than 100 levels deep"):
        corpus.load_dataset()


def test_a_tokenizer_file_nested_past_the_bound_is_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model":' * DEEP + "1" + "}" * DEEP)
    with pytest.raises(DataError, match="tokenizer file .* is not JSON .nested more than 100 levels deep"):
        get_tokenizer(tmp_path / "tokenizer.json")


def test_a_bpe_on_one_endless_word_is_trained_in_pieces(tmp_path):
    """A 1 MB run of one character is one "word" to GPT-2's pre-tokenizer, and the trainer's time grows with the
    square of a word's length (it did not finish in 5 minutes); cut into TRAINING_RUN pieces it trains at once, and
    the vocabulary it cannot fill is the usual one line."""
    (tmp_path / "run.txt").write_text("a" * 1_000_000)
    corpus = resolve_source(str(tmp_path / "run.txt"))
    with pytest.raises(DataError, match=r"bpe:4096: the training text \(950,000 characters\) fills only"):
        train_bpe(corpus, plan_split(corpus, 0.05), "bpe:4096", quiet=True)


def test_long_runs_are_cut_and_nothing_else_changes():
    text = "def f(x):\n    return x  # " + "=" * 70 + "\n" + "b" * (2 * TRAINING_RUN + 7) + " " * 300 + "end"
    pieces = list(short_runs(text))
    assert "".join(pieces) == text and max(map(len, pieces)) == TRAINING_RUN
    assert pieces[0] == "def f(x):\n    return x  # " + "=" * 70 + "\n"  # ordinary text is one piece
    assert list(short_runs("plain text\n")) == ["plain text\n"]


def test_a_model_folder_whose_chat_template_is_a_device_is_one_line(tmp_path):
    (tmp_path / "chat_template.jinja").symlink_to("/dev/zero")  # read whole, it would never end
    with pytest.raises(CheckpointError, match="chat_template.jinja .it is a character device, not a regular file"):
        read_chat_template(tmp_path)
