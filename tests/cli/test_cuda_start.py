"""train's CUDA context made in a thread at launch (minigpt.cli.cuda_start): only where the device is certain (one
GPU visible), never with MINIGPT_EARLY_CUDA=0, and no error of its own: the main thread's first CUDA call reports it."""

from __future__ import annotations

import threading

import pytest
import torch

from minigpt.cli import cuda_start


@pytest.fixture
def cuda_build(monkeypatch):
    """As a CUDA build of torch: the thread is started, and what it allocates on which device is recorded."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv(cuda_start.ENV, raising=False)
    allocated: list[str] = []
    ones = torch.ones
    monkeypatch.setattr(torch, "ones", lambda *shape, device: allocated.append(device) or ones(*shape))
    return allocated


def test_no_thread_on_a_cpu_build_or_turned_off(monkeypatch, cuda_build):
    monkeypatch.setenv(cuda_start.ENV, "0")
    assert cuda_start.start_cuda_early() is None
    monkeypatch.setenv(cuda_start.ENV, "1")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert cuda_start.start_cuda_early() is None
    assert cuda_build == []


@pytest.mark.parametrize("gpus", [0, 1, 2, 8])
def test_a_context_only_with_exactly_one_gpu(monkeypatch, cuda_build, gpus):
    """With several GPUs each rank takes its own device: a context made here would be a stray one on GPU 0."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    cuda_start.start_cuda_early().join()
    assert cuda_build == (["cuda"] if gpus == 1 else [])


def test_an_error_stays_in_the_thread(monkeypatch):
    """Where CUDA fails (here: a CPU build taken for a CUDA one), the thread ends quietly; nothing is printed."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv(cuda_start.ENV, raising=False)
    raised: list = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    thread = cuda_start.start_cuda_early()
    thread.join()
    assert raised == [] and not thread.daemon  # not a daemon: an early exit waits for it, not tears CUDA down
