"""What a run trains for, chosen by its data (--data.format): next-token prediction (text, chat: SFT), DPO
(preference) or GRPO (prompts).  The post-training objectives' settings that cannot work together are refused here,
in one line each, once the command line is parsed."""

from __future__ import annotations

from typing import Any

from minigpt.training.dpo import DPOConfig, DPOLightningModule
from minigpt.training.grpo import GRPOConfig, GRPOLightningModule
from minigpt.training.lightning_module import GPTLightningModule

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
