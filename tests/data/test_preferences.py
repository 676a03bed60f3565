"""Preference pairs (--data.format preference) are checked where they are read: each problem one DataError naming
the row and the fix."""

from __future__ import annotations

import json

import pytest

from minigpt.core.chat_template import DEFAULT_CHAT_TEMPLATE
from minigpt.core.errors import DataError
from minigpt.data.preferences import read_preferences, to_preference
from minigpt.training.dpo import load_preference_data

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


def turn(role, content):
    return {"role": role, "content": content}


def test_an_implicit_prompt_is_the_turns_both_conversations_start_with():
    """TRL's implicit-prompt layout (HH-RLHF as messages) was refused for having no "prompt"; the shared turns
    are the prompt, as TRL's extract_prompt splits it (a multi-turn history included)."""
    history = [turn("system", "Add."), turn("user", "1+1="), turn("assistant", "2"), turn("user", "2+2=")]
    row = {"chosen": history + [turn("assistant", "4")], "rejected": history + [turn("assistant", "5")]}
    pair = to_preference(row, "row 1")
    assert pair.prompt == history
    assert pair.chosen == [turn("assistant", "4")] and pair.rejected == [turn("assistant", "5")]
    explicit = {"prompt": history, "chosen": [turn("assistant", "4")], "rejected": [turn("assistant", "5")]}
    assert to_preference(explicit, "row 1") == pair  # the same pair as with its prompt given
    trl = pytest.importorskip("trl.data_utils")
    assert trl.extract_prompt(row) == explicit  # TRL's own split


@pytest.mark.parametrize(
    "row, words",
    [
        ({"prompt": "x", "chosen": "a"}, ["row 3", "no 'rejected'", '"prompt", "chosen" and "rejected"']),
        ({"chosen": "a", "rejected": "b"}, ["no 'prompt'", "without a prompt, the whole conversations as lists"]),
        (
            {"chosen": [turn("user", "x"), turn("assistant", "a")], "rejected": [turn("user", "y")]},
            ['no "prompt", and its chosen and rejected conversations do not start with the same turns'],
        ),
        (
            {
                "chosen": [turn("user", "x"), turn("assistant", "a")],
                "rejected": [turn("user", "x"), turn("assistant", "a")],
            },
            ["conversations are the same conversation", 'give the prompt\'s turns as "prompt"'],
        ),
        (  # the conversations part at a user turn: the prompt would end with the assistant's
            {
                "chosen": [turn("user", "x"), turn("assistant", "a"), turn("user", "y")],
                "rejected": [turn("user", "x"), turn("assistant", "a"), turn("user", "z")],
            },
            ["ends with an assistant turn"],
        ),
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
        (  # a system turn alone was accepted: no question to answer
            {"prompt": [{"role": "system", "content": "x"}], "chosen": "a", "rejected": "b"},
            ["ends with a system turn", "end it with the user's turn"],
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


def write_pairs(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_answers_that_differ_only_past_the_cut_are_refused_as_equal_ones(tmp_path):
    """Rows are cut to block_size + 1 tokens: answers equal up to there give the pair nothing to prefer (its loss
    stays log 2), so it is refused, as a pair equal before tokenizing is, naming the row and the fix."""
    same_start = "A" * 100
    rows = [
        {"prompt": "p", "chosen": "4", "rejected": "5"},
        {"prompt": "q", "chosen": same_start + "x", "rejected": same_start + "y"},
    ]
    with pytest.raises(DataError) as e:
        load_preference_data(write_pairs(tmp_path / "cut.jsonl", rows), "byte", None, 0.5, 64, 0)
    assert "\n" not in str(e.value)
    for w in ["cut.jsonl line 2:", "differ only after the first block_size + 1 = 65 tokens", "larger block_size"]:
        assert w in str(e.value)
    # the same answers kept whole with a larger block_size, and a cut pair that still differs, are kept
    data = load_preference_data(str(tmp_path / "cut.jsonl"), "byte", None, 0.5, 256, 0)
    assert data.counts == {"pairs": 2, "train": 1, "val": 1, "truncated": 0}
    rows[1] = {"prompt": "q", "chosen": "x" + same_start, "rejected": "y" + same_start}
    data = load_preference_data(write_pairs(tmp_path / "differ.jsonl", rows), "byte", None, 0.5, 64, 0)
    assert data.counts["truncated"] == 1
    assert all(len(r) == 65 and not (c == r).all() for c, r in data.train + data.val if len(c) > 64)


def test_answers_the_chat_template_renders_alike_are_refused(tmp_path):
    """Different text that becomes the same tokens (here a template that trims the answers) prefers nothing too."""
    template = DEFAULT_CHAT_TEMPLATE.replace(
        "message['content'] + '<|im_end|>' }}{% endgeneration",
        "message['content'] | trim + '<|im_end|>' }}{% endgeneration",
    )
    assert template != DEFAULT_CHAT_TEMPLATE
    (tmp_path / "trim.jinja").write_text(template)
    rows = [{"prompt": "p", "chosen": "4", "rejected": "5"}, {"prompt": "q", "chosen": "4", "rejected": " 4 "}]
    with pytest.raises(DataError) as e:
        load_preference_data(
            write_pairs(tmp_path / "trim.jsonl", rows), "byte", str(tmp_path / "trim.jinja"), 0.5, 64, 0
        )
    assert "trim.jsonl line 2: chosen and rejected are the same tokens" in str(e.value)
