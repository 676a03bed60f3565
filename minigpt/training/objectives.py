"""What a run trains for, chosen by its data (--data.format): next-token prediction (text, chat: SFT), DPO
(preference) or GRPO (prompts).  The post-training objectives' settings that cannot work together are refused here,
in one line each, once the command line is parsed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from minigpt.core.checkpoint import read_checkpoint
from minigpt.evaluation.loss import bits_per_char_and_byte, evaluate_tokens
from minigpt.training.datamodule import TokenDataModule
from minigpt.training.dpo import DPOConfig, DPOLightningModule, dpo_val_loss
from minigpt.training.grpo import GRPOConfig, GRPOLightningModule, grpo_val_pass
from minigpt.training.lightning_module import GPTLightningModule
from minigpt.training.sft import chat_loss

SOURCES = "(a .ckpt, a run directory, a Hugging Face model directory or hf:ORG/NAME)"


def objective_problem(config: dict[str, Any]) -> str | None:
    """The refusal of a post-training run's settings, or None."""
    data_format = config["data"]["format"]
    own_rows = config["finetune"] == "lora" and config["lora"]["train_embeddings"]
    if data_format == "preference":
        if not config.get("init_from"):
            return (
                "--data.format preference (DPO) tunes a model against itself as it starts: name it with "
                f"--init_from {SOURCES}"
            )
        if own_rows and config["dpo"]["reference"] == "model":
            return (
                "dpo.reference model with lora.train_embeddings: the base's own embedding rows train, so the "
                "model with its adapters off is no longer the starting model; set --dpo.reference precomputed"
            )
    if data_format == "prompts":
        if not config.get("init_from"):
            return (
                "--data.format prompts (GRPO) samples answers from a model and rewards the good ones: name it with "
                f"--init_from {SOURCES}"
            )
        if own_rows and config["grpo"]["beta"] > 0:
            return (
                "grpo.beta > 0 with lora.train_embeddings: the base's own embedding rows train, so the model with "
                "its adapters off is no longer the starting model (the KL's reference); set --grpo.beta 0 or "
                "--lora.train_embeddings false"
            )
    return None


def objective(config: dict[str, Any]) -> tuple[type[GPTLightningModule], dict[str, Any]]:
    """The LightningModule class of the run's objective and its settings (DPOConfig / GRPOConfig) by keyword."""
    if config["data"]["format"] == "preference":
        return DPOLightningModule, {"dpo": DPOConfig(**config["dpo"])}
    if config["data"]["format"] == "prompts":
        return GRPOLightningModule, {"grpo": GRPOConfig(**config["grpo"])}
    return GPTLightningModule, {}


def full_split_loss(module: Any, data: TokenDataModule) -> tuple[float, int, str, str, dict[str, float]]:
    """The objective's loss over the whole validation split, as train.py reports it at the end: (nats in all, the
    count they are over, its unit, what the report adds after the loss, metrics of its own: GRPO's pass rates)."""
    val, batch_size = data.prepared.val, data.val_batch_size
    with torch.compiler.set_stance("force_eager"):  # a ragged last batch would trigger a recompile
        if data.hparams.format == "prompts":  # GRPO: pass@1 / pass@G of every held-out prompt
            found = grpo_val_pass(module, val, batch_size)
            per_text = f", pass@1 {found['pass@1']:.4f}, pass@G {found['pass@G']:.4f} (G = {module.grpo.group_size})"
            return (1.0 - found["pass@1"]) * len(val), len(val), "prompts", per_text, found  # the share wrong
        if data.hparams.format == "preference":  # DPO's loss over every validation pair
            loss, n = dpo_val_loss(module, val, batch_size)
            return loss * n, n, "pairs", "", {}
        if data.hparams.format == "chat":  # the assistant's tokens of every conversation (padded: no running text)
            return *chat_loss(module.model, val, batch_size), "tokens", "", {}
        nats, n = evaluate_tokens(module.model, val, batch_size)
        per_char, per_byte = bits_per_char_and_byte(nats, data.prepared.tokenizer, val)
        return nats, n, "tokens", f", {per_char:.4f} bits/char, {per_byte:.4f} bits/byte", {}


def split_report(nats: float, n: int, unit: str, per_text: str, start: float) -> str:
    """How train.py reports a full split's loss: the loss, what it is over, and the seconds since `start`."""
    unit = unit if n != 1 else unit.removesuffix("s")  # "over all 1 validation pair"
    return f"{nats / n:.4f} over all {n:,} validation {unit}{per_text} ({time.perf_counter() - start:.1f}s to evaluate)"


def checkpoint_split_loss(module: Any, data: TokenDataModule, path: Path) -> str:
    """The split_report of a checkpoint's weights in place of the module's (the best checkpoint, when a run ended
    above its best), the module's own weights put back afterwards.  The run's own checkpoint: where it leaves tensors
    out (a LoRA run's frozen base), the module's are those tensors, unchanged by training."""
    # on the CPU: a Lightning checkpoint holds the optimizer's state too, and the device may be near full
    start, weights = time.perf_counter(), read_checkpoint(path)["state_dict"]
    final = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items() if k in weights}
    try:  # a load that failed half-way would leave a mix: the final weights go back whatever happens
        module.load_state_dict(weights, strict=False)
        nats, n, unit, per_text, _ = full_split_loss(module, data)
    finally:
        module.load_state_dict(final, strict=False)
    return split_report(nats, n, unit, per_text, start)
