"""One config dataclass for every model minigpt builds, with named presets (litgpt style)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

ARCHS = ("gpt", "llama")
ATTENTIONS = ("sdpa", "manual", "einops")
SDPA_BACKENDS = ("flash", "efficient", "math", "cudnn")
MLPS = ("gelu", "swiglu", "relu2")


class ConfigError(ValueError):
    """A model config that cannot work; the message names the field and the fix."""


@dataclass
class GPTConfig:
    arch: str = "gpt"  # "gpt": GPT-2 block; "llama": RMSNorm + RoPE + GQA + SwiGLU
    attention: str = "sdpa"  # "sdpa" | "manual" | "einops": same function, three implementations
    n_layer: int = 6
    n_head: int = 6
    n_kv_head: int | None = None  # key/value heads; None = n_head (multi-head), 1 = multi-query
    n_embd: int = 384
    block_size: int = 256  # longest sequence the model accepts
    vocab_size: int = 50257
    dropout: float = 0.0
    bias: bool | None = None  # None = True for gpt, False for llama
    mlp: str | None = None  # None = "gelu" for gpt, "swiglu" for llama; "relu2" = squared ReLU
    mlp_hidden: int | None = None  # None = 4 * n_embd (gelu/relu2), ~8/3 * n_embd rounded to 64 (swiglu)
    rope_base: float = 10000.0  # RoPE frequency base (llama only)
    norm_eps: float = 1e-5
    tie_embeddings: bool = True  # share the token embedding with the output head
    qk_norm: bool = False  # RMS-normalise q and k per head before attention
    zero_init_proj: bool = False  # zero-init the residual output projections (attn c_proj, mlp c_proj)
    sdpa_backend: str | None = None  # restrict SDPA to one kernel: flash | efficient | math | cudnn

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.bias is None:
            self.bias = self.arch == "gpt"
        if self.mlp is None:
            self.mlp = "swiglu" if self.arch == "llama" else "gelu"
        if self.mlp_hidden is None:
            if self.mlp == "swiglu":  # keeps SwiGLU's 3 matrices at the 2-matrix MLP's parameter count
                self.mlp_hidden = -(-int(8 * self.n_embd / 3) // 64) * 64
            else:
                self.mlp_hidden = 4 * self.n_embd
        self.validate()

    def validate(self) -> None:
        def bad(field: str, problem: str, fix: str) -> ConfigError:
            return ConfigError(f"model.{field}: {problem}; {fix}")

        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "vocab_size", "mlp_hidden"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise bad(name, f"must be a positive integer, got {getattr(self, name)!r}", "set it to 1 or more")
        if self.arch not in ARCHS:
            raise bad("arch", f"unknown value {self.arch!r}", f"choose one of {', '.join(ARCHS)}")
        if self.attention not in ATTENTIONS:
            raise bad("attention", f"unknown value {self.attention!r}", f"choose one of {', '.join(ATTENTIONS)}")
        if self.mlp not in MLPS:
            raise bad("mlp", f"unknown value {self.mlp!r}", f"choose one of {', '.join(MLPS)}")
        if self.sdpa_backend is not None and self.sdpa_backend not in SDPA_BACKENDS:
            raise bad("sdpa_backend", f"unknown value {self.sdpa_backend!r}",
                      f"choose one of {', '.join(SDPA_BACKENDS)} or leave it unset")
        if self.n_embd % self.n_head:
            raise bad("n_embd", f"{self.n_embd} is not divisible by n_head={self.n_head}",
                      "choose n_embd as a multiple of n_head")
        if self.n_head % self.n_kv_head:
            raise bad("n_kv_head", f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}",
                      "choose n_kv_head as a divisor of n_head")
        if self.arch == "llama" and self.head_dim % 2:
            raise bad("n_embd", f"head dim n_embd/n_head={self.head_dim} is odd but RoPE rotates pairs",
                      "choose n_embd and n_head so that n_embd/n_head is even")
        if not 0.0 <= self.dropout < 1.0:
            raise bad("dropout", f"must be in [0, 1), got {self.dropout}", "use e.g. 0.0 or 0.1")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> GPTConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


# Presets are keyword dicts, not instances, so derived defaults (n_kv_head, mlp_hidden) follow overrides.
PRESETS: dict[str, dict[str, Any]] = {
    # a few hundred thousand parameters: tests and CPU smoke runs
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=256),
    # nanoGPT's shakespeare_char model
    "small": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=65, dropout=0.2),
    # GPT-2 124M (OpenAI's vocab; 124,439,808 parameters with tied embeddings)
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50257),
    # a small Llama-style model: RMSNorm, RoPE, GQA (6 query heads share 2 key/value heads), SwiGLU
    "llama-small": dict(arch="llama", n_layer=6, n_head=6, n_kv_head=2, n_embd=384, block_size=256,
                        vocab_size=65),
}
