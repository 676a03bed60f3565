"""minigpt: a small, readable, fast GPT trainer."""

from minigpt.attention_lab import attention_maps
from minigpt.checkpoint import load_model
from minigpt.config import GPTConfig
from minigpt.errors import ConfigError, UserError
from minigpt.generation import generate
from minigpt.model import GPT, KVCache

__all__ = ["GPT", "attention_maps", "GPTConfig", "ConfigError", "KVCache", "UserError", "generate", "load_model"]
__version__ = "0.1.0"
