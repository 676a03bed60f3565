"""How a command ends: a user's mistake (UserError) is one `error:` line and exit code 2, Ctrl-C one line and
exit code 130; anything else keeps its traceback, so it can be reported and fixed."""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

from minigpt.core.errors import ConfigError, UserError, first_line


def fail(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def run_cli(main: Callable[[], object]) -> None:
    """Run an entry point: a UserError prints one `error:` line and exits 2; Ctrl-C exits 130 with one line.
    At the interpreter's exit, the objects alive then are frozen out of the garbage collector's last passes."""
    # Those passes walk every object the imports made (torch's, and for train.py Lightning's, torch._dynamo's and
    # sympy's): 1.3 to 1.5 s of a train.py's exit on a 2-core CPU, ~0.4 s of a command that imports only torch.
    # Finalizers still run (atexit's, and those of objects that reference counting frees); what a frozen cycle
    # alone holds is left to the process's end, as the OS frees it anyway.  Once per process, whoever calls.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)  # registered after the imports' callbacks: it runs before them (last in, first out)
    try:
        main()
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    except UserError as e:
        if isinstance(e, ConfigError) and os.environ.get("LOCAL_RANK", "0") != "0":
            raise SystemExit(2) from None  # a setting every rank refuses alike: the first rank's line says it
        fail(first_line(e, limit=2000))
    except RuntimeError as e:
        if not lost_peer(e):
            raise
        fail("another process of this run stopped first (gloo: connection closed by peer); its error above says why", 1)
    except BrokenPipeError:  # the reader went away (`sample.py ... | head`): stop as a tool killed by SIGPIPE does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush has nowhere to fail
        raise SystemExit(128 + getattr(signal, "SIGPIPE", 13)) from None  # (Windows has no SIGPIPE)


def lost_peer(error: RuntimeError) -> bool:
    """Whether a process of a multi-process run (DDP) stopped because another one did: gloo's collectives fail with
    this message once a peer's socket closes (NCCL's are not matched: not seen here); the peer's own error says why."""
    return "Connection closed by peer" in str(error)


def ignore_interrupts_until_exit() -> None:
    """For a command whose work is done and whose process exits next: Ctrl-C is ignored from here on.  Otherwise it
    lands in the interpreter's exit, as a traceback from an atexit callback (exit status 0) or, once the interpreter
    has restored the default handler, as a kill by SIGINT with no message (status -2), either hiding that the work
    was done.  (SIG_IGN is the one disposition the interpreter's exit keeps.)  Never for a caller in the same
    process: it would lose its Ctrl-C, and its child processes would inherit the ignored signal."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
