"""One .gguf file, written the way an export folder is (minigpt.export.folder): refused before anything is written
when --out is taken, appearing whole or not at all, and replaced by --overwrite only if minigpt wrote it and nobody
changed it since.

The proof travels inside the file, since a GGUF file is all a user moves around: its second metadata key (right
after general.architecture), `minigpt.sha256`, holds the SHA-256 of the whole file as written with that value's 64
characters read as "0".  The file is written with the zeros, hashed, and the digest written over them last; any
later change (a tensor, a metadata value edited with gguf-py's gguf_set_metadata, a truncation) fails the check.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

from minigpt.core.errors import UserError
from minigpt.core.fsutil import fsync_dir, remove_stale, temp_sibling
from minigpt.export.folder import check_out_path, storage_errors

__all__ = ["SHA_KEY", "FileState", "check_out_file", "check_previous_gguf", "file_state", "write_gguf_file"]

SHA_KEY = "minigpt.sha256"
PLACEHOLDER = b"0" * 64
GGUF_MAGIC, GGUF_STRING = b"GGUF", 8
REFUSE = "so --overwrite would replace it; choose another output file, or move it away"
# a file's (mode, inode, size, mtime_ns, ctime_ns): replaced only in the state --overwrite approved
FileState = tuple[int, int, int, int, int] | None


def file_state(path: Path) -> FileState:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    return info.st_mode, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def check_out_file(out: Path, overwrite: bool, checked: FileState = None) -> FileState:
    """A missing --out is fine; an existing one only with overwrite, and only a GGUF file minigpt wrote, unchanged.
    Returns its state as approved (None: none there); `checked`, an earlier call's answer, skips reading it again."""
    check_out_path(out.parent)
    state = file_state(out)
    if state is None:
        return None
    if stat.S_ISDIR(state[0]):
        raise UserError(f"{out} is a folder; give the path of the .gguf file to write, e.g. {out / 'model.gguf'}")
    if not overwrite:
        raise UserError(
            f"{out} already exists; choose another output file, or pass --overwrite to replace a previous export"
        )
    if state != checked:
        try:
            check_previous_gguf(out)
        except OSError as e:  # a file we may not read
            raise UserError(f"cannot read {out} ({e.strerror}); choose another output file") from None
    return state


def check_previous_gguf(path: Path) -> None:
    """UserError unless `path` is a regular file that minigpt's GGUF export wrote and nobody changed since."""
    for why in _foreign(path):
        raise UserError(f"{path} {why}, {REFUSE}")


def _foreign(path: Path) -> Iterator[str]:
    """Why `path` is not a GGUF file export.py wrote, unchanged (the first reason only)."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file"
        yield f"is {kind}, not a GGUF file export.py wrote"
        return
    with open(path, "rb") as f:
        offset = _digest_offset(f)
        if offset is None:
            yield f"is not a GGUF file export.py wrote (it has no {SHA_KEY} key)"
            return
        f.seek(offset)
        recorded = f.read(64)
        if _file_digest(f, offset).encode() != recorded:
            yield f"was changed after export.py wrote it (its SHA-256 differs from its {SHA_KEY})"


def _digest_offset(f) -> int | None:
    """Where the 64 characters of minigpt.sha256 start, read from the header (magic, version, counts, then the
    first two keys); None when the file is not laid out as the export writes it."""
    head = f.read(4096)
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        return None
    at = 24  # magic, version (u32), tensor count (u64), key count (u64)
    for expected in (b"general.architecture", SHA_KEY.encode()):
        if len(head) < at + 8:
            return None
        (n,) = struct.unpack_from("<Q", head, at)
        key = head[at + 8 : at + 8 + n]
        at += 8 + n
        if key != expected or len(head) < at + 12:
            return None
        kind, length = struct.unpack_from("<IQ", head, at)
        at += 12
        if kind != GGUF_STRING or (key == SHA_KEY.encode() and length != 64):
            return None
        if key == SHA_KEY.encode():
            return at if len(head) >= at + 64 else None
        at += length
    return None


def _file_digest(f, offset: int) -> str:
    """SHA-256 of the file with the 64 bytes at `offset` read as PLACEHOLDER."""
    f.seek(0)
    digest = hashlib.sha256(f.read(offset))
    f.seek(offset + 64)
    digest.update(PLACEHOLDER)
    while chunk := f.read(1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def seal(path: Path) -> None:
    """Write the file's digest over its placeholder and flush it to disk."""
    with open(path, "r+b") as f:
        offset = _digest_offset(f)  # never None: gguf.py writes SHA_KEY as the second key
        digest = _file_digest(f, offset)
        f.seek(offset)
        f.write(digest.encode())
        f.flush()
        os.fsync(f.fileno())


def short_write_cause(path: Path) -> OSError | None:
    """Why a write to `path` stopped short, as an OSError with its errno; None if it no longer does.  gguf-py writes
    tensors with numpy's tofile, whose short write carries no errno ("12288 requested and 6552 written"); the file
    system says why when asked to append to the same file: a full disk, a quota or a file-size limit fails again."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    except OSError as cause:
        return cause
    try:
        probe = bytes(1 << 16)
        while probe:
            probe = probe[os.write(fd, probe) :]
        os.fsync(fd)
    except OSError as cause:
        return cause
    finally:
        os.close(fd)
    return None


def write_gguf_file(out: Path, write: Callable[[Path], None], approved: FileState) -> None:
    """Call write(path) on a hidden sibling of `out`, seal it, and rename it to `out` (replacing the approved file).
    A full disk, Ctrl-C or any failure leaves `out` as it was and no temporary file."""
    out = Path(out).resolve()  # ".." or a symlinked folder: the sibling must sit beside the real file
    created = [p for p in out.parents if not p.exists()]  # removed again if the export fails
    tmp = temp_sibling(out)
    with storage_errors(out):
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            remove_stale(out.parent)  # the leftovers of exports that were killed
            try:
                write(tmp)
            except OSError as e:
                cause = short_write_cause(tmp) if e.errno is None else None  # numpy's short write: ask why
                if cause is None:
                    raise
                raise cause from e
            seal(tmp)
            if file_state(out) != approved:  # replaced or created while the model was written
                raise UserError(
                    f"{out} changed while the export was written, so it was left as it is; run the export "
                    "again, with another output file if it is yours"
                )
            os.replace(tmp, out)
            fsync_dir(out.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            for parent in created:  # deepest first; only if still empty
                with contextlib.suppress(OSError):
                    parent.rmdir()
            raise
