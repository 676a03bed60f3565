"""The device a command or the API runs on, named by the user: checked here, where it enters, so a device this
machine lacks is one line naming what it has, not torch's error from deep inside a load."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from minigpt.core.errors import UserError

__all__ = ["current_stream_kept", "resolve_device"]


def resolve_device(name: str) -> str:
    """`auto` -> cuda if available else cpu; a device that does not exist here is a one-line error."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device: torch.device | None = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        why = f"{name!r} is not a device minigpt runs on; use cpu, cuda, cuda:N, mps or auto"
    elif device.type == "cuda" and not torch.cuda.is_available():
        why = f"{name}: CUDA is not available here; use cpu"
    elif device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        why = f"{name}: only {torch.cuda.device_count()} CUDA device(s) here; use cuda:0"
    elif device.type == "mps" and not torch.backends.mps.is_available():
        why = f"{name}: MPS is not available here; use cpu"
    else:
        return name
    raise UserError(f"device {why}")


@contextmanager
def current_stream_kept(device: torch.device) -> Iterator[None]:
    """Around a CUDA-graph capture: where it fails, the caller's stream is current again (torch.cuda.graph's exit
    leaves its capture stream current when the capture ends in an error).  Nothing to do off a GPU."""
    before = torch.cuda.current_stream(device) if device.type == "cuda" else None
    try:
        yield
    except BaseException:
        if before is not None:
            torch.cuda.set_stream(before)
        raise
