"""The device a command or the API runs on, named by the user: checked here, where it enters, so a device this
machine lacks is one line naming what it has, not torch's error from deep inside a load."""

from __future__ import annotations

import torch

from minigpt.core.errors import UserError

__all__ = ["resolve_device"]


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
