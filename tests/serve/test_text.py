"""minigpt.serve.text: a growing reply as text that is safe to send (stop sequences held back, no split character)."""

from __future__ import annotations

import tiktoken
from serve_support import CHARS

from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer, TiktokenTokenizer
from minigpt.serve.text import TextStream


def test_text_stream_holds_back_what_may_start_a_stop_sequence():
    tok = CharTokenizer(CHARS)
    stream = TextStream(tok, stop=["lo w", "xyz"])
    pieces = []
    for i in tok.encode("hello world"):
        text, stopped = stream.push(i)
        pieces.append(text)
        if stopped:
            break
    # "l" might start "lo w": held until the next character shows it does not, then sent; "lo w" ends the text
    assert pieces == ["h", "e", "", "l", "", "", ""] and stopped
    assert stream.finish() == ""
    unfinished = TextStream(tok, stop=["lo w"])
    assert "".join(unfinished.push(i)[0] for i in tok.encode("hello")) == "hel"
    assert unfinished.finish() == "lo"  # generation ended without the stop sequence: the held text is the reply's


def test_text_stream_never_splits_a_character():
    tok = ByteTokenizer()
    stream = TextStream(tok)
    pieces = [stream.push(b) for b in "né!".encode()]
    assert [p for p, _ in pieces] == ["n", "", "é", "!"]
    assert stream.finish() == ""


def test_a_stop_sequence_that_only_the_end_shows_still_cuts_the_text():
    """A byte-level token ' \xe6' ends inside a character, so its space waits with the lead byte; when generation
    then ends (max_tokens), the rest is still searched for the stop sequences: ' ' was sent before."""
    ranks = {bytes([i]): i for i in range(256)} | {b" \xe6": 256}  # one token: a space and a character's lead byte
    tok = TiktokenTokenizer(
        tiktoken.Encoding("space-lead", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})
    )
    stream = TextStream(tok, stop=[" "])
    assert stream.push(ord("o")) == ("o", False)
    assert stream.push(256) == ("", False)  # " " and half a character: held back
    assert stream.finish() == "" and stream.stopped  # the text ends before the stop sequence
