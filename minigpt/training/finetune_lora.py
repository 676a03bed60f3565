"""--finetune lora: train low-rank adapters (minigpt.core.lora) on a frozen base, the init_from source.

The run's model is the base's own tensors (shared, never copied; the blocks' weights in lora.base_dtype) with
adapters beside them.  Its checkpoints hold only what it trains, the adapters and a grown vocabulary's new rows, with
their optimizer state, and where the base is with its fingerprint (minigpt.core.lora.SECTION_KEY): a checkpoint of
a 1B run is megabytes, and load_model rebuilds the base from there and merges.  --resume reads the base again and
refuses another one (or a LoRA run resumed as a full one, or the reverse), before anything is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.nn as nn

from minigpt.core.checkpoint import SECTION, find_checkpoint
from minigpt.core.config import GPTConfig
from minigpt.core.errors import UserError
from minigpt.core.lora import SECTION_KEY, LoRAConfig, adapter_names, checkpoint_lora, fingerprint, lora_model
from minigpt.core.model import GPT
from minigpt.loading import is_hf_source
from minigpt.training.init_from import load_source

CHANGEABLE = ("dropout",)  # what a resumed LoRA run may set differently (the rest shapes what was trained)


def base_location(source: str) -> str:
    """Where a LoRA run finds its base again: hf:ORG/NAME as given, a local model as an absolute path (a run
    directory as the checkpoint file it holds now: the run may write a better one later)."""
    if str(source).startswith("hf:"):
        return str(source)
    path = Path(source) if is_hf_source(source) else find_checkpoint(source)
    return str(path.resolve())


def load_base(source: str) -> GPT:
    return load_source(source)[0]


def check_finetune_resumable(ckpt: dict[str, Any], lora: LoRAConfig | None, path: Path) -> None:
    """A LoRA run resumes as one, with the adapters' shapes and scale it was trained with; a full run as a full one."""
    saved = checkpoint_lora(ckpt)
    problem = None
    if saved is None and lora is not None:
        problem = (
            f"{path} is a full fine-tuning run (its checkpoint holds the whole model); resume it without "
            "--finetune lora, or start a LoRA run in another out_dir"
        )
    elif saved is not None and lora is None:
        problem = (
            f"{path} is a LoRA run (its checkpoint holds adapters for the base {saved[1]['source']}); resume "
            "it with --finetune lora, or start a new run in another out_dir"
        )
    elif saved is not None:
        # an unset base_dtype keeps the base as loaded, float32: naming it changes nothing
        old, new = ({**c.to_dict(), "base_dtype": c.base_dtype or "float32"} for c in (saved[0], lora))
        diff = [
            f"lora.{k}={old[k]!r} (this run's config gives {new[k]!r})"
            for k in old
            if k not in CHANGEABLE and old[k] != new.get(k)
        ]
        if diff:
            problem = (
                f"{path} was trained with " + ", ".join(diff) + "; remove the conflicting lora settings to "
                "resume, or start a new run in another out_dir"
            )
    if problem:
        raise UserError(problem)


def check_same_base(ckpt: dict[str, Any], base: GPT, source: str, path: Path) -> str:
    """The base a resumed LoRA run reads must be the one it was trained on (its fingerprint); returns it."""
    saved = checkpoint_lora(ckpt)[1]
    found = fingerprint(base)
    if found != saved["fingerprint"]:
        here = base_location(source) == saved["source"]
        raise UserError(
            f"{path} was trained on the base {saved['source']} (fingerprint {saved['fingerprint'][:12]}), which "
            f"changed since (fingerprint {found[:12]}); put the base it was trained on back there, or start a new "
            "run in another out_dir"
            if here
            else f"{path} was trained on the base {saved['source']} (fingerprint {saved['fingerprint'][:12]}), "
            f"and init_from {source} is another model (fingerprint {found[:12]}); resume with --init_from "
            f"{saved['source']}, or start a new run in another out_dir"
        )
    return found


def lora_run_model(
    source: str,
    base: GPT,
    config: GPTConfig,
    lora: LoRAConfig,
    resumed: dict[str, Any] | None = None,
    last: Path | None = None,
) -> tuple[GPT, dict[str, Any]]:
    """The LoRA model a run of `config` trains on `base` (init_from's model), and the checkpoint entry naming the
    base.  The caller drops its own reference to `base` next, so a cast base_dtype frees the float32 weights.
    A new run's targets must be projections the model has (a resumed one keeps those it was trained with)."""
    if resumed is None:
        lora.check_targets(config)
    found = check_same_base(resumed, base, source, last) if resumed is not None else fingerprint(base)
    entry = {"config": lora.to_dict(), "base": {"source": base_location(source), "fingerprint": found}}
    return lora_model(base, config, lora), entry


# ------------------------------------------------------------------------------------------------- checkpoints


def keep_trained(ckpt: dict[str, Any], module: nn.Module, entry: dict[str, Any]) -> None:
    """on_save_checkpoint: drop the frozen base from Lightning's state_dict and name it in minigpt's section."""
    trained = set(adapter_names(module))
    ckpt["state_dict"] = {k: v for k, v in ckpt["state_dict"].items() if k in trained}
    ckpt[SECTION][SECTION_KEY] = entry


def restore_frozen(ckpt: dict[str, Any], module: nn.Module) -> None:
    """on_load_checkpoint: give Lightning's strict load the frozen tensors the file leaves out (the live ones)."""
    trained = set(adapter_names(module))
    frozen = {k: v for k, v in module.state_dict().items() if k not in trained}
    ckpt["state_dict"] = {**frozen, **ckpt["state_dict"]}
