"""Preference pairs (--data.format preference) are checked where they are read: each problem one DataError naming
the row and the fix."""

from __future__ import annotations

import json

import pytest

from minigpt.core.errors import DataError
from minigpt.data.preferences import read_preferences, to_preference

GOOD = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}


def test_the_standard_layout_becomes_a_user_turn_and_assistant_answers():
    pair = to_preference(GOOD, "row 1")
    assert pair.prompt == [{"role": "user", "content": "2+2="}]
    assert pair.chosen == [{"role": "assistant", "content": "4"}]
    assert pair.rejected == [{"role": "assistant", "content": "5"}]


def test_the_conversational_layout_keeps_its_messages(tmp_path):
    row = {
        "prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+2="}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
        "score": 1,  # other columns are ignored
    }
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(GOOD) + "\n")
    pairs = read_preferences(str(tmp_path / "p.jsonl"))
    assert pairs[0].prompt == row["prompt"] and pairs[0].where.endswith("p.jsonl line 1")
    assert pairs[1].where.endswith("p.jsonl line 2")


@pytest.mark.parametrize(
    "row, words",
    [
        ({"prompt": "x", "chosen": "a"}, ["row 3", "no 'rejected'", '"prompt", "chosen" and "rejected"']),
        ({"chosen": "a", "rejected": "b"}, ["no 'prompt'"]),
        ({"prompt": "x", "chosen": "a", "rejected": "a"}, ["chosen and rejected are the same answer", "drop the row"]),
        ({"prompt": "x", "chosen": [], "rejected": "b"}, ['"chosen" must be text or a non-empty list']),
        (
            {"prompt": "x", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
            ['"chosen" message 0 needs a "role" (assistant)'],
        ),
        (
            {"prompt": [{"role": "assistant", "content": "x"}], "chosen": "a", "rejected": "b"},
            ["ends with an assistant turn", "end it with the user's turn"],
        ),
        ([1, 2], ["a row must be a JSON object, got list"]),
    ],
)
def test_a_bad_row_is_one_line_naming_it_and_the_fix(row, words):
    with pytest.raises(DataError) as e:
        to_preference(row, "pairs.jsonl row 3")
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)
