"""A request's generated tokens as text that is safe to send while it grows, and its stop sequences.

OpenAI's `stop`: generation ends where the text first contains one of the stop sequences, and the text returned
ends just before it.  While streaming, the text that could still turn out to be the start of a stop sequence is
held back (as is a token that ends inside a UTF-8 character); what has been sent is never taken back.
"""

from __future__ import annotations

from collections.abc import Sequence

from minigpt.core.tokenizer_base import IncrementalDecoder, Tokenizer

__all__ = ["TextStream"]


class TextStream:
    """push(token) -> (new text, whether a stop sequence ended it); finish() -> the text held back until the end."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), context: Sequence[int] = ()) -> None:
        """context: the prompt's ids where the text continues it (a completion), as IncrementalDecoder reads them;
        none for a text of its own (a chat reply)."""
        self.decoder = IncrementalDecoder(tokenizer, context)
        self.stop = [s for s in stop if s]
        self.text = ""  # the text so far, less a character still incomplete
        self.sent = 0  # characters of the text already given out
        self.stopped = False

    def push(self, token: int) -> tuple[str, bool]:
        self.text += self.decoder.push(token)
        text = self.text
        if (end := self._stop_at(text)) is not None:
            self.stopped = True
            return self._take(text, end), True
        return self._take(text, len(text) - self._held(text)), False

    def finish(self) -> str:
        """The rest of the text once generation ended without a stop sequence (held-back text included), cut
        before a stop sequence that only the end shows: one inside the last token's incomplete character's text,
        such as a byte-level token ' \xe6' whose space the decoder held back with its lead byte."""
        if self.stopped:
            return ""
        text = self.text + self.decoder.finish()
        end = self._stop_at(text)
        self.stopped = end is not None
        return self._take(text, end)

    def _stop_at(self, text: str) -> int | None:
        """Where the first stop sequence in `text` starts, or None.  A match cannot start in the text already sent:
        what could begin a stop sequence is held back."""
        return min((i for s in self.stop if (i := text.find(s, self.sent)) >= 0), default=None)

    def _held(self, text: str) -> int:
        """Length of the longest end of `text` (past what was sent) that a stop sequence starts with."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text) - self.sent), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _take(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        new = text[self.sent : end]
        self.sent = max(self.sent, end)
        return new
