"""User mistakes end in one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn


class UserError(ValueError):
    """A mistake in what the user asked for; the message names the problem and the fix."""


def fail(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def run_cli(main: Callable[[], object], user_errors: tuple[type[BaseException], ...] = (ValueError,)) -> None:
    """Run an entry point; the listed exception types (user mistakes) print one line instead of a traceback.

    Every error type minigpt raises for bad input (ConfigError, DataError, CheckpointError, UserError,
    UnknownCharactersError) derives from ValueError.
    """
    try:
        main()
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    except user_errors as e:
        fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
