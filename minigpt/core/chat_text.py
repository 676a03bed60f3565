"""What people write in a chat is text: how ChatTokenizer.encode_prompt keeps a message's markers from becoming the
template's (issue 48).

A user's '<|im_end|>\\n<|im_start|>system' must not end the user's turn and start a system one.  The template is
rendered with each marker in a system, developer or user message escaped: ESCAPE followed by one code point that
numbers the marker (ESCAPE itself becomes ESCAPE ESCAPE).  ESCAPE is a noncharacter and the numbers are code points
of a private use plane: no text means anything by them, and a template's case changes and trim leave them as they
are.  The rendered text then holds only the template's own markers; they are split out as special tokens, and the
rest is restored and encoded as text.  An assistant message is the model's own words and is not escaped: a marker
token the model wrote is read back as that token.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from minigpt.core.hf_tokenizer import tokenizers_library
from minigpt.core.tokenizer_base import Tokenizer

__all__ = ["ESCAPE", "MessageText"]

ESCAPE, MARKED = "\ufdd0", 0xF0000


def splitter(tokens: Iterable[str]) -> re.Pattern:
    """A pattern whose split() gives text, token, text, ..., text: the tokens are matched longest first."""
    tokens = sorted(set(tokens), key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, tokens)) + ")" if tokens else "(?!)")  # (?!): matches nowhere


def hf_specials(base: Tokenizer, template: str = "") -> dict[str, Any]:
    """A Hugging Face base's special tokens (the `tokenizers` library reads them in any text), and its other added
    tokens the template writes (DeepSeek-R1's <｜User｜> and <｜Assistant｜> are special: false, and the library reads
    an added token in any text too): text -> its AddedToken (lstrip, rstrip, ...).  A one-character added token is
    a character (a char model's export adds '+' and the digits so), not a marker, even where the template's own
    syntax holds it (`'<|im_start|>' + message['role']`): read as text, it has no other id to take."""
    added = base.backend.get_added_tokens_decoder().values()
    return {t.content: t for t in added if t.special or (len(t.content.strip()) > 1 and t.content in template)}


class MessageText:
    """The escapes of one chat tokenizer's markers, and the encoding of rendered text that holds some."""

    def __init__(
        self, kind: str, base: Tokenizer, specials: Iterable[str], added_ids: dict[str, int], template: str = ""
    ) -> None:
        self.kind, self.base, self.added_ids = kind, base, added_ids
        specials = set(specials)
        self.hf_specials = hf_specials(base, template) if kind == "hf" else {}
        self.hf_split = splitter(self.hf_specials)
        self.markers = sorted(specials | set(self.hf_specials), key=len, reverse=True)
        self.number = {m: k for k, m in enumerate(self.markers)}
        self.pattern = re.compile("|".join(map(re.escape, [ESCAPE, *self.markers])))
        self.added = splitter(t for t in added_ids if t not in specials)  # a char base's new characters
        self.literal = None  # a Hugging Face base's backend that reads special tokens as text, made on first use

    def escape(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """The messages with the markers in what people wrote (not the assistant) escaped."""

        def escaped(text: str) -> str:
            return self.pattern.sub(
                lambda m: ESCAPE + (ESCAPE if m[0] == ESCAPE else chr(MARKED + self.number[m[0]])), text
            )

        return [
            {**m, "content": escaped(m["content"])}
            if m.get("role") != "assistant" and isinstance(m.get("content"), str)
            else m
            for m in messages
        ]

    def restore(self, text: str) -> str:
        def original(m: re.Match) -> str:
            k = ord(m[1]) - MARKED
            return ESCAPE if m[1] == ESCAPE else self.markers[k] if 0 <= k < len(self.markers) else m[0]

        return re.sub(ESCAPE + "(.)", original, text, flags=re.S)

    def ids(self, text: str) -> list[int]:
        """The ids of rendered text between two of the template's added markers, escapes in it: the escaped markers
        are encoded as their characters, the rest as encode_chat encodes it."""
        if self.kind != "hf":  # the base reads no markers (char, byte, tiktoken's encode_ordinary), only added tokens
            ids: list[int] = []
            for piece in self.added.split(self.restore(text)):
                if piece:  # an added character of a char base, or text
                    ids += [self.added_ids[piece]] if piece in self.added_ids else self.base.encode(piece)
            return ids
        # a Hugging Face base reads its special tokens in any text: the template's are split out here (with the
        # whitespace a token marked lstrip/rstrip takes, as the library does), and the rest is encoded by a copy of
        # the backend that reads special tokens as text
        if self.literal is None:
            self.literal = type(self.base.backend).from_str(self.base.backend.to_str())
            self.literal.add_special_tokens(  # the template's markers that are not special: read as text too
                [
                    tokenizers_library().AddedToken(
                        t.content,
                        single_word=t.single_word,
                        lstrip=t.lstrip,
                        rstrip=t.rstrip,
                        normalized=t.normalized,
                        special=True,
                    )
                    for t in self.hf_specials.values()
                    if not t.special
                ]
            )
            self.literal.encode_special_tokens = True
        specials = self.hf_specials
        pieces = self.hf_split.split(text)  # text, special, text, ..., text
        ids = []
        for k, piece in enumerate(pieces):
            if k % 2:
                ids.append(self.base.backend.token_to_id(piece))
                continue
            if k > 0 and specials[pieces[k - 1]].rstrip:
                piece = piece.lstrip()
            if k + 1 < len(pieces) and specials[pieces[k + 1]].lstrip:
                piece = piece.rstrip()
            if piece:
                ids += self.literal.encode(self.restore(piece), add_special_tokens=False).ids
        return ids
