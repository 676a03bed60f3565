import os
import random
from pathlib import Path

import pytest

from support import flags

# tests never reach the network: datasets and the hub stay offline
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config):
    """Each pytest-xdist worker gets its share of the cores, and so do the commands it runs.  torch's default of a
    thread per core in every worker oversubscribes them, and OpenMP's barriers then wait on threads that are not
    running: the suite took 6:05 on 2 cores in 2 workers, 3:48 with one thread each.  A user's OMP_NUM_THREADS
    stays."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return
    import torch

    # the cores this process may use (Linux), else all of them
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = max(1, cores // int(workers))
    os.environ.setdefault("OMP_NUM_THREADS", str(share))  # read by the subprocesses' torch at its start
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _make_corpus(path: Path, n_lines: int = 800, seed: int = 0) -> Path:
    """A few dozen KB of text with learnable structure (a small vocabulary of words)."""
    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog while cats sit on warm mats and birds sing".split()
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(n_lines)) + "\n")
    return path


@pytest.fixture(scope="session")
def make_corpus():
    """The corpus builder: make_corpus(path, n_lines=800, seed=0) -> path."""
    return _make_corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return _make_corpus(tmp_path_factory.mktemp("corpus") / "words.txt")


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("prepared")


def _tiny_run_args(corpus: Path, data_root: Path, out_dir: Path, steps: int = 30, **overrides: object) -> list[str]:
    """train.py flags for a run of a few seconds on the CPU."""
    args = {
        "data.source": corpus,
        "data.data_root": data_root,
        "out_dir": out_dir,
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.n_embd": 32,
        "model.block_size": 32,
        "optim.warmup_steps": 5,
        "sample_tokens": 8,
        "optim.learning_rate": 0.01,
        "data.batch_size": 8,
        "data.val_batches": 2,
        "trainer.max_steps": steps,
        "trainer.val_check_interval": 10,
        "trainer.log_every_n_steps": 5,
        "trainer.enable_progress_bar": False,
        "checkpoint_every": 10,
    }
    args.update({k.replace("__", "."): v for k, v in overrides.items()})
    return flags(args)


@pytest.fixture(scope="session")
def tiny_run_args():
    """The flag builder: tiny_run_args(corpus, data_root, out_dir, steps=30, section__key=value, ...) -> argv."""
    return _tiny_run_args


@pytest.fixture(scope="session")
def record_training_losses():
    """record_training_losses(monkeypatch) patches the training step to record (batch, loss) of each step and
    returns the list it fills."""
    return _record_training_losses


def _record_training_losses(monkeypatch) -> list:
    from minigpt.training.lightning_module import GPTLightningModule

    seen = []
    real = GPTLightningModule.training_step

    def training_step(self, batch, batch_idx):
        loss = real(self, batch, batch_idx)
        seen.append((batch.clone(), loss.item()))
        return loss

    monkeypatch.setattr(GPTLightningModule, "training_step", training_step)
    return seen


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one thread (and a test's subprocesses get the other core): a module opts in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
