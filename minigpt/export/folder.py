"""The folder of an export (minigpt.export.hf): what proves it is one, and how it replaces an old one safely.

Every export ends with a manifest, minigpt_export.json, listing each file it wrote with its size and SHA-256,
written last.  `--overwrite` deletes a folder only if that manifest says every entry in it is an export's file,
unchanged; file names prove nothing (transformers writes the same ones).  The new export is installed by renames:
the old folder is moved aside, checked again to be exactly what was approved, and deleted only once the new one
is in place; a kill between the renames is repaired by the next export (`restore_interrupted`).
Write failures the user fixes (full disk, quota, read-only, a file-size limit) are one line, whether the OSError
comes from Python or from the Rust of safetensors or tokenizers (`storage_errors`; numpy's short write, which has no
errno, is asked its cause in minigpt.export.gguf_file).
"""

from __future__ import annotations

import errno
import glob
import hashlib
import importlib.metadata
import os
import re
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from minigpt.core.errors import UserError, first_line
from minigpt.core.fsutil import WRITE_ERRNOS, fsync_dir, pid_alive, temp_sibling, write_json
from minigpt.core.user_files import loads

__all__ = [
    "MANIFEST",
    "FolderState",
    "check_out_path",
    "check_previous_export",
    "folder_state",
    "install_export",
    "restore_interrupted",
    "seal_export",
    "storage_errors",
]

# no name transformers reads (config.json, generation_config.json, tokenizer*, special_tokens_map.json, ...)
MANIFEST = "minigpt_export.json"
MANIFEST_FORMAT = "minigpt-hf-export"
MANIFEST_MAX_BYTES = 1 << 20  # an export lists a handful of files: a larger file is not our manifest
SHA256 = re.compile(r"[0-9a-f]{64}")
# errors the user fixes, not bugs: WRITE_ERRNOS and a file-size limit (EFBIG: `ulimit -f`, FAT32's 4 GiB)
STORAGE_ERRNOS = WRITE_ERRNOS | {errno.EFBIG}
STORAGE_FIX = "free space there or choose another output folder"
# a folder that takes no writes at all needs another folder, not space
READ_ONLY_FIX = {
    errno.EROFS: "the folder is read-only; choose another output folder",
    errno.EACCES: "the folder is read-only to this user; choose another output folder, or make it writable",
    errno.EPERM: "the folder is read-only to this user; choose another output folder, or make it writable",
}
# Rust's std::io::Error in a safetensors or tokenizers exception: "... (os error 28)", older "Os { code: 28, ..."
RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)")
REFUSE = "so --overwrite would delete it; choose another output folder, or move it away"

# each entry of a folder as (name, mode, inode, size, mtime_ns, ctime_ns): an edit, a replacement or a new entry
# changes it, so a folder approved for --overwrite is deleted only in the state it was approved in
FolderState = frozenset[tuple[str, int, int, int, int, int]]


def folder_state(folder: Path) -> FolderState | None:
    """The entries of `folder` as FolderState; None if it is not a folder (missing, or a file)."""
    try:
        with os.scandir(folder) as entries:
            return frozenset((e.name, *_stat_key(e.stat(follow_symlinks=False))) for e in entries)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _stat_key(info: os.stat_result) -> tuple[int, int, int, int, int]:
    return info.st_mode, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


# ------------------------------------------------------------------------------------------------- checks


def check_out_path(out_dir: Path) -> None:
    """Every existing part of out_dir's path is a folder: `--out notes.txt/sub` is one line, not a traceback."""
    for path in [*reversed(out_dir.parents), out_dir]:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            return  # this part and the ones below it are created by the export
        except OSError as e:  # a symlink loop, a name too long, a folder we may not enter
            raise UserError(
                f"cannot use {out_dir} as the output folder: {path} ({e.strerror}); choose another output folder"
            ) from None
        if not stat.S_ISDIR(mode):
            raise UserError(
                f"{out_dir} exists and is not a folder; choose another output folder"
                if path == out_dir
                else f"{path} is a file, not a folder, so {out_dir} cannot be created in it; choose "
                "another output folder"
            )


def check_previous_export(out_dir: Path) -> None:
    """UserError unless every entry of out_dir is a regular file its manifest lists with the same size and SHA-256:
    a folder an export wrote and nobody changed since, which --overwrite may delete whole."""
    for why in _foreign_entries(out_dir, read_manifest(out_dir)):
        raise UserError(f"{why}, {REFUSE}")


def _foreign_entries(out_dir: Path, listed: dict[str, tuple[int, str]]) -> Iterator[str]:
    """Why each entry of out_dir is not an unchanged file of the export: names, types and sizes first, so that a
    foreign file is found without reading any file; then the SHA-256 of each."""
    entries = sorted((e for e in os.scandir(out_dir) if e.name != MANIFEST), key=lambda e: e.name)
    for entry in entries:
        path = out_dir / entry.name
        if entry.is_symlink() or not entry.is_file(follow_symlinks=False):
            kind = "a symbolic link" if entry.is_symlink() else "a folder" if entry.is_dir() else "not a regular file"
            yield f"{path} is {kind}, not a file export.py wrote"
        elif entry.name not in listed:
            yield f"{path} is not a file export.py wrote (its {MANIFEST} does not list it)"
        elif entry.stat(follow_symlinks=False).st_size != listed[entry.name][0]:
            yield f"{path} was changed after export.py wrote it (its size differs from {MANIFEST})"
    for entry in entries:
        with open(out_dir / entry.name, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != listed[entry.name][1]:
                yield (
                    f"{out_dir / entry.name} was changed after export.py wrote it (its SHA-256 differs from {MANIFEST})"
                )


def read_manifest(out_dir: Path) -> dict[str, tuple[int, str]]:
    """name -> (size, sha256) from out_dir's manifest; UserError if there is none or it is not one export.py wrote."""
    path = out_dir / MANIFEST
    if not os.path.lexists(path):
        present = sorted(p.name for p in out_dir.iterdir())
        raise UserError(
            f"{out_dir} holds no {MANIFEST} (the list of files export.py writes; older minigpt versions "
            "wrote none), so its files may be yours and --overwrite would delete "
            f"{', '.join(present[:3])}{', ...' if len(present) > 3 else ''}; choose another output "
            "folder, or move them away"
        )
    listed: dict[str, tuple[int, str]] = {}
    for why in _manifest_problems(path, listed):
        raise UserError(
            f"{path} is not a manifest export.py wrote ({why}), so --overwrite cannot tell an export's "
            "files from yours; choose another output folder, or move the folder's files away"
        )
    return listed


def _manifest_problems(path: Path, listed: dict[str, tuple[int, str]]) -> Iterator[str]:
    """Why `path` is not a manifest export.py wrote (the first reason only), filling `listed` from its entries."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode) or info.st_size > MANIFEST_MAX_BYTES:
        yield "not a regular file" if not stat.S_ISREG(info.st_mode) else f"{info.st_size:,} bytes"
        return
    try:
        doc = loads(path.read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, nested past MAX_JSON_DEPTH
        yield first_line(e)
        return
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT or not isinstance(doc.get("files"), list):
        yield f"no format {MANIFEST_FORMAT!r} with a list of files"
        return
    for item in doc["files"]:
        name, size, sha256 = (item.get(k) for k in ("name", "size", "sha256")) if isinstance(item, dict) else [None] * 3
        if not (
            isinstance(name, str)
            and name not in listed
            and name not in ("", ".", "..", MANIFEST)
            and "/" not in name
            and "\0" not in name
            and type(size) is int
            and size >= 0
            and isinstance(sha256, str)
            and SHA256.fullmatch(sha256)
        ):
            yield f"a file entry is not a unique plain name with its size and SHA-256: {str(item)[:60]}"
            return
        listed[name] = size, sha256


# ------------------------------------------------------------------------------------------------- writing


def seal_export(folder: Path, mode_from: str = "config.json") -> None:
    """Give every file of a finished export the umask's mode, flush it to disk, then write the manifest listing it
    (last: a folder with a manifest is a complete export).  mode_from: a file of the folder that write_json wrote."""
    mode = (folder / mode_from).stat().st_mode & 0o777  # the umask's; safetensors writes 0600
    files = []
    for path in sorted(folder.iterdir()):
        path.chmod(mode)
        with open(path, "rb") as f:  # safetensors and tokenizers write without fsync
            files.append(
                {
                    "name": path.name,
                    "size": os.fstat(f.fileno()).st_size,
                    "sha256": hashlib.file_digest(f, "sha256").hexdigest(),
                }
            )
            os.fsync(f.fileno())
    write_json(
        folder / MANIFEST, {"format": MANIFEST_FORMAT, "version": 1, "minigpt": minigpt_version(), "files": files}
    )
    fsync_dir(folder)


def install_export(tmp: Path, out_dir: Path, approved: FolderState) -> None:
    """Put the finished export `tmp` at out_dir: an old folder is renamed aside, and deleted once the new one is in
    place, only if it is still in the state check_out_dir approved (else it goes back, untouched)."""
    old = temp_sibling(out_dir, "old")
    if os.path.lexists(out_dir):
        os.rename(out_dir, old)
        if folder_state(old) != approved:  # something was added or changed while the model was written
            os.rename(old, out_dir)
            raise UserError(
                f"{out_dir} changed while the export was written, so it was left as it is; run the export "
                "again, with another output folder if the files are yours"
            )
    os.rename(tmp, out_dir)
    try:
        fsync_dir(out_dir.parent)
    finally:  # the new export is in place: the old one goes even if Ctrl-C comes now
        shutil.rmtree(old, ignore_errors=True)


def restore_interrupted(out_dir: Path, pid: int | None = None) -> None:
    """Put back an old folder that an export renamed aside (`.NAME.old-PID`) but did not replace: one killed (its
    process is gone), or with `pid`, that process's own (stopped by an exception)."""
    for old in out_dir.parent.glob(f".{glob.escape(out_dir.name)}.old-*"):
        owner = old.name.rpartition("-")[2]
        if (
            owner.isascii()
            and owner.isdigit()
            and not os.path.lexists(out_dir)
            and (int(owner) == pid or not pid_alive(int(owner)))
        ):
            os.rename(old, out_dir)


def minigpt_version() -> str | None:
    """The installed minigpt's version, for the manifest's reader (None when run from a source tree)."""
    try:
        return importlib.metadata.version("minigpt")
    except importlib.metadata.PackageNotFoundError:
        return None


@contextmanager
def storage_errors(out_dir: Path) -> Iterator[None]:
    """A write the destination cannot take (full disk, quota, read-only, forbidden, a file-size limit) becomes one
    line naming out_dir and the fix (space for a full disk, another folder for a read-only one); raised by Python
    (OSError) or by safetensors/tokenizers (their own exception, carrying Rust's "(os error N)").  Anything else
    keeps its traceback."""
    try:
        yield
    except Exception as e:
        rust = RUST_OS_ERROR.search(str(e)) if not isinstance(e, OSError) else None
        code = e.errno if isinstance(e, OSError) else int(rust.group(1) or rust.group(2)) if rust else None
        if code not in STORAGE_ERRNOS:
            raise
        raise UserError(
            f"cannot write {out_dir} ({os.strerror(code)}); {READ_ONLY_FIX.get(code, STORAGE_FIX)}"
        ) from None
