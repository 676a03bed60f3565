"""train.py's settings that are read only beside another one: a flag typed for one while the other is off would
change nothing, so it is refused, naming what reads it.  A --config file's are not refused: a recipe may hold a
setting for when it is switched on (the GPU recipe's compile_mode, run with --compile false for a comparison)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from minigpt.cli.parsing import flag_values

# flag (or section, ending in ".") -> (whether the config reads it, the setting that makes it read)
READ_ONLY_WITH: dict[str, tuple[Callable[[Any], bool], str]] = {
    "compile_mode": (lambda c: c["compile"], "--compile"),
    "compile_regions": (lambda c: c["compile"], "--compile"),
    "lora.": (lambda c: c["finetune"] == "lora", "--finetune lora"),
    "dpo.": (lambda c: c["data"]["format"] == "preference", "--data.format preference"),
    "grpo.": (lambda c: c["data"]["format"] == "prompts", "--data.format prompts"),
    "optim.muon_ns_steps": (lambda c: c["optim"]["optimizer"] == "muon", "--optim.optimizer muon"),
    "optim.cooldown_fraction": (lambda c: c["optim"]["lr_schedule"] == "wsd", "--optim.lr_schedule wsd"),
    "early_stopping.min_delta": (lambda c: c["early_stopping"]["patience"] is not None, "--early_stopping.patience N"),
    "eval_limit": (lambda c: c["eval_tasks"], "--eval_tasks"),
}


def unread_flag(args: Sequence[str], config: Any) -> str | None:
    """The refusal of the first flag in `args` that `config` (the parsed settings) would not read, or None."""
    for key, _ in flag_values(args):
        for name, (reads, needs) in READ_ONLY_WITH.items():
            if (key == name or (name.endswith(".") and key.startswith(name))) and not reads(config):
                return f"--{key} is read only with {needs}; add {needs}, or drop --{key}"
    return None
