"""train's CUDA context made in a thread at launch (minigpt.cli.cuda_start): only where the device is certain (one
GPU visible), never with MINIGPT_EARLY_CUDA=0, and no error of its own: the main thread's first CUDA call reports it."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from minigpt.cli import cuda_start

REPO = Path(__file__).resolve().parents[2]


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


LAUNCH = """
import runpy, sys
from minigpt.cli import cuda_start
from minigpt.cli.main import main
started = []
cuda_start.start_cuda_early = lambda: started.append("minigpt.cli.train" in sys.modules)
sys.argv = ["train.py", "--help"]
try:
    {launch}
except SystemExit:
    pass
print("started", started, file=sys.stderr)
"""
LAUNCHES = {"train.py": 'runpy.run_path("train.py", run_name="__main__")', "minigpt train": 'main(["train", "--help"])'}


@pytest.mark.parametrize("command", ["train.py", "minigpt train"])
def test_train_starts_cuda_before_importing_its_modules(command):
    """Both ways to launch train start the thread, and before minigpt.cli.train (Lightning) is imported: a fresh
    process, where nothing has imported it yet."""
    code = LAUNCH.format(launch=LAUNCHES[command])
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr.strip().splitlines()[-1] == "started [False]", out.stderr[-2000:]
