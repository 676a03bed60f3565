"""Reading what a user hands us, bounded (minigpt.core.user_files; issue 40): JSON by depth (one helper for every
reader), JSON Lines split on newlines only, files refused by kind and size before they are read.  Each hostile input
is built here, on the fly."""

from __future__ import annotations

import io
import json
import os
import random

import pytest

from minigpt.core.user_files import (
    MAX_JSON_DEPTH,
    TEMPLATE_BYTES,
    json_depth,
    json_lines,
    loads,
    nesting,
    read_user_text,
)

DEEP = 100_000
pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------ JSON depth


@pytest.mark.parametrize(
    "text",
    [
        "[" * DEEP + "]" * DEEP,
        '{"a":' * DEEP + "1" + "}" * DEEP,
        "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1),
    ],
)
def test_json_nested_past_the_bound_is_a_value_error_not_a_recursion_error(text):
    with pytest.raises(ValueError, match=f"nested more than {MAX_JSON_DEPTH} levels deep"):
        loads(text)
    assert json_depth(io.BytesIO(text.encode())) > MAX_JSON_DEPTH  # the streaming check agrees


def test_json_within_the_bound_and_plain_values_parse():
    assert loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None
    assert loads("null") is None and loads("3") == 3 and loads(b'{"a": [1]}') == {"a": [1]}


def test_the_streaming_depth_scan_reads_strings_and_escapes_as_json_does():
    """Brackets inside strings, escaped quotes and backslash runs cut across chunk boundaries: the scan gives the
    parsed value's depth for every chunk size."""
    rng = random.Random(0)
    pieces = ["\\", '"', "[", "{", "]", "}", 'x\\\\"', "\\\\\\\\"]
    for _ in range(200):
        value = {
            "a": ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 6))) for _ in range(4)],
            "b": [[[{"c": "\\\\"}]]],
        }
        for _ in range(rng.randint(0, 5)):
            value = [value, "\\"]
        text = json.dumps(value).encode()
        for chunk in (1, 2, 3, 7, 1 << 20):
            assert json_depth(io.BytesIO(text), chunk=chunk) == nesting(value), (text, chunk)


def test_json_lines_split_on_newlines_only():
    """U+2028, U+2029, NEL and U+001E may stand in a JSON string as they are; str.splitlines() broke there."""
    rows = [{"text": f"a{sep}b"} for sep in ("\u2028", "\u2029", "\u0085", "\x1e", "\x1c", "\x0b")]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows) + "\n \t\n"
    assert [loads(line) for _, line in json_lines(text)] == rows
    assert [n for n, _ in json_lines(text)] == [1, 2, 3, 4, 5, 6]


# ------------------------------------------------------------------------------------------------ file kinds


def test_a_device_a_fifo_a_folder_or_a_huge_file_is_refused_without_reading_it(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would block until a writer comes
    big = tmp_path / "big.jinja"
    big.write_bytes(b"x" * (TEMPLATE_BYTES + 1))
    for path, why in [
        ("/dev/zero", "a character device"),
        (fifo, "a FIFO"),
        (tmp_path, "a directory"),
        (big, f"larger than {TEMPLATE_BYTES:,} bytes"),
    ]:
        with pytest.raises(ValueError, match=why):
            read_user_text(path, TEMPLATE_BYTES)
