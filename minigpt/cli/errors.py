"""How a command ends: a user's mistake (UserError) is one `error:` line and exit code 2, Ctrl-C one line and
exit code 130; anything else keeps its traceback, so it can be reported and fixed."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

from minigpt.core.errors import UserError, first_line


def fail(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def run_cli(main: Callable[[], object]) -> None:
    """Run an entry point: a UserError prints one `error:` line and exits 2; Ctrl-C exits 130 with one line."""
    try:
        main()
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    except UserError as e:
        fail(first_line(e, limit=2000))
