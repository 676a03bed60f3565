"""Verification: is a prepared directory what its meta.json says it is?

meta.json records the size, CRC-32 and largest token id of train.bin/val.bin and the sha256 of tokenizer.json;
`verify_prepared` compares the files with them, so a damaged cache is prepared again (or refused when loaded),
never trained on. A check that passed is remembered for the process by the files' stats.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from minigpt.core.errors import first_line

__all__ = ["file_sha256", "scan_tokens", "verify_prepared"]

VERIFY_TOKENS = 16 << 20  # token files are checked this many tokens at a time (32-64 MB of memory)
_VERIFIED: set[tuple] = set()  # (directory, file stats) checked by this process: prepare + load read them once


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def scan_tokens(path: Path, dtype: np.dtype) -> tuple[int, int]:
    """(CRC-32 of the file, largest token id in it), reading VERIFY_TOKENS at a time (bounded memory). CRC-32,
    not sha256: this runs at every start over the whole split, and it only has to catch damage, not forgery."""
    crc, top = 0, -1
    # read into one buffer, not a memmap: a memmap's pages count in the process's RSS as it walks the file, so a
    # check of a 1 GB file would look (and, under memory pressure, act) like 1 GB of memory
    buffer = np.empty(VERIFY_TOKENS, dtype=dtype)
    raw = memoryview(buffer).cast("B")
    with open(path, "rb") as f:
        while n := f.readinto(raw):
            crc = zlib.crc32(raw[:n], crc)
            if n >= dtype.itemsize:
                top = max(top, int(buffer[: n // dtype.itemsize].max()))
    return crc, top


def verify_prepared(out: Path, meta: dict[str, Any]) -> str | None:
    """What is wrong with the prepared files at out compared with meta.json, or None when they match: sizes,
    checksums and the largest token id of train.bin/val.bin, and the hash of tokenizer.json. Reads both token
    files whole (about 1 s per GB), once per process: a check that passed is remembered by the files' stats."""
    try:
        dtype = np.dtype(meta["dtype"])
        files = [out / "train.bin", out / "val.bin", out / "tokenizer.json", out / "meta.json"]
        key = (str(out.resolve()), *((s.st_size, s.st_mtime_ns, s.st_ino) for s in map(os.stat, files)))
        if key in _VERIFIED:
            return None
        if file_sha256(out / "tokenizer.json") != meta["tokenizer_sha256"]:
            return "tokenizer.json differs from the one it was prepared with"
        for name in ("train", "val"):
            path = out / f"{name}.bin"
            if path.stat().st_size != meta[f"{name}_tokens"] * dtype.itemsize:
                return (
                    f"{name}.bin holds {path.stat().st_size // dtype.itemsize:,} tokens, meta.json says "
                    f"{meta[f'{name}_tokens']:,}"
                )
            crc, top = scan_tokens(path, dtype)
            if top >= meta["vocab_size"]:
                return f"{name}.bin holds token id {top}, outside the vocabulary of {meta['vocab_size']}"
            if crc != meta[f"{name}_crc32"]:
                return f"{name}.bin's checksum differs from meta.json's"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{type(e).__name__}: {first_line(e)}"
    _VERIFIED.add(key)
    return None
