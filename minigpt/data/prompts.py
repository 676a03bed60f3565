"""Prompt data for GRPO (train.py --data.format prompts): rows of a prompt and the answer a reward checks.

    {"prompt": "What is 47 + 89?", "answer": "136"}
    {"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 47 + 89?"}],
     "answer": "136"}

A prompt is text (one user turn) or a list of messages ending with a user turn (TRL's conversational prompt),
rendered with the model's chat template and its generation prompt; the answer is text (a number is read as its
text).  Sources are read as chat data is (minigpt.data.conversations).  Every problem is one DataError naming the
source and the row, and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minigpt.core.chat_template import ROLES
from minigpt.core.errors import DataError
from minigpt.data.conversations import Messages, source_rows

__all__ = ["PromptRow", "read_prompts", "to_prompt_row"]

FIX = 'each row needs "prompt" (text, or a list of messages ending with the user\'s turn) and "answer" (text)'
LAYOUT = '{"prompt": ..., "answer": ...}'


@dataclass
class PromptRow:
    """One prompt: its messages, the prompt as the row gave it (what a reward function is shown), its answer."""

    messages: Messages
    prompt: str | Messages
    answer: str
    where: str = ""  # the row, as errors name it ("prompts.jsonl line 3")


def to_prompt_row(row: Any, where: str) -> PromptRow:
    """One row as a checked PromptRow; `where` names the row in the error."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}; {FIX}")
    missing = [k for k in ("prompt", "answer") if k not in row]
    if missing:
        raise DataError(f"{where}: the row has no {' and no '.join(map(repr, missing))}; {FIX}")
    prompt, answer = row["prompt"], row["answer"]
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise DataError(f'{where}: "answer" must be text, got {answer!r:.60}; {FIX}')
    if not answer.strip():  # a blank cell: exact_match would reward an empty reply
        raise DataError(f'{where}: "answer" is empty; give the answer the reward checks, or drop the row')
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt:
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
                raise DataError(
                    f'{where}: "prompt" message {i} needs a "role" ({", ".join(ROLES)}) and text "content", got '
                    f"{m!r:.60}; fix the message"
                )
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        if (last := messages[-1]["role"]) != "user":  # a system turn alone is no question either
            raise DataError(
                f"{where}: the prompt ends with {'an' if last == 'assistant' else 'a'} {last} turn; end it with the "
                "user's turn"
            )
    else:
        raise DataError(f'{where}: "prompt" must be text or a non-empty list of messages, got {prompt!r:.60}; {FIX}')
    return PromptRow(messages, prompt, answer, where)


def read_prompts(source: str) -> list[PromptRow]:
    """Every prompt of `source`, checked (see the module docstring)."""
    rows = source_rows(source, "prompt data (--data.format prompts)", LAYOUT)
    return [to_prompt_row(row, where) for row, where in rows]
