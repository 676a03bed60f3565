"""train's CUDA context made in a thread at launch (minigpt.cli.cuda_start): only where the device is certain (one
GPU visible), never with MINIGPT_EARLY_CUDA=0, and no error of its own: the main thread's first CUDA call reports it."""

from __future__ import annotations

import runpy
import sys
import threading
from pathlib import Path

import pytest
import torch

from minigpt.cli import cuda_start
from minigpt.cli.main import main


@pytest.fixture
def cuda_build(monkeypatch):
    """As a CUDA build of torch: the thread is started, and what it allocates on which device is recorded."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv(cuda_start.ENV, raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    allocated: list[str] = []
    ones = torch.ones
    monkeypatch.setattr(torch, "ones", lambda *shape, device: allocated.append(device) or ones(*shape))
    return allocated


def test_no_thread_on_a_cpu_build_in_a_launched_rank_or_turned_off(monkeypatch, cuda_build):
    monkeypatch.setenv("LOCAL_RANK", "0")  # a rank a launcher started takes its own device
    assert cuda_start.start_cuda_early() is None
    monkeypatch.delenv("LOCAL_RANK")
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


def test_an_error_stays_in_the_thread(monkeypatch, cuda_build):
    """Where CUDA fails (here: the allocation raises, as on a broken driver), the thread ends quietly."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def broken(*shape, device):
        raise RuntimeError("CUDA error: no CUDA-capable device is detected")

    monkeypatch.setattr(torch, "ones", broken)
    raised: list = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    thread = cuda_start.start_cuda_early()
    thread.join()
    assert raised == [] and not thread.daemon  # not a daemon: an early exit waits for it, not tears CUDA down


@pytest.mark.parametrize("command", ["train.py", "minigpt train"])
def test_train_starts_cuda_before_importing_its_modules(monkeypatch, command):
    """Both ways to launch train start the thread, and before minigpt.cli.train (Lightning) is imported."""
    started: list[bool] = []
    monkeypatch.setattr(cuda_start, "start_cuda_early", lambda: started.append("minigpt.cli.train" in sys.modules))
    monkeypatch.delitem(sys.modules, "minigpt.cli.train", raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py", "--help"])
    with pytest.raises(SystemExit):
        if command == "train.py":
            runpy.run_path(str(Path(__file__).resolve().parents[2] / "train.py"), run_name="__main__")
        else:
            main(["train", "--help"])
    assert started == [False]
