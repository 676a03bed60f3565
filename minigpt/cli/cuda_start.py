"""Make the CUDA context while Python imports Lightning, instead of after it.

A process's CUDA context (the driver's state on the device, its memory mapped) is made at its first allocation on
the GPU: for train.py that is Lightning moving the model, after seconds of imports (Lightning's setup, where it
happens, took 3.1 s of an H200 run's start-up: docs/time_to_loss.md). torch lets go of the GIL while it allocates, so a thread can make the context
while the main thread goes on importing. Only where the device is certain: exactly one GPU visible (the one a run
on it takes); with several, each rank of a multi-device run picks its own, and a context made here would be one
more on GPU 0. MINIGPT_EARLY_CUDA=0 turns it off: a strategy that forks processes (ddp_fork) refuses a CUDA
started before it, and a run on the CPU of a one-GPU machine needs no context on the GPU.
"""

from __future__ import annotations

import os
import threading

import torch

ENV = "MINIGPT_EARLY_CUDA"


def wanted() -> bool:
    """Whether to try: a CUDA build of torch, not turned off (the thread itself counts the GPUs)."""
    return torch.version.cuda is not None and os.environ.get(ENV, "1") != "0"


def make_context() -> None:
    """With exactly one GPU visible: the context, the caching allocator's first block and a cuBLAS handle (the
    thread hands it back to torch's pool when it ends); no wait for the GPU. Counting the GPUs starts the driver,
    which Lightning would do later anyway. An error is left to the main thread, which meets it again and reports it."""
    try:
        if torch.cuda.device_count() == 1:
            x = torch.ones(8, 8, device="cuda")
            x @ x
    except Exception:  # noqa: BLE001 -- the main thread's own first CUDA call reports it
        pass


def start_cuda_early() -> threading.Thread | None:
    """Start making the CUDA context in a thread; returns it, or None where it is not wanted. Not a daemon: a
    command that ends first (--help, a bad flag) waits for it at exit rather than tearing CUDA down under it."""
    if not wanted():
        return None
    thread = threading.Thread(target=make_context, name="minigpt-cuda-start")
    thread.start()
    return thread
