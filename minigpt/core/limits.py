"""How big a model config may be: checked before anything is built from a config minigpt did not choose.

    skeleton = check_config_size(config, "its config.json", CheckpointError)   # raises one line, or returns
    model = GPT.from_weights(config, weights, skeleton)   # the meta model it measured, filled: one build a load

Two checks, both on the config alone (a model on the meta device: nothing allocated):
- each field against a plausible bound (CONFIG_LIMITS): a crafted n_layer=10**7 would build for minutes;
- the memory the whole config implies (float32 weights and the RoPE tables, block_size x head_dim each) against
  this machine's memory.  Fields that each look plausible can still multiply to terabytes (head_dim 65536 with a
  2^21 context: 1.1 TB of RoPE tables), which the allocator would meet long after the command started.

Sampling is bounded the same way, from the sizes alone, before anything is allocated (check_sampling_size): a
batch of sequences needs its prefill's logits and activations, its KV cache and its token buffer, which grow with
the number of samples; --num_samples 10**6 would otherwise meet the allocator minutes later.

A user who really means it raises the memory bound with MINIGPT_MAX_MODEL_GB (e.g. on a machine with swap).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from minigpt.core.config import GPTConfig
from minigpt.core.errors import UserError

if TYPE_CHECKING:
    from minigpt.core.model import GPT

__all__ = [
    "CONFIG_LIMITS",
    "MAX_MODEL_GB_ENV",
    "check_config_size",
    "implied_bytes",
    "memory_limit",
    "meta_model",
    "state_shapes",
    "sampling_bytes",
    "check_sampling_size",
]

# Generous enough for any model that fits in memory (e.g. 128k contexts, 256k vocabularies).
CONFIG_LIMITS = {
    "n_layer": 1024,
    "n_head": 1024,
    "n_embd": 65536,
    "block_size": 1 << 21,
    "vocab_size": 1 << 22,
    "mlp_hidden": 1 << 20,
}
MAX_MODEL_GB_ENV = "MINIGPT_MAX_MODEL_GB"
FLOAT32_BYTES = 4


def meta_model(config: GPTConfig) -> GPT:
    """The model of `config` on the meta device: shapes only, nothing allocated or initialised."""
    from minigpt.core.model import GPT  # the model imports nothing from here; imported late all the same

    with torch.device("meta"):
        return GPT(config)


def state_shapes(model: GPT) -> dict[str, torch.Size]:
    """Its state_dict's names and shapes (GPT.state_shapes, from a model already built)."""
    return {name: t.shape for name, t in model.state_dict().items()}


def implied_bytes(config: GPTConfig, model: GPT | None = None) -> dict[str, int]:
    """Bytes the model of `config` holds once built in float32: its weights and, for RoPE, the cos/sin tables.
    model: its meta_model, when the caller has built it already."""
    if model is None:
        model = meta_model(config)
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
            raise UserError(
                f"{MAX_MODEL_GB_ENV}={setting!r} is not a number of gigabytes; set it to e.g. 64, or "
                "unset it to use this machine's memory as the bound"
            ) from None
        return int(gb * 1e9), f"{MAX_MODEL_GB_ENV}={setting}"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: no bound but the per-field ones
        return 1 << 62, "no memory bound"
    return total, "this machine's memory"


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def check_config_size(
    config: GPTConfig, what: str, error: type[UserError] = UserError, cause: str = "the config is damaged or crafted"
) -> GPT:
    """Refuse (one line, `error`) a config over a per-field bound or implying more memory than memory_limit().
    Returns the meta_model it measured: a load checks its shapes against it and fills it (GPT.from_weights's
    skeleton) rather than building the model again."""
    if over := next((name for name, limit in CONFIG_LIMITS.items() if getattr(config, name) > limit), None):
        # refused before any build: the oversized config would build on the meta device for minutes
        raise error(
            f"{what} says {over}={getattr(config, over)}, over the plausible limit {CONFIG_LIMITS[over]}; {cause}"
        )
    model = meta_model(config)
    if (problem := memory_problem(config, model, what, cause)) is not None:
        raise error(problem)
    return model


def memory_problem(config: GPTConfig, model: GPT, what: str, cause: str) -> str | None:
    """The memory the whole config implies (model: its meta_model), if that is over the limit."""
    parts = implied_bytes(config, model)
    total = sum(parts.values())
    limit, bound = memory_limit()
    if total > limit:
        shown = ", ".join(f"{name} {gb(n)}" for name, n in parts.items())
        return (
            f"{what} implies a model of {gb(total)} ({shown}), more than {bound} ({gb(limit)}); {cause}, "
            f"or set {MAX_MODEL_GB_ENV}=GB to build it anyway"
        )
    return None


def sampling_bytes(
    config: GPTConfig, batch: int, prompt_tokens: int, new_tokens: int, kv_cache: bool = True
) -> dict[str, int]:
    """Bytes a generation of `batch` sequences needs beyond the weights (float32, an upper bound): the longest
    forward pass (the prefill, or each step without the cache: block_size tokens at most) holds the logits of every
    position, the hidden activations and, on the manual paths, the attention scores; the cache holds keys and
    values of every layer for the positions written; the token buffer holds prompt and new tokens; sampling sorts
    the vocabulary."""
    T = max(1, min(prompt_tokens if kv_cache else prompt_tokens + new_tokens, config.block_size))
    width = 4 * config.n_embd + 3 * (config.mlp_hidden or 4 * config.n_embd)  # residual, q/k/v/out, the MLP's
    # the cache grows with the positions written, doubling, up to block_size (minigpt.core.kv_cache); a sliding
    # layer's up to its window
    cached = min(config.block_size, 2 * (prompt_tokens + new_tokens)) if kv_cache else 0
    cached_positions = sum(min(cached, config.layer_window(i) or cached) for i in range(config.n_layer))
    return {
        "logits": FLOAT32_BYTES * batch * T * config.vocab_size,
        "activations": FLOAT32_BYTES * batch * T * width + FLOAT32_BYTES * batch * config.n_head * T * T,
        "KV cache": FLOAT32_BYTES * 2 * batch * config.n_kv_head * cached_positions * config.head_dim,
        "tokens": 8 * batch * (prompt_tokens + new_tokens),
        "sampling": 5 * 8 * batch * config.vocab_size,
    }


def check_sampling_size(
    config: GPTConfig,
    batch: int,
    prompt_tokens: int,
    new_tokens: int,
    kv_cache: bool = True,
    model: GPT | None = None,
) -> None:
    """Refuse (one line) a generation whose memory (sampling_bytes) and the model's pass memory_limit().
    model: the model of `config` already loaded, counted as it is rather than built again on the meta device."""
    parts = sampling_bytes(config, batch, prompt_tokens, new_tokens, kv_cache)
    total = sum(parts.values()) + sum(implied_bytes(config, model).values())
    limit, bound = memory_limit()
    if total > limit:
        shown = ", ".join(f"{name} {gb(n)}" for name, n in parts.items() if n)
        raise UserError(
            f"generating {batch:,} sequence(s) of {prompt_tokens:,} + {new_tokens:,} tokens at once needs "
            f"about {gb(total)} with the model ({shown}), more than {bound} ({gb(limit)}); draw fewer "
            f"samples at once, or set {MAX_MODEL_GB_ENV}=GB to try anyway"
        )
