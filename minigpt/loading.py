"""load_model: any model a user names -> (model, tokenizer), whatever its format.

A minigpt checkpoint or run directory is read by minigpt.core.checkpoint; a Hugging Face model directory or
hf:ORG/NAME is imported by minigpt.hf.load.  A LoRA run (train.py --finetune lora) holds adapters only: its base is
loaded from where the run found it, checked against the fingerprint the run recorded, and the adapters merged.
The commands, fine-tuning (init_from) and `minigpt.load_model` all come through here.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.checkpoint import (
    DEFAULT_OUT_ROOT,
    checkpoint_model,
    checkpoint_summary,
    find_checkpoint,
    model_config,
    model_state_dict,
    read_checkpoint,
    run_checkpoints,
)
from minigpt.core.compiled import note_once
from minigpt.core.config import ATTENTIONS, Attention
from minigpt.core.devices import resolve_device
from minigpt.core.errors import CheckpointError, UserError, first_line
from minigpt.core.lora import LoRAConfig, adapter_names, checkpoint_lora, fingerprint, lora_model, merge_lora
from minigpt.core.model import GPT
from minigpt.core.quantize import QUANTIZATIONS, Quantization, choose_int8, quantize_model
from minigpt.core.tokenizers import Tokenizer
from minigpt.hf.chat_files import read_chat_template
from minigpt.hf.load import load_hf_model, resolve_hf_source

# one INFO line when minigpt picks the checkpoint (a run directory, or none named): the commands show it on stderr
log = logging.getLogger(__name__)


def is_hf_source(source: str | Path | None) -> bool:
    """hf:ORG/NAME, or a directory with a Hugging Face config.json and no minigpt checkpoint in it."""
    if source is None:
        return False
    if str(source).startswith("hf:"):
        return True
    path = Path(source)
    return path.is_dir() and (path / "config.json").is_file() and not any(p.is_file() for p in run_checkpoints(path))


def load_model(
    source: str | Path | None = None,
    device: str | torch.device = "cpu",
    attention: Attention | None = None,
    quantize: Quantization | None = None,
    generating: tuple[int, int] | None = None,
) -> tuple[GPT, Tokenizer]:
    """A checkpoint file, a run directory, None (the newest run under out/), a Hugging Face model directory or
    hf:ORG/NAME -> (model in eval mode, tokenizer).

    `attention` picks another attention path for the same weights (same outputs; e.g. 'manual' to get the
    attention weights).  `quantize="int8"`: the weights as loaded, then stored as int8 with a scale per row, for
    inference (minigpt.core.quantize): a quarter of the memory, and faster decoding where bandwidth is the limit.
    Where int8 is measured not to decode faster than float32 on this CPU (minigpt.core.quantize.choose_int8,
    once per machine and model shape), the model stays float32 and a one-line note on stderr says so; given
    `generating=(batch, tokens)`, the generation to come, also where quantizing would cost more than it saves.
    A run directory means its best checkpoint (checkpoints/best.ckpt, the lowest validation loss), else its last.
    """
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise UserError(f"quantize: unknown value {quantize!r}; choose one of {', '.join(QUANTIZATIONS)} (or None)")
    if attention is not None and attention not in ATTENTIONS:  # the caller's argument, not the checkpoint's fault
        raise UserError(f"attention: unknown value {attention!r}; choose one of {', '.join(ATTENTIONS)} (or None)")
    device = resolve_device(str(device))  # "auto", and a device this machine lacks as one line
    return _load_model(source, device, attention, quantize, announce=True, generating=generating)


def _load_model(
    source: str | Path | None,
    device: str | torch.device,
    attention: str | None,
    quantize: Quantization | None,
    announce: bool,
    generating: tuple[int, int] | None = None,
) -> tuple[GPT, Tokenizer]:
    if quantize is not None:
        model, tokenizer = _load_model(source, device, attention, None, announce)
        batch, tokens = generating or (1, None)
        choice, measured = choose_int8(model, batch=batch, tokens=tokens)
        if choice == "float32":  # --quantize is a speed flag: it may not slow a command down
            note_once(f"--quantize {quantize} declined: {measured}; running float32")
            return model, tokenizer
        return quantize_model(model, quantize, one_thread=choice == "int8 one thread"), tokenizer
    if is_hf_source(source):
        return load_hf_model(source, device=device, attention=attention)
    path = find_checkpoint(source)
    ckpt = read_checkpoint(path, map_location="cpu")
    if announce:
        say_which(source, path, ckpt)
    if checkpoint_lora(ckpt) is None:
        return checkpoint_model(ckpt, path, device, attention)
    return checkpoint_model(ckpt, path, device, attention, build=lambda c, **o: merge_lora(lora_run_model(c, **o)))


def load_lora_run(source: str | Path | None, device: str | torch.device = "cpu") -> tuple[GPT, Tokenizer, LoRAConfig]:
    """A LoRA run as trained: (its model on its base, adapters not merged, in eval mode; tokenizer; LoRA config)."""
    if is_hf_source(source):  # find_checkpoint would say the folder holds no model, which it does
        raise UserError(
            f"{source} is a Hugging Face model, not a LoRA run; only a run of train.py --finetune lora has adapters "
            f"to export (train.py --init_from {source} --finetune lora trains some)"
        )
    path = find_checkpoint(source)
    ckpt = read_checkpoint(path, map_location="cpu")
    say_which(source, path, ckpt)
    if (lora := checkpoint_lora(ckpt)) is None:
        raise UserError(
            f"{path} is not a LoRA run (it holds a whole model); only a run of train.py --finetune lora "
            "has adapters to export"
        )
    return *checkpoint_model(ckpt, path, device, build=lora_run_model), lora[0]


def say_which(source: str | Path | None, path: Path, ckpt: dict) -> None:
    """Log which checkpoint minigpt picked, where it picked it: a run directory's best (else last) checkpoint, or,
    with no source, the newest run under out/.  A file named by the user is taken as named, without a word."""
    if source is not None and not Path(source).is_dir():
        return
    newest = f"no checkpoint named: the newest run under {DEFAULT_OUT_ROOT}/; " if source is None else ""
    log.info(f"using {path} ({newest}{checkpoint_summary(ckpt, path)})")


def lora_run_model(ckpt: dict, **config_overrides) -> GPT:
    """A LoRA run's model from its checkpoint: the base, read from where the run found it and checked against its
    fingerprint, with the run's adapters (not merged)."""
    cfg, base = checkpoint_lora(ckpt)
    try:  # the base is part of this checkpoint, not a second choice to announce
        model, _ = _load_model(base["source"], "cpu", config_overrides.get("attention"), None, announce=False)
    except UserError as e:
        problem = f"cannot be loaded ({first_line(e, 300)})"
    else:
        found, trained = fingerprint(model), base["fingerprint"]
        problem = None if found == trained else f"changed since (fingerprint {found[:12]}, trained on {trained[:12]})"
    if problem:
        raise CheckpointError(
            f"it is a LoRA run whose base {base['source']} {problem}; put the base it was trained on back there"
        )
    model = lora_model(model, model_config(ckpt, **config_overrides), cfg)
    adapters = model_state_dict(ckpt)
    if set(adapters) != set(adapter_names(model)):
        raise CheckpointError(
            "its adapters do not match its LoRA config; the checkpoint is damaged or from another program"
        )
    model.load_state_dict(adapters, strict=False)
    return model


def load_chat_model(
    source: str | Path | None = None,
    device: str | torch.device = "cpu",
    attention: str | None = None,
    quantize: Quantization | None = None,
) -> tuple[GPT, Tokenizer]:
    """(model, chat tokenizer): a chat run's own, or a Hugging Face model's tokenizer with its chat template."""
    model, tokenizer = load_model(source, device=device, attention=attention, quantize=quantize)
    if not isinstance(tokenizer, ChatTokenizer) and is_hf_source(source):
        model_dir = resolve_hf_source(source)[0]
        template = read_chat_template(model_dir)
        if template is not None:
            tokenizer = ChatTokenizer.for_base(tokenizer, template)
            if tokenizer.added:  # new ids: past the model's embedding (an IndexError at the first turn), or untrained
                raise CheckpointError(
                    f"{model_dir}: its chat template writes {', '.join(map(repr, tokenizer.added))}, which its "
                    "tokenizer lacks: the model has no trained embedding for them; use the model's own "
                    "chat template, or fine-tune it on conversations first (train.py --init_from ... --data.format "
                    "chat gives the markers embeddings)"
                )
    return model, tokenizer
