"""The GPU suite: what must hold on a CUDA device (attention paths and kernels, train.py / --resume / sample.py /
LoRA end to end, the serve engine's batching).  Every test under tests/gpu/ is marked `gpu` and skipped where CUDA
is absent, so the default run reports them as skipped.  On a GPU machine, from the repository root (minigpt need
not be installed: pytest's pythonpath and the scripts' own folder find it):

    python3 -m pytest -m gpu tests/gpu

Test files here need basenames unique in tests/ (test_gpu_*.py): pytest imports them by basename.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="needs CUDA (run on a GPU machine: python3 -m pytest -m gpu tests/gpu)")
    for item in items:
        if HERE in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(no_cuda)


@pytest.fixture(scope="session")
def cuda() -> torch.device:
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 in these checks (torch's default)
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda")
