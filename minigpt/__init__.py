"""minigpt: a small, readable, fast GPT trainer.

    from minigpt import GPT, GPTConfig, load_model, generate
    model, tokenizer = minigpt.load_chat_model("out/sft_addition")  # a chat run, or a HF model with a chat template
    minigpt.chat(model, tokenizer, "What is 2 + 2?")                 # one reply; ChatSession for several turns

The package is layered (each imports only those before it): core (config, model, generation, tokenizers, the
checkpoint format), then data, hf (Hugging Face interop), lab (the attention lab) and evaluation (loss, lm-eval),
then loading (load_model, load_chat_model) and export (one module per format), training (Lightning), serve (the
OpenAI-compatible server) and cli (the commands and their exit codes).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# nothing heavy: the bytecode cache and the start-up clock, before torch loads; and the version
from minigpt.core import __version__  # noqa: F401

# the facade: each name -> the module it lives in, imported on first use, so `python train.py` (whose first import
# is minigpt.cli.main) reaches its Ctrl-C handling before torch loads, and `minigpt --version` loads no torch
FACADE = {
    "ChatSession": "minigpt.core.chat",
    "chat": "minigpt.core.chat",
    "GPTConfig": "minigpt.core.config",
    "ConfigError": "minigpt.core.errors",
    "UserError": "minigpt.core.errors",
    "generate": "minigpt.core.generation",
    "GPT": "minigpt.core.model",
    "KVCache": "minigpt.core.model",
    "attention_maps": "minigpt.lab.capture",
    "load_chat_model": "minigpt.loading",
    "load_model": "minigpt.loading",
}
__all__ = [
    "GPT",
    "attention_maps",
    "ChatSession",
    "GPTConfig",
    "ConfigError",
    "KVCache",
    "UserError",
    "chat",
    "generate",
    "load_chat_model",
    "load_model",
]

if TYPE_CHECKING:  # what editors and type checkers read
    from minigpt.core.chat import ChatSession, chat
    from minigpt.core.config import GPTConfig
    from minigpt.core.errors import ConfigError, UserError
    from minigpt.core.generation import generate
    from minigpt.core.model import GPT, KVCache
    from minigpt.lab.capture import attention_maps
    from minigpt.loading import load_chat_model, load_model


def __getattr__(name: str) -> object:
    if name not in FACADE:
        raise AttributeError(f"module 'minigpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(FACADE[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *FACADE})
