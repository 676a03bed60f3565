"""minigpt: a small, readable, fast GPT trainer."""

from minigpt.config import ConfigError, GPTConfig
from minigpt.model import GPT, KVCache

__all__ = ["GPT", "GPTConfig", "ConfigError", "KVCache"]
__version__ = "0.1.0"
