"""Preference data for DPO (train.py --data.format preference): rows of a prompt, a chosen and a rejected answer.

TRL's two preference layouts (its docs, "Dataset formats"), each row checked where it is read:

    standard:        {"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"}
    conversational:  {"prompt": [{"role": "user", "content": "What is 2+2?"}],
                      "chosen": [{"role": "assistant", "content": "4"}],
                      "rejected": [{"role": "assistant", "content": "5"}]}
    implicit prompt: {"chosen": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
                      "rejected": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "5"}]}

An implicit prompt (Anthropic's HH-RLHF as messages) is the turns both conversations start with, as TRL's
`extract_prompt` takes it.

Both become chat messages (a standard prompt is one user turn, an answer one assistant turn) rendered with the
model's chat template, as SFT's conversations are.  Sources are read as chat data is (minigpt.data.conversations).
Every problem is one DataError naming the source and the row, and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minigpt.core.chat_template import ROLES
from minigpt.core.errors import DataError
from minigpt.data.conversations import Messages, source_rows

__all__ = ["Preference", "read_preferences", "to_preference"]

FIX = (
    'each row needs "prompt", "chosen" and "rejected": text (standard), or a list of messages for the prompt and '
    "a list holding the assistant's turn for each answer (conversational)"
)
LAYOUT = '{"prompt": ..., "chosen": ..., "rejected": ...}'


@dataclass
class Preference:
    """One pair: the prompt's messages, and the chosen and rejected answers (assistant messages)."""

    prompt: Messages
    chosen: Messages
    rejected: Messages
    where: str = ""  # the row, as errors name it ("pairs.jsonl line 3")


def _messages(value: Any, key: str, where: str, roles: tuple[str, ...]) -> Messages:
    """A field as checked messages: text is one turn (user for the prompt, assistant for an answer)."""
    if isinstance(value, str):
        return [{"role": roles[-1] if key != "prompt" else "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise DataError(f'{where}: "{key}" must be text or a non-empty list of messages, got {value!r:.60}; {FIX}')
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in roles:
            raise DataError(
                f'{where}: "{key}" message {i} needs a "role" ({", ".join(roles)}) and text "content", got '
                f"{m!r:.60}; fix the message"
            )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def with_implicit_prompt(row: dict, where: str) -> dict:
    """A row without "prompt" whose answers are whole conversations: the messages both start with are the prompt."""
    chosen, rejected = row["chosen"], row["rejected"]
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if chosen == rejected or shared == 0:
        same = "are the same conversation" if shared else "do not start with the same turns"
        raise DataError(
            f'{where}: the row has no "prompt", and its chosen and rejected conversations {same}, so no prompt '
            'and answers can be told apart; give the prompt\'s turns as "prompt" or fix the row'
        )
    return row | {"prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}


def to_preference(row: Any, where: str) -> Preference:
    """One row as a checked Preference; `where` names the row in the error ("pairs.jsonl line 3")."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}; {FIX}")
    if "prompt" not in row and isinstance(row.get("chosen"), list) and isinstance(row.get("rejected"), list):
        row = with_implicit_prompt(row, where)
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
    if missing:
        implicit = (
            " (or, without a prompt, the whole conversations as lists of messages)" if missing == ["prompt"] else ""
        )
        raise DataError(f"{where}: the row has no {' and no '.join(map(repr, missing))}; {FIX}{implicit}")
    prompt = _messages(row["prompt"], "prompt", where, ROLES)
    if (last := prompt[-1]["role"]) != "user":  # a system turn alone is no question either
        raise DataError(
            f"{where}: the prompt ends with {'an' if last == 'assistant' else 'a'} {last} turn; end it with the "
            "user's turn"
        )
    chosen = _messages(row["chosen"], "chosen", where, ("assistant",))
    rejected = _messages(row["rejected"], "rejected", where, ("assistant",))
    if chosen == rejected:
        raise DataError(
            f"{where}: chosen and rejected are the same answer, so the pair prefers nothing; give a worse answer "
            "as rejected or drop the row"
        )
    return Preference(prompt, chosen, rejected, where)


def read_preferences(source: str) -> list[Preference]:
    """Every pair of `source`, checked (see the module docstring)."""
    rows = source_rows(source, "preference data (--data.format preference)", LAYOUT)
    return [to_preference(row, where) for row, where in rows]
