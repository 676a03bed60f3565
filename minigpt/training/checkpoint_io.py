"""Lightning's checkpoint I/O with minigpt's rules: atomic writes, weights_only reads (minigpt.core.checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from minigpt.core.checkpoint import read_checkpoint, save_file
from minigpt.core.errors import CheckpointError
from minigpt.core.fsutil import write_errors


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O with atomic writes and weights_only reads (used for save and --resume).

    `preloaded` maps a path to the checkpoint minigpt already read from it (--resume checks the run's last.ckpt
    before training): Lightning gets that dict instead of reading the file a second time."""

    def __init__(self, preloaded: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.preloaded = dict(preloaded or {})

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        # the write is atomic: on a full disk whatever was at `path` before is still there, whole
        with write_errors(
            f"checkpoint {path}",
            "the previous checkpoint is kept: free space there (or make it writable) and continue with --resume",
            CheckpointError,
        ):
            save_file(checkpoint, path)

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> dict:
        if (ckpt := self.preloaded.pop(str(path), None)) is not None:
            return ckpt
        return read_checkpoint(path, map_location=map_location or "cpu")
