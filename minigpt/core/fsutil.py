"""Atomic file-system writes, shared by checkpoints, downloads, exports and prepared data, and their one error.

Everything is first written under a temporary name in the destination's own directory (`.NAME.tmp-PID`),
flushed to disk, then renamed into place: a kill at any moment leaves the old file (or folder) or the new one,
never half of one.  Leftovers of killed processes are removed by the next writer (`remove_stale`).
A write that fails because the destination cannot take it (full disk, quota, read-only, forbidden) is the user's
to fix, not a bug: `write_error` and `write_errors` make it one line, "cannot write X (No space left on device); FIX".
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from minigpt.core.errors import DataError, UserError

_LEFTOVER = re.compile(r"^\..+\.(?:tmp|old)-(\d+)$")


def temp_sibling(path: Path, kind: str = "tmp") -> Path:
    """A hidden name beside `path` that `remove_stale` recognises once this process is gone."""
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}")


def fsync_dir(path: str | Path) -> None:
    """Make renames and new entries in a directory durable.  Not on Windows, which opens no folder as a file
    (PermissionError) and needs no such flush for a rename."""
    if sys.platform == "win32":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Call write(f) on a temporary file beside `path`, fsync it, then rename it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # whatever stopped the write (renamed into place, it is gone already)
    fsync_dir(path.parent)


def make_writable_dir(folder: Path) -> None:
    """`folder` made if missing and a file written to it and removed: an OSError says the folder cannot be written,
    before work whose result would go there is done."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=folder):
        pass


def write_json(path: str | Path, obj: Any) -> None:
    """JSON to a file, flushed to disk (inside a temporary folder that is installed whole, see install_dir)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def install_dir(tmp: Path, out: Path) -> None:
    """Put the complete folder tmp at out: an old out is renamed away first, then deleted."""
    old = temp_sibling(out, "old")
    if out.exists():
        os.rename(out, old)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)


def remove_stale(folder: Path) -> None:
    """Delete the leftovers (.NAME.tmp-PID, .NAME.old-PID) of writers whose process is gone."""
    for path in folder.glob(".*"):
        m = _LEFTOVER.match(path.name)
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


# errors that mean "this folder cannot take the data", not a bug: full disk or quota, read-only or forbidden
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def write_error(e: OSError, target: str | Path, fix: str, error: type[UserError] = DataError) -> UserError | None:
    """`error("cannot write TARGET (No space left on device); FIX")` when e says the destination cannot take the
    data (WRITE_ERRNOS, or a file where a folder must be), else None: any other OSError is a bug or another
    problem, and keeps its traceback."""
    if e.errno in (errno.EEXIST, errno.ENOTDIR) and e.filename is not None:  # mkdir where a file stands
        path = Path(e.filename)
        if file := next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None):
            return error(f"cannot write {target} ({file} is a file, not a folder); {fix}")
    if e.errno not in WRITE_ERRNOS:
        return None
    return error(f"cannot write {target} ({os.strerror(e.errno)}); {fix}")


@contextmanager
def write_errors(target: str | Path, fix: str, error: type[UserError] = DataError) -> Iterator[None]:
    """Turn an OSError of the block that write_error recognises into its one-line error; others pass through."""
    try:
        yield
    except OSError as e:
        if (failure := write_error(e, target, fix, error)) is None:
            raise
        raise failure from None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs.  On Windows not by os.kill(pid, 0): signal 0 is CTRL_C_EVENT there, which
    os.kill sends to the console's processes (this one among them), or fails on with WinError 87 for a pid gone."""
    if sys.platform == "win32":
        import _winapi

        try:
            handle = _winapi.OpenProcess(0x00100000, False, pid)  # SYNCHRONIZE: enough to wait on it
        except OSError as e:
            return getattr(e, "winerror", None) == 5  # access denied: it exists (87, invalid parameter: it does not)
        try:
            return _winapi.WaitForSingleObject(handle, 0) == 0x102  # WAIT_TIMEOUT: it has not exited
        finally:
            _winapi.CloseHandle(handle)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
