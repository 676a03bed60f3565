"""Checkpoints: written atomically, read without unrestricted pickle, found from a file or a run directory.

A checkpoint is a Lightning checkpoint (a dict saved with torch.save) in which
  ckpt["state_dict"]        holds the GPT weights under "model.<name>",
  ckpt["minigpt"]["model_config"] holds GPTConfig.to_dict(),
  ckpt["minigpt"]["tokenizer"]    holds the tokenizer's to_dict(),
so sampling needs nothing but the file.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from minigpt.config import GPTConfig
from minigpt.model import GPT

DEFAULT_OUT_ROOT = "out"
MODEL_PREFIX = "model."


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged, unsafe or not ours; the message says what to do."""


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """Write to a temporary file in the same directory, fsync, then rename: a kill at any moment leaves
    either the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """torch.load with weights_only=True: tensors and plain containers only, never arbitrary objects."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}; pass a .ckpt file or a run directory")
    with open(path, "rb") as f:
        head = f.read(4)
    # torch.save writes a zip archive (or, in its legacy format, a pickle, which starts with 0x80)
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):
        raise CheckpointError(f"{path} is not a checkpoint (not a file written by torch.save); "
                              "pass a .ckpt file or a run directory")
    try:
        with warnings.catch_warnings():  # a foreign pickle protocol only matters if the load fails (below)
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        # torch's message is a paragraph; the line naming the refused object is what helps
        what = next((line for line in lines if "Unsupported" in line or "GLOBAL" in line), lines[0] if lines else "")
        raise CheckpointError(f"refusing to load {path}: it holds objects other than tensors and plain data "
                              f"({what[:160]}); only load checkpoints written by minigpt") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: it is truncated or not a checkpoint "
                              f"({type(e).__name__}); use another file, e.g. the run's last.ckpt") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "minigpt" not in ckpt:
        raise CheckpointError(f"{path} is not a minigpt checkpoint (no model weights/config in it); "
                              "pass a .ckpt written by train.py")
    return ckpt


def find_checkpoint(path: str | Path | None = None, out_root: str | Path = DEFAULT_OUT_ROOT) -> Path:
    """A .ckpt file as given; a run directory -> its best checkpoint (else last); None -> the newest run."""
    if path is None:
        found = sorted(Path(out_root).glob("*/checkpoints/*.ckpt"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise CheckpointError(f"no checkpoint found under {out_root}/; train one with `python train.py` "
                                  "or pass --ckpt PATH")
        return find_checkpoint(found[-1].parent.parent)
    path = Path(path)
    if path.is_dir():
        for candidate in (path / "checkpoints" / "best.ckpt", path / "checkpoints" / "last.ckpt",
                          path / "best.ckpt", path / "last.ckpt"):
            if candidate.is_file():
                return candidate
        raise CheckpointError(f"no checkpoint in run directory {path}; expected checkpoints/best.ckpt or "
                              "checkpoints/last.ckpt")
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}; pass a .ckpt file or a run directory")
    return path


def model_state_dict(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The GPT's own weights from a Lightning checkpoint (strip the LightningModule's "model." prefix)."""
    return {k[len(MODEL_PREFIX):]: v for k, v in ckpt["state_dict"].items() if k.startswith(MODEL_PREFIX)}


def model_from_checkpoint(ckpt: dict[str, Any], **config_overrides: Any) -> GPT:
    cfg = GPTConfig.from_dict({**ckpt["minigpt"]["model_config"], **config_overrides})
    model = GPT(cfg)
    model.load_state_dict(model_state_dict(ckpt))
    return model


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O with atomic writes and weights_only reads (used for save and --resume)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> dict:
        return load_checkpoint(path, map_location=map_location or "cpu")
