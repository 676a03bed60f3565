"""minigpt: a small, readable, fast GPT trainer.

    from minigpt import GPT, GPTConfig, load_model, generate
    model, tokenizer = minigpt.load_chat_model("out/sft_addition")  # a chat run, or a HF model with a chat template
    minigpt.chat(model, tokenizer, "What is 2 + 2?")                 # one reply; ChatSession for several turns

The package is layered (each imports only those before it): core (config, model, generation, tokenizers, the
checkpoint format), then data, hf (Hugging Face interop), lab (the attention lab) and evaluation (loss, lm-eval),
then loading (load_model, load_chat_model) and export (one module per format), training (Lightning), serve (the
OpenAI-compatible server) and cli (the commands and their exit codes).
"""

from minigpt.core.chat import ChatSession, chat
from minigpt.core.config import GPTConfig
from minigpt.core.errors import ConfigError, UserError
from minigpt.core.generation import generate
from minigpt.core.model import GPT, KVCache
from minigpt.lab.capture import attention_maps  # numpy and torch only: ~2 ms on top of the rest
from minigpt.loading import load_chat_model, load_model

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
__version__ = "0.1.0"
