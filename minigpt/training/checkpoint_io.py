"""Lightning's checkpoint I/O with minigpt's rules: atomic writes, weights_only reads (minigpt.core.checkpoint)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from minigpt.core.checkpoint import read_checkpoint, save_file
from minigpt.core.errors import CheckpointError
from minigpt.core.fsutil import WRITE_ERRNOS


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O with atomic writes and weights_only reads (used for save and --resume)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        try:
            save_file(checkpoint, path)
        except OSError as e:  # the write is atomic: whatever was at `path` before is still there, whole
            if e.errno not in WRITE_ERRNOS:
                raise
            raise CheckpointError(f"cannot write checkpoint {path} ({os.strerror(e.errno)}); the previous checkpoint "
                                  "is kept: free space there (or make it writable) and continue with --resume") from None

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> dict:
        return read_checkpoint(path, map_location=map_location or "cpu")
