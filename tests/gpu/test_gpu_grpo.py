"""GRPO on a GPU in bf16-mixed (docs/grpo.md): full (a frozen copy as the KL's reference) and LoRA (adapters off),
the completions sampled under autocast with a bf16 KV cache; a finite loss, a KL that moves off 0, pass@k logged.
Skipped without CUDA (tests/training/test_grpo.py runs the same paths on the CPU, bf16-mixed included)."""

from __future__ import annotations

import json
import math

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
    [[], ["--finetune", "lora", "--lora.rank", "4"], ["--model.attention", "manual"]],
    ids=["full", "lora", "manual"],
)
def test_grpo_trains_in_bf16_on_a_gpu(extra, tmp_path):
    torch.manual_seed(0)
    base = GPT(GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=64, vocab_size=256))
    save_file(model_checkpoint(base, ByteTokenizer()), tmp_path / "base.ckpt")
    rows = [{"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(40)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(
        "def digits(prompt, completion, answer):\n"
        "    return sum(c.isdigit() for c in completion) / max(1, len(completion))\n"
    )
    argv = ["--init_from", str(tmp_path / "base.ckpt"), "--data.format", "prompts"]
    argv += ["--data.source", str(tmp_path / "prompts.jsonl"), "--data.data_root", str(tmp_path / "data")]
    argv += ["--out_dir", str(tmp_path / "run"), "--data.batch_size", "4", "--data.val_batches", "1"]
    argv += ["--grpo.group_size", "4", "--grpo.max_new_tokens", "12", "--grpo.beta", "0.05"]
    argv += ["--grpo.reward", f"{tmp_path / 'rewards.py'}:digits"]
    argv += ["--trainer.max_steps", "10", "--trainer.val_check_interval", "10", "--trainer.log_every_n_steps", "1"]
    argv += ["--trainer.precision", "bf16-mixed", "--trainer.accelerator", "gpu", "--sample_tokens", "0"]
    argv += ["--optim.learning_rate", "0.01", "--optim.warmup_steps", "0", "--trainer.enable_progress_bar", "false"]
    train_main(argv + extra)
    logged = scalars(tmp_path / "run")
    assert all(math.isfinite(v) for v in logged["train_loss"])
    assert logged["kl"][0] == pytest.approx(0.0, abs=1e-3) and logged["kl"][-1] > 0
    assert len(logged["val_pass@1"]) >= 1 and len(logged["completions/mean_length"]) == 10
