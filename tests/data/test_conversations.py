"""The conversation rows (minigpt.data.conversations): jsonl, json, parquet and Alpaca rows, and every bad row is
one line."""

from __future__ import annotations

import json

import pytest

from minigpt.core.errors import DataError
from minigpt.data.conversations import read_conversations
from support import CONVERSATION


def test_rows_from_jsonl_json_and_parquet_and_alpaca_rows(tmp_path):
    alpaca = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
    (tmp_path / "a.jsonl").write_text(json.dumps({"messages": CONVERSATION}) + "\n\n" + json.dumps(alpaca) + "\n")
    (tmp_path / "a.json").write_text(json.dumps([{"messages": CONVERSATION}, alpaca]))
    import datasets

    datasets.Dataset.from_list([{"messages": CONVERSATION}]).to_parquet(str(tmp_path / "a.parquet"))
    expected_alpaca = [
        {"role": "user", "content": "Add the numbers.\n\n2 and 3"},
        {"role": "assistant", "content": "5"},
    ]
    assert read_conversations(str(tmp_path / "a.jsonl")) == [CONVERSATION, expected_alpaca]
    assert read_conversations(str(tmp_path / "a.json")) == [CONVERSATION, expected_alpaca]
    assert read_conversations(str(tmp_path / "a.parquet")) == [CONVERSATION]


@pytest.mark.parametrize(
    "row, message",
    [
        ("{not json", r"line 2: not JSON"),
        ('{"messages": [{"role": "user"}]}', r"line 2: message 0 has no \"role\" or no \"content\""),
        ('{"messages": [{"role": "robot", "content": "hi"}]}', r"line 2: message 0 has the unknown role 'robot'"),
        ('{"messages": []}', r"line 2: the conversation is empty"),
        ('{"messages": "hello"}', r"line 2: \"messages\" is str, not a list of messages"),
        (
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}',
            r"line 2: every assistant turn is empty, so there is nothing to learn from it",
        ),
        ('{"messages": [{"role": "user", "content": "hi"}]}', r"line 2: the conversation has no assistant turn"),
        ('{"text": "hi"}', r"line 2: no \"messages\""),
        ("[1, 2]", r"line 2: a row must be a JSON object"),
        ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}', r"content is int"),
    ],
)
def test_a_bad_row_is_one_line_naming_the_file_and_line(tmp_path, row, message):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + row + "\n")
    with pytest.raises(DataError, match=message) as e:
        read_conversations(str(path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)
