"""DPO's and GRPO's metrics under two DDP processes on the CPU: each is over every rank's batches, and a validation
reports what one process reports on the same weights (the ranks' means of unequal shares were averaged, and GRPO's
validation sampled rank r's batches with the seeds of other batches)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minigpt.cli.train import parse
from minigpt.core.checkpoint import model_checkpoint, read_checkpoint, save_file
from minigpt.core.config import GPTConfig
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.training.datamodule import RandomPairs
from support import flags, scalars

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]  # the repository root
DDP = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
PAIRS = [{"prompt": f"{a}+{a + 1}=", "chosen": str(2 * a + 1), "rejected": str(2 * a)} for a in range(40)]
PROMPTS = [{"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(40)]
DIGITS = "def digits(prompt, completion, answer):\n    return float(sum(c.isdigit() for c in completion))\n"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    torch.manual_seed(0)
    base = GPT(GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=48, vocab_size=256))
    save_file(model_checkpoint(base, ByteTokenizer()), root / "base.ckpt")
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    (root / "rewards.py").write_text(DIGITS)
    return root


def run_args(root, out, **extra):
    """10 validation rows in batches of 4: 3 batches, 2 on rank 0 and 1 on rank 1, the last of 2 rows."""
    args = {
        "init_from": root / "base.ckpt",
        "data.data_root": root / "data",
        "out_dir": root / out,
        "data.batch_size": 2,
        "data.val_batch_size": 4,
        "data.val_batches": 5,
        "data.val_fraction": 0.25,
        "trainer.max_steps": 2,
        "trainer.val_check_interval": 2,
        "trainer.log_every_n_steps": 1,
        "trainer.enable_progress_bar": False,
        "sample_tokens": 0,
        "optim.warmup_steps": 0,
        "optim.learning_rate": 0.01,
        **extra,
    }
    return flags(args)


def train_ddp(args):
    result = subprocess.run(
        [sys.executable, "train.py", *args, *DDP], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]


def one_process(args, scratch):
    """The run as train.py builds it in one process (no logger)."""
    return parse(args + ["--out_dir", str(scratch), "--trainer.logger", "false", "--trainer.devices", "1"])


def validate_in_one_process(args, run, scratch) -> dict[str, float]:
    cli = one_process(args, scratch)
    cli.model.load_state_dict(read_checkpoint(run / "checkpoints" / "last.ckpt")["state_dict"])
    return cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)[0]


def test_dpo_metrics_are_over_every_ranks_pairs(root, tmp_path):
    args = run_args(root, "dpo", **{"data.format": "preference", "data.source": root / "pairs.jsonl"})
    train_ddp(args)
    logged = scalars(root / "dpo")
    for tag, value in validate_in_one_process(args, root / "dpo", tmp_path / "one").items():
        assert logged[tag][-1] == pytest.approx(value, abs=1e-5), tag
    # the first step: the policy is the reference, so the log-probs are the base's on both ranks' first batches
    cli = one_process(args, tmp_path / "first")
    data = cli.datamodule
    data.prepare_data()
    with torch.no_grad():
        for rank in (0, 1):
            cli.model.batch_loss(RandomPairs(data.prepared.train, 2, 1337, stream=rank, length=1)[0], "train")
    expected = cli.model.pop_metrics()
    assert logged["logps/chosen"][0] == pytest.approx(expected["logps/chosen"].item(), abs=1e-4)
    assert logged["logps/rejected"][0] == pytest.approx(expected["logps/rejected"].item(), abs=1e-4)


def test_grpo_validation_samples_each_batch_as_one_process_does(root, tmp_path):
    extra = {
        "data.format": "prompts",
        "data.source": root / "prompts.jsonl",
        "grpo.group_size": 4,
        "grpo.max_new_tokens": 6,
        "grpo.reward": f"{root / 'rewards.py'}:digits",
    }
    args = run_args(root, "grpo", **extra)
    train_ddp(args)
    logged = scalars(root / "grpo")
    found = validate_in_one_process(args, root / "grpo", tmp_path / "one")
    assert 0 < found["val_reward"]  # the digits reward tells the samples apart
    for tag, value in found.items():
        assert logged[tag][-1] == pytest.approx(value, abs=1e-5), tag
