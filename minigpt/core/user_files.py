"""Reading what a user hands us, bounded where it is read: a file's size (and never a device or FIFO, which can
block or never end), a JSON document's depth, JSON Lines split where JSON splits them.

    text = read_user_text(path, TEMPLATE_BYTES)           # ValueError: too large, a device, not UTF-8
    value = loads(text)                                   # ValueError: not JSON, or nested over MAX_JSON_DEPTH
    for n, line in json_lines(text): ...                  # lines split on "\\n" only (U+2028 is text in JSON)
    check_json_file(path)                                 # before another library's parser reads the file

Every problem is a ValueError (OSError for a file that cannot be opened), the types the readers already turn
into their one line (JSONDecodeError and UnicodeDecodeError are ValueErrors too), so each reader keeps its own
words and none needs a check of its own.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

__all__ = [
    "MAX_JSON_DEPTH",
    "TEMPLATE_BYTES",
    "DOCUMENT_BYTES",
    "loads",
    "json_lines",
    "check_json_file",
    "read_user_bytes",
    "read_user_text",
]

# Real documents are shallow (a byte-level BPE's tokenizer.json: 5 levels, a chat row 3, a config.json 2).
# Python's parser stops near 1,000 (RecursionError) and ujson, which `datasets` uses, not at all (a segfault):
# refused well before both.
MAX_JSON_DEPTH = 100
TEMPLATE_BYTES = 1 << 20  # a chat template or a task YAML file (each a few KB)
DOCUMENT_BYTES = 1 << 30  # a JSON document read whole (tokenizer.json, config.json, a chat .json/.jsonl)
TOO_DEEP = f"nested more than {MAX_JSON_DEPTH} levels deep, which no real document is"
_SPECIAL = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
}


def read_user_bytes(path: str | Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (never more is read: a file that grows without end
    costs limit + 1 bytes)."""
    kind = stat.S_IFMT(os.stat(path).st_mode)
    problem = None if kind == stat.S_IFREG else f"it is {_SPECIAL.get(kind, 'a special file')}, not a regular file"
    if problem is None:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
        problem = f"it is larger than {limit:,} bytes, more than such a file holds" if len(data) > limit else None
    if problem:
        raise ValueError(problem)
    return data


def read_user_text(path: str | Path, limit: int) -> str:
    """read_user_bytes decoded as UTF-8 (a UTF-8 byte-order mark dropped)."""
    return read_user_bytes(path, limit).decode("utf-8-sig")


def loads(text: str | bytes) -> Any:
    """json.loads, refusing a document nested more than MAX_JSON_DEPTH levels (found on the parsed value, or by
    the parser itself: its RecursionError becomes the same ValueError)."""
    try:
        value = json.loads(text)
        too_deep = nesting(value) > MAX_JSON_DEPTH
    except RecursionError:
        too_deep = True
    if too_deep:
        raise ValueError(TOO_DEEP)
    return value


def nesting(value: Any) -> int:
    """How many levels of arrays and objects a parsed JSON value has (counted up to MAX_JSON_DEPTH + 1)."""
    depth, stack = 0, [(value, 1)]
    while stack and depth <= MAX_JSON_DEPTH:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            depth = max(depth, level)
            stack += [
                (c, level + 1)
                for c in (node.values() if isinstance(node, dict) else node)
                if isinstance(c, (dict, list))
            ]
    return depth


def json_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of each non-blank line.  Split on "\\n" only: str.splitlines() also splits at U+2028,
    U+2029, U+0085 and U+001E, which a JSON string may hold as they are."""
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip(" \t\r"):  # JSON's own whitespace
            yield n, line


def json_depth(stream: IO[bytes], chunk: int = 1 << 22) -> int:
    """How deep the JSON text of `stream` nests (JSON Lines too), read a chunk at a time and given up once past
    MAX_JSON_DEPTH: brackets count outside strings only, a quote after an odd run of backslashes is escaped."""
    depth = deepest = in_string = 0
    escape_next = False  # the previous chunk ended in an odd run of backslashes
    while deepest <= MAX_JSON_DEPTH and (block := stream.read(chunk)):
        b = np.frombuffer(block, np.uint8)
        at = np.flatnonzero((b == 34) | (b == 91) | (b == 93) | (b == 123) | (b == 125) | (b == 92))  # "[]{}\
        marks = b[at]
        if escape_next or (marks == 92).any():
            slashes = at[marks == 92]
            if escape_next:  # the run goes on from the previous chunk
                slashes = np.concatenate(([-1], slashes))
            starts = np.flatnonzero(np.concatenate(([True], np.diff(slashes) != 1)))  # each run of backslashes
            lengths = np.diff(np.append(starts, len(slashes)))
            escaped = (slashes[starts + lengths - 1] + 1)[lengths % 2 == 1]  # the byte after an odd run
            escape_next = bool(len(escaped)) and escaped[-1] == len(b)
            marks = marks[(marks != 92) & ~np.isin(at, escaped)]
        quote = marks == 34
        outside = (np.cumsum(quote) + in_string) % 2 == 0
        running = depth + np.cumsum(np.where(outside & ~quote, np.where((marks == 91) | (marks == 123), 1, -1), 0))
        if len(running):
            deepest = max(deepest, int(running.max()))
            depth, in_string = int(running[-1]), int((quote.sum() + in_string) % 2)
    return deepest


def check_json_file(path: str | Path) -> None:
    """Refuse a JSON (or JSON Lines) file nested past MAX_JSON_DEPTH before another library parses it; one pass,
    about 100 to 800 MB/s."""
    with open(path, "rb") as f:
        if json_depth(f) > MAX_JSON_DEPTH:
            raise ValueError(TOO_DEEP)


def code_module(path: Path, prefix: str) -> Any:
    """A user's Python file as a module of its own, run once per process (it is the user's code: task hooks,
    GRPO rewards)."""
    name = prefix + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]
