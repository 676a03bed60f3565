"""DPO on a GPU in bf16-mixed (docs/dpo.md): each reference mode, full and LoRA, starts at log 2 (the reference is
the start, in the run's precision) and trains to a finite loss whose margins move.  Skipped without CUDA
(tests/training/test_dpo.py runs the same paths in float32 on the CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from minigpt.cli.train import main as train_main
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.config import GPTConfig
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer
from support import scalars

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--dpo.reference", "precomputed"],
        ["--finetune", "lora", "--lora.rank", "4"],
        ["--finetune", "lora", "--lora.rank", "4", "--lora.base_dtype", "bfloat16"],
    ],
    ids=["full-copy", "full-precomputed", "lora", "lora-bf16-base"],
)
def test_dpo_trains_in_bf16_on_a_gpu(extra, tmp_path):
    torch.manual_seed(0)
    base = GPT(GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=64, vocab_size=256))
    save_file(model_checkpoint(base, ByteTokenizer()), tmp_path / "base.ckpt")
    rows = [{"prompt": f"{a}+{a + 1}=", "chosen": str(2 * a + 1), "rejected": str(2 * a)} for a in range(40)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--init_from", str(tmp_path / "base.ckpt"), "--data.format", "preference"]
    argv += ["--data.source", str(tmp_path / "pairs.jsonl"), "--data.data_root", str(tmp_path / "data")]
    argv += ["--out_dir", str(tmp_path / "run"), "--data.batch_size", "8", "--data.val_batches", "1"]
    argv += ["--trainer.max_steps", "10", "--trainer.val_check_interval", "10", "--trainer.log_every_n_steps", "1"]
    argv += ["--trainer.precision", "bf16-mixed", "--trainer.accelerator", "gpu", "--sample_tokens", "0"]
    argv += ["--optim.learning_rate", "0.01", "--optim.warmup_steps", "0", "--trainer.enable_progress_bar", "false"]
    train_main(argv + extra)
    logged = scalars(tmp_path / "run")
    loss = logged["train_loss"]
    margins = logged["rewards/margins"]
    assert loss[0] == pytest.approx(0.693147, abs=1e-3) and all(map(lambda v: v == v and abs(v) < 1e3, loss))
    assert margins[-1] != 0.0
