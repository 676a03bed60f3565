"""One family of errors for user mistakes; only those become the one-line `error:` exit of the commands.

Anything else (a bug in minigpt, torch or Lightning) keeps its traceback, so it can be reported and fixed.
Library code names concepts ("temperature", "n_embd", "the byte tokenizer"); the command-line layer names flags.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in what the user asked for or gave us; the message names the problem and the fix."""


class ConfigError(UserError):
    """A model or optimizer setting that cannot work."""


class DataError(UserError):
    """A problem with the user's data or data settings."""


class CheckpointError(UserError):
    """A checkpoint that is missing, damaged, unsafe or not ours."""


class UnknownCharactersError(UserError):
    """Text holds characters the char tokenizer's vocabulary (the training corpus's characters) lacks."""

    def __init__(self, chars: list[str]) -> None:
        self.chars = list(chars)
        super().__init__(
            f"{len(self.chars)} character(s) not in the char tokenizer's vocabulary: "
            f"{shown_chars(self.chars)}; remove them, or prepare the data with the byte tokenizer, "
            "which encodes any text"
        )

    def about(self, what: str, fix: str) -> UserError:
        """The refusal as a user meets it: what held the characters (a prompt, a message, a text), and what to do."""
        return UserError(
            f"{what} has {len(self.chars)} character(s) outside the model's char vocabulary: "
            f"{shown_chars(self.chars)}; {fix}"
        )


def shown_chars(chars: list[str], limit: int = 10) -> str:
    return ", ".join(repr(c) for c in chars[:limit]) + (", ..." if len(chars) > limit else "")


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first non-empty line of an exception's message (torch and datasets write paragraphs), or its type."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0][:limit] if lines else type(e).__name__
