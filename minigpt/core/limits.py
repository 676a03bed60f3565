"""How big a model config may be: checked before anything is built from a config minigpt did not choose.

    check_config_size(config, "its config.json", CheckpointError)   # raises one line, or returns

Two checks, both on the config alone (a model on the meta device: nothing allocated):
- each field against a plausible bound (CONFIG_LIMITS): a crafted n_layer=10**7 would build for minutes;
- the memory the whole config implies (float32 weights and the RoPE tables, block_size x head_dim each) against
  this machine's memory.  Fields that each look plausible can still multiply to terabytes (head_dim 65536 with a
  2^21 context: 1.1 TB of RoPE tables), which the allocator would meet long after the command started.

A user who really means it raises the memory bound with MINIGPT_MAX_MODEL_GB (e.g. on a machine with swap).
"""

from __future__ import annotations

import os

import torch

from minigpt.core.config import GPTConfig
from minigpt.core.errors import UserError

__all__ = ["CONFIG_LIMITS", "MAX_MODEL_GB_ENV", "check_config_size", "implied_bytes", "memory_limit"]

# Generous enough for any model that fits in memory (e.g. 128k contexts, 256k vocabularies).
CONFIG_LIMITS = {"n_layer": 1024, "n_head": 1024, "n_embd": 65536, "block_size": 1 << 21, "vocab_size": 1 << 22,
                 "mlp_hidden": 1 << 20}
MAX_MODEL_GB_ENV = "MINIGPT_MAX_MODEL_GB"
FLOAT32_BYTES = 4


def implied_bytes(config: GPTConfig) -> dict[str, int]:
    """Bytes the model of `config` holds once built in float32: its weights and, for RoPE, the cos/sin tables."""
    from minigpt.core.model import GPT

    with torch.device("meta"):
        model = GPT(config)
    parts = {"weights": FLOAT32_BYTES * sum(p.numel() for p in model.parameters())}
    buffers = sum(b.numel() for _, b in model.named_buffers(remove_duplicate=False))  # cos and sin: one
    # tensor on the meta device, two once built
    if buffers:
        parts["RoPE tables"] = FLOAT32_BYTES * buffers
    return parts


def memory_limit() -> tuple[int, str]:
    """(bytes, what they are): MINIGPT_MAX_MODEL_GB when set, else this machine's physical memory."""
    if (setting := os.environ.get(MAX_MODEL_GB_ENV)) is not None:
        try:
            gb = float(setting)
        except ValueError:
            raise UserError(f"{MAX_MODEL_GB_ENV}={setting!r} is not a number of gigabytes; set it to e.g. 64, or "
                            "unset it to use this machine's memory as the bound") from None
        return int(gb * 1e9), f"{MAX_MODEL_GB_ENV}={setting}"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: no bound but the per-field ones
        return 1 << 62, "no memory bound"
    return total, "this machine's memory"


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def check_config_size(config: GPTConfig, what: str, error: type[UserError] = UserError,
                      cause: str = "the config is damaged or crafted") -> None:
    """Refuse (one line, `error`) a config over a per-field bound or implying more memory than memory_limit()."""
    for name, limit in CONFIG_LIMITS.items():
        if getattr(config, name) > limit:
            raise error(f"{what} says {name}={getattr(config, name)}, over the plausible limit {limit}; {cause}")
    parts = implied_bytes(config)
    total = sum(parts.values())
    limit, bound = memory_limit()
    if total > limit:
        shown = ", ".join(f"{name} {gb(n)}" for name, n in parts.items())
        raise error(f"{what} implies a model of {gb(total)} ({shown}), more than {bound} ({gb(limit)}); {cause}, "
                    f"or set {MAX_MODEL_GB_ENV}=GB to build it anyway")
