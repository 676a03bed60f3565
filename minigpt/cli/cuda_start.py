"""Make the CUDA context while Python imports Lightning, instead of after it.

A process's CUDA context (the driver's state on the device, its memory mapped) is made at its first allocation on
the GPU: for train.py that is Lightning moving the model, after seconds of imports (Lightning's setup, where it
happens, took 3.1 s of an H200 run's start-up: docs/time_to_loss.md). torch lets go of the GIL while it allocates,
so a thread can make the context while the main thread goes on importing; starting the driver (cuInit, under
torch's CUDA init) keeps the GIL, so that part only moves earlier. Only where the device is certain: exactly one
GPU visible (the one a run on it takes), in a process no launcher started (LOCAL_RANK unset: a rank takes its own
device); with several GPUs a context made here would be one more on GPU 0. MINIGPT_EARLY_CUDA=0 turns it off: a
run on the CPU of a one-GPU machine needs no context on the GPU (train.py refuses the fork-based strategies, whose
forked processes could not use a CUDA started before the fork).
"""

from __future__ import annotations

import os
import threading

import torch

ENV = "MINIGPT_EARLY_CUDA"


def wanted() -> bool:
    """Whether to try: a CUDA build of torch, not a launched rank, not turned off (the thread counts the GPUs)."""
    return torch.version.cuda is not None and "LOCAL_RANK" not in os.environ and os.environ.get(ENV, "1") != "0"


def make_context() -> None:
    """With exactly one GPU visible: the context and the caching allocator's first block; no wait for the GPU, and
    no cuBLAS call (its workspace size is fixed at the first one, before Lightning's deterministic mode sets it).
    Counting the GPUs starts the driver, which Lightning would do later anyway. An error is left to the main thread,
    which meets it again and reports it."""
    try:
        if torch.cuda.device_count() == 1:
            torch.ones(1, device="cuda")
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
