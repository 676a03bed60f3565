"""load_model: any model a user names -> (model, tokenizer), whatever its format.

A minigpt checkpoint or run directory is read by minigpt.core.checkpoint; a Hugging Face model directory or
hf:ORG/NAME is imported by minigpt.hf.load.  The commands, fine-tuning (init_from) and `minigpt.load_model` all
come through here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.checkpoint import load_checkpoint, run_checkpoints
from minigpt.core.model import GPT
from minigpt.core.tokenizers import Tokenizer
from minigpt.hf.chat_files import read_chat_template
from minigpt.hf.load import load_hf_model, resolve_hf_source


def is_hf_source(source: str | Path | None) -> bool:
    """hf:ORG/NAME, or a directory with a Hugging Face config.json and no minigpt checkpoint in it."""
    if source is None:
        return False
    if str(source).startswith("hf:"):
        return True
    path = Path(source)
    return path.is_dir() and (path / "config.json").is_file() and not any(p.is_file() for p in run_checkpoints(path))


def load_model(source: str | Path | None = None, device: str | torch.device = "cpu",
               attention: str | None = None) -> tuple[GPT, Tokenizer]:
    """A checkpoint file, a run directory, None (the newest run under out/), a Hugging Face model directory or
    hf:ORG/NAME -> (model in eval mode, tokenizer).

    `attention` picks another attention path for the same weights (same outputs; e.g. 'manual' to get the
    attention weights).
    """
    if is_hf_source(source):
        return load_hf_model(source, device=device, attention=attention)
    return load_checkpoint(source, device=device, attention=attention)


def load_chat_model(source: str | Path | None = None, device: str | torch.device = "cpu",
                    attention: str | None = None) -> tuple[GPT, Tokenizer]:
    """(model, chat tokenizer): a chat run's own, or a Hugging Face model's tokenizer with its chat template."""
    model, tokenizer = load_model(source, device=device, attention=attention)
    if not isinstance(tokenizer, ChatTokenizer) and is_hf_source(source):
        template = read_chat_template(resolve_hf_source(source)[0])
        if template is not None:
            tokenizer = ChatTokenizer.for_base(tokenizer, template)
    return model, tokenizer
