"""Conversation data for chat fine-tuning (train.py --data.format chat): rows of messages, checked one by one.

A row is {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]} (the format of Hugging
Face chat datasets and OpenAI's), or an Alpaca row {"instruction", "input", "output"}, which becomes a user turn
(the instruction, then the input after a blank line when there is one) and the assistant's answer.

Sources: a local *.jsonl (one row per line) or *.json (an array of rows, or one row per line) file read with the
json module, so that a bad row is named by its line; a *.parquet file or a `datasets` hub name ("name" or
"name:config", split "train") read with `datasets`.  Every problem is one DataError naming the source and the row.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from minigpt.core.chat_template import ROLES
from minigpt.core.errors import DataError, first_line
from minigpt.core.user_files import DOCUMENT_BYTES, json_lines, loads, read_user_text
from minigpt.data.sources import DEFAULT_SOURCE, check_hub_reachable, hub_retries_quiet
from minigpt.data.tables import dataset_failure, load_local_dataset

__all__ = ["read_conversations", "source_rows", "to_messages"]

Messages = list[dict[str, str]]
FIX = (
    'each row needs "messages": [{"role": "user", "content": "..."}, {"role": "assistant", '
    '"content": "..."}] or Alpaca\'s "instruction"/"input"/"output"'
)


def to_messages(row: Any, where: str) -> Messages:
    """One row as a checked list of messages; `where` names the row in the error ("data.jsonl line 3")."""
    for problem in _row_problems(row):
        raise DataError(f"{where}: {problem}")
    return [{"role": m["role"], "content": m["content"]} for m in _given_messages(row)]


def _row_problems(row: Any) -> Iterator[str]:
    """What is wrong with a row, first problem first, each with its fix."""
    if not isinstance(row, dict):
        yield f"a row must be a JSON object, got {type(row).__name__}; {FIX}"
        return
    if "messages" not in row and not ("instruction" in row and "output" in row):
        yield (
            f'no "messages" (and no Alpaca "instruction"/"output") in the row, only '
            f"{', '.join(map(repr, list(row)[:6])) or 'nothing'}; {FIX}"
        )
        return
    messages = _given_messages(row)
    if not isinstance(messages, list):
        yield f'"messages" is {type(messages).__name__}, not a list of messages; {FIX}'
        return
    if not messages:
        yield f'the conversation is empty ("messages" must be a non-empty list); {FIX}'
        return
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            yield f'message {i} has no "role" or no "content"; give every message both'
        elif message["role"] not in ROLES:
            yield f"message {i} has the unknown role {message['role']!r}; use one of {', '.join(ROLES)}"
        elif not isinstance(message["content"], str):
            yield f"message {i}'s content is {type(message['content']).__name__}, not text; give a string"
    replies = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
    if not replies:
        yield (
            "the conversation has no assistant turn, so there is nothing to learn from it; add the assistant's "
            "reply or drop the row"
        )
    elif all(reply == "" for reply in replies):  # it would teach only the end-of-turn marker
        yield (
            "every assistant turn is empty, so there is nothing to learn from it; give the replies' text or drop "
            "the row"
        )


def _given_messages(row: dict[str, Any]) -> Any:
    """The row's "messages" as given, or an Alpaca row as a user turn and the assistant's answer."""
    if "messages" in row:
        return row["messages"]
    prompt = "\n\n".join(str(row[k]) for k in ("instruction", "input") if row.get(k))
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]


def _json_rows(path: Path) -> Iterator[tuple[Any, str]]:
    """The rows of a .json/.jsonl file; a problem reading or parsing it is one line naming where it is."""
    where, problem, fix = str(path), "cannot read it", "give a UTF-8 JSON Lines file"
    try:
        text = read_user_text(path, DOCUMENT_BYTES)  # ValueError: not UTF-8, too large, a device
        problem = "not JSON"  # (or nested past MAX_JSON_DEPTH)
        if path.suffix.lower() == ".json" and text.lstrip().startswith("["):  # one array of rows
            fix = "fix the file, or write one row per line (JSON Lines)"
            yield from ((row, f"{path} row {i}") for i, row in enumerate(loads(text), 1))
            return
        fix = "write one JSON object per line"
        for n, line in json_lines(text):
            where = f"{path} line {n}"
            yield loads(line), where
    except (OSError, ValueError) as e:  # (an OSError's strerror: its first line repeats the path)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e)
        raise DataError(f"{where}: {problem} ({reason}); {fix}") from None


def _dataset_rows(source: str, what: str) -> Iterator[tuple[Any, str]]:
    import datasets  # slow to import; only parquet files and hub names need it

    local = Path(source).expanduser()
    if local.suffix.lower() != ".parquet":
        check_hub_reachable(source)  # (before the try below, which would wrap its DataError)
    try:
        if local.suffix.lower() == ".parquet":
            ds = load_local_dataset("parquet", str(local))
        else:
            name, _, config = source.partition(":")
            with hub_retries_quiet():
                ds = datasets.load_dataset(name, config or None, split="train")
    except Exception as e:  # datasets raises many types (hub, network, parsing): each is one line here
        raise DataError(
            f"cannot read the {what} {source} ({dataset_failure(e)}); give a "
            ".jsonl, .json or .parquet file, or a datasets name"
        ) from None
    for i, row in enumerate(ds, 1):
        yield row, f"{source} row {i}"


def source_rows(source: str, what: str = "chat data (--data.format chat)", layout: str = '{"messages": [...]}'):
    """(row, where) for each row of `source`: a .jsonl/.json file, a .parquet file or a datasets name."""
    if str(source) == DEFAULT_SOURCE:  # not a datasets name to look up on the hub (a minute offline)
        raise DataError(
            f"{what} needs --data.source: a .jsonl, .json or .parquet file or a datasets name, one {layout} "
            f"per row; the default source {DEFAULT_SOURCE} is the built-in plain-text corpus"
        )
    path = Path(str(source)).expanduser()
    if path.suffix.lower() in (".jsonl", ".json"):
        return _json_rows(path)  # (a missing file: its reader's "cannot read it")
    if path.suffix.lower() != ".parquet" and path.exists():
        raise DataError(
            f"{source}: {what} is read from .jsonl, .json or .parquet files or "
            f"a datasets name; convert it to JSON Lines with one {layout} per line"
        )
    return _dataset_rows(str(source), what)


def read_conversations(source: str) -> list[Messages]:
    """Every conversation of `source`, checked (see the module docstring)."""
    # (none at all is refused where the conversations are split: too few for training and validation)
    return [to_messages(row, where) for row, where in source_rows(source)]
