"""train.py's settings that are read only beside another one: a flag typed for one while the other is off changes
nothing, and one `note:` line says so.  Not refused: a sweep may toggle the switch (--finetune, --compile) and keep
the flags it reads.  A --config file's settings are not noted: a recipe may hold one for when it is switched on
(the GPU recipe's compile_mode, run with --compile false for a comparison)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lightning.pytorch.utilities import rank_zero_only

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


def unread_flags(args: Sequence[str], config: Any) -> Iterator[str]:
    """What is said of each flag in `args` that `config` (the parsed settings) does not read."""
    for key, _ in flag_values(args):
        for name, (reads, needs) in READ_ONLY_WITH.items():
            if (key == name or (name.endswith(".") and key.startswith(name))) and not reads(config):
                yield f"--{key} is read only with {needs}: it does nothing in this run"


@rank_zero_only
def note_unread_flags(args: Sequence[str], config: Any) -> None:
    for note in dict.fromkeys(unread_flags(args, config)):  # a flag given twice: said once
        print(f"note: {note}", file=sys.stderr, flush=True)
