"""One config dataclass for every model minigpt builds, with named presets (litgpt style).

Each field is declared once, here: its type (choices as `Literal`), its default and its docstring are what
`train.py --help` shows, what YAML configs and `--model.FIELD` flags set, and what checkpoints store.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from minigpt.core.errors import ConfigError

Arch = Literal["gpt", "llama"]
Attention = Literal["sdpa", "manual", "einops"]
Mlp = Literal["gelu", "swiglu", "geglu", "relu2"]
GeluApproximate = Literal["none", "tanh"]
SdpaBackend = Literal["flash", "efficient", "math", "cudnn"]
# The Hugging Face families minigpt imports and exports, one module each in minigpt/hf/families (this list is their
# declaration as a field type; tests/hf/test_families.py checks it equals that registry)
Family = Literal["gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3"]
LayerType = Literal["full_attention", "sliding_attention"]
ARCHS, ATTENTIONS, MLPS, SDPA_BACKENDS = (get_args(t) for t in (Arch, Attention, Mlp, SdpaBackend))
CUDA_SDPA_BACKENDS = ("efficient", "cudnn")  # kernels only a GPU has (a CPU has flash and math)
GATED_MLPS = ("swiglu", "geglu")  # c_fc holds the gate's rows, then up's: act(gate) * up
# RoPE scalings minigpt computes (Hugging Face's rope_type names) and the keys each needs
ROPE_SCALINGS = {
    "linear": ("factor",),  # positions / factor (every frequency divided by it): Gemma 3 4B-27B's full layers
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    # Phi-3's: within original_max_position_embeddings, each frequency divided by its short_factor and cos/sin
    # multiplied by attention_factor (long_factor, for longer contexts, is kept for the export only)
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor"),
}
FACTOR_LISTS = ("short_factor", "long_factor")  # lists of numbers, one per rotated pair
# The fields a run may set differently from the weights it starts from, declared once: RUNTIME_FIELDS change how
# the same weights compute (a resumed run, a sampler), and fine-tuning (init_from) may also shrink block_size
# (learned positions are cropped, RoPE tables rebuilt).
RUNTIME_FIELDS = ("attention", "sdpa_backend", "dropout", "activation_checkpointing")
FINETUNE_FIELDS = (*RUNTIME_FIELDS, "block_size")


def is_number(value: Any, or_list: bool = False) -> bool:
    """An int or float (not a bool); with or_list, a non-empty list of them (longrope's per-frequency factors)."""
    if or_list and isinstance(value, list):
        return bool(value) and all(is_number(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_whole(value: Any) -> bool:
    """An int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class GPTConfig:
    """The model: its architecture (each field is a --model.FIELD flag)."""

    arch: Arch = "gpt"
    """Block: gpt (LayerNorm, learned positions, GELU) or llama (RMSNorm, RoPE, GQA, SwiGLU)."""
    attention: Attention = "sdpa"
    """Attention path: sdpa, manual or einops. The same function and weights, three implementations."""
    n_layer: int = 6
    """Transformer blocks."""
    n_head: int = 6
    """Query heads."""
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention); unset = n_head, 1 = multi-query."""
    n_embd: int = 384
    """Model width."""
    head_dim: int | None = None
    """Size of each attention head; unset = n_embd / n_head (imported models may set it otherwise)."""
    block_size: int = 256
    """Context length: the longest sequence the model accepts."""
    vocab_size: int = 50257
    """Vocabulary size (in train.py: taken from the data's tokenizer)."""
    dropout: float = 0.0
    """Dropout probability, in [0, 1)."""
    bias: bool | None = None
    """Biases in linear layers and LayerNorm; unset = true for gpt, false for llama."""
    qkv_bias: bool = False
    """Biases on the query/key/value projection even when `bias` is false (Qwen2's attention)."""
    mlp: Mlp | None = None
    """MLP: gelu, swiglu, geglu (GELU-gated: down(gelu(gate(x)) * up(x)), Gemma's) or relu2 (squared ReLU); unset =
    gelu for gpt, swiglu for llama."""
    gelu_approximate: GeluApproximate = "none"
    """GELU form (gelu and geglu): none (exact, erf) or tanh (GPT-2's original gelu_new, Gemma's)."""
    mlp_hidden: int | None = None
    """MLP hidden width; unset = 4 * n_embd (gelu, relu2) or ~8/3 * n_embd rounded up to 64 (swiglu, geglu)."""
    rope_base: float = 10000.0
    """RoPE frequency base (llama)."""
    rope_scaling: dict[str, Any] | None = None
    """RoPE frequency scaling as Hugging Face writes it, e.g. Llama 3.1's {rope_type: llama3, factor: 8, ...} or Gemma 3
    4B's {rope_type: linear, factor: 8}.  It applies to the layers at rope_base; sliding layers with a base of their
    own (rope_local_base) rotate unscaled, as Gemma 3's local layers do."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head."""
    scale_embeddings: bool = False
    """Multiply the token embeddings by sqrt(n_embd), rounded to the weights' dtype (Gemma's); a tied head reads the
    unscaled table."""
    post_norms: bool = False
    """Normalise each sublayer's output too, before the residual add: x + norm(attn(norm(x))), and the same for the
    MLP (Gemma's four norms per block)."""
    attn_scale_dim: int | None = None
    """Attention scores are q.k / sqrt(attn_scale_dim); unset = head_dim (Gemma's query_pre_attn_scalar)."""
    sliding_window: int | None = None
    """Sliding-window attention: a query at position i sees the keys at i - sliding_window < j <= i (itself and the
    sliding_window - 1 before it), and a sliding layer's KV cache keeps only those; unset = full causal attention."""
    layer_types: list[LayerType] | None = None
    """Per layer, full_attention or sliding_attention (Hugging Face's layer_types: Gemma 3, newer Mistral); unset =
    every layer sliding when sliding_window is set."""
    rope_local_base: float | None = None
    """RoPE frequency base of the sliding layers (Gemma 3's rope_local_base_freq); unset = rope_base."""
    partial_rotary_factor: float = 1.0
    """Fraction of each head's dims that RoPE rotates (the first int(head_dim * factor); Phi-3's), in (0, 1]."""
    qk_norm: bool = False
    """RMS-normalise queries and keys per head before attention."""
    zero_init_proj: bool = False
    """Start the residual output projections (attention and MLP c_proj) at zero."""
    family: Family | None = None
    """The Hugging Face family the exports write (an imported model keeps its source's); unset = gpt2 for arch gpt,
    llama for arch llama."""
    sdpa_backend: SdpaBackend | None = None
    """Restrict SDPA to one kernel: flash, efficient, math or cudnn; unset = torch picks.  efficient and cudnn are
    CUDA kernels (a CPU has flash and math: training there refuses them, a checkpoint loaded there lets torch pick),
    and flash takes no mask (a KV cache's later steps need one)."""
    activation_checkpointing: bool = False
    """Training only: keep each block's input, not its activations, and recompute them in the backward pass (less
    memory for about one more forward pass of compute)."""

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if (
            self.head_dim is None
            and isinstance(self.n_embd, int)
            and isinstance(self.n_head, int)
            and self.n_head > 0
            and self.n_embd % self.n_head == 0
        ):  # otherwise left unset: problems() names n_embd
            self.head_dim = self.n_embd // self.n_head
        if self.bias is None:
            self.bias = self.arch == "gpt"
        if self.mlp is None:
            self.mlp = "swiglu" if self.arch == "llama" else "gelu"
        if self.mlp_hidden is None and isinstance(self.n_embd, int):
            if self.mlp in GATED_MLPS:  # keeps the gated MLP's 3 matrices at the 2-matrix MLP's parameter count
                self.mlp_hidden = -(-int(8 * self.n_embd / 3) // 64) * 64
            else:
                self.mlp_hidden = 4 * self.n_embd
        scaling = self.rope_scaling
        if isinstance(scaling, dict) and "type" in scaling:  # transformers' older name for rope_type: read once here
            self.rope_scaling = {"rope_type": scaling["type"]} | {k: v for k, v in scaling.items() if k != "type"}
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first field that cannot work (a config from a file or a checkpoint comes
        through here; the command line's parser checks the same declarations first)."""
        for field, problem, fix in self.problems():
            raise ConfigError(f"model.{field}: {problem}; {fix}")

    def problems(self) -> Iterator[tuple[str, str, str]]:
        """(field, problem, fix) for every rule this config breaks: first the choices its Literal types declare,
        then the rules no type can say."""
        for name, (choices, optional) in literal_fields().items():
            value = getattr(self, name)
            if value not in choices and not (value is None and optional):
                unset = " or leave it unset" if optional else ""
                yield name, f"unknown value {value!r}", f"choose one of {', '.join(choices)}{unset}"
        if wrong := kind_problem(self, (bool, float)):  # a YAML or an API call may hold "false" or "0.1"
            name, kind, problem = wrong
            yield name, problem, "write it unquoted: " + ("true or false" if kind is bool else "e.g. 0.1")
            return  # the rules below compare these
        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "head_dim", "block_size", "vocab_size", "mlp_hidden"):
            value = getattr(self, name)
            if name == "head_dim" and value is None:  # n_head and n_embd are fine, so __post_init__ could not divide
                yield (
                    "n_embd",
                    f"{self.n_embd} is not divisible by n_head={self.n_head}",
                    "choose n_embd as a multiple of n_head (or set head_dim)",
                )
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                yield name, f"must be a positive integer, got {value!r}", "set it to 1 or more"
                return  # the rules below divide by these
        if self.n_head % self.n_kv_head:
            yield (
                "n_kv_head",
                f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}",
                "choose n_kv_head as a divisor of n_head",
            )
        if self.arch == "llama" and self.head_dim % 2:
            yield (
                "head_dim",
                f"head size {self.head_dim} is odd but RoPE rotates pairs",
                "choose n_embd and n_head so that n_embd/n_head is even",
            )
        if not 0.0 <= self.dropout < 1.0:
            yield "dropout", f"must be in [0, 1), got {self.dropout}", "use e.g. 0.0 or 0.1"
        if not self.rope_base > 1.0:
            yield "rope_base", f"must be > 1, got {self.rope_base}", "use e.g. 10000"
        scale_dim = self.attn_scale_dim
        if scale_dim is not None and not (is_whole(scale_dim) and scale_dim >= 1):
            yield "attn_scale_dim", f"must be a positive integer, got {scale_dim!r}", "use e.g. 256, or leave it unset"
        if not 0.0 < self.norm_eps < 1.0:
            yield "norm_eps", f"must be in (0, 1), got {self.norm_eps}", "use e.g. 1e-5"
        if self.rope_scaling is not None and self.arch == "gpt":
            yield "rope_scaling", "arch gpt has learned positions, not RoPE", "use arch llama or leave it unset"
        elif self.rope_scaling is not None:
            yield from self._rope_scaling_problems()
        yield from self._window_problems()
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            yield (
                "partial_rotary_factor",
                f"must be in (0, 1], got {self.partial_rotary_factor}",
                "use 1 to rotate every dim, or e.g. 0.5",
            )
        elif self.arch == "llama" and (self.rotary_dim % 2 or self.rotary_dim == 0):
            yield (
                "partial_rotary_factor",
                f"rotates {self.rotary_dim} of each head's {self.head_dim} dims, but RoPE rotates pairs",
                "choose a factor that gives an even number of dims, at least 2",
            )
        elif self.arch == "gpt" and self.partial_rotary_factor != 1.0:
            yield "partial_rotary_factor", "arch gpt has learned positions, not RoPE", "use arch llama or leave it at 1"

    def _window_problems(self) -> Iterator[tuple[str, str, str]]:
        window, types = self.sliding_window, self.layer_types
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            yield (
                "sliding_window",
                f"must be a positive integer, got {window!r}",
                "set it to 1 or more, or leave it unset",
            )
            return
        if types is not None:
            if not isinstance(types, list) or len(types) != self.n_layer:
                count = len(types) if isinstance(types, list) else repr(types)
                yield "layer_types", f"needs one entry per layer ({self.n_layer}), got {count}", "list n_layer types"
                return
            if unknown := sorted({str(t) for t in types} - set(get_args(LayerType))):
                yield (
                    "layer_types",
                    f"unknown layer type(s) {', '.join(unknown)}",
                    f"use {' or '.join(get_args(LayerType))}",
                )
                return
            if window is None and "sliding_attention" in types:
                yield "layer_types", "has sliding_attention layers but sliding_window is unset", "set sliding_window"
        if self.rope_local_base is not None:
            if not self.rope_local_base > 1.0:
                yield "rope_local_base", f"must be > 1, got {self.rope_local_base}", "use e.g. 10000, or leave it unset"
            elif self.arch != "llama" or not any(self.layer_window(i) for i in range(self.n_layer)):
                yield (
                    "rope_local_base",
                    "is the RoPE base of sliding layers, and this model has none with RoPE",
                    "leave it unset, or set sliding_window with arch llama",
                )
        if window is not None and self.sdpa_backend == "flash":
            yield (
                "sdpa_backend",
                "flash takes no attention mask, and a sliding window needs one",
                "leave it unset, or choose efficient on a GPU",
            )

    def check_device(self, device_type: str) -> None:
        """Raise ConfigError where this config cannot train on a device of this type (a GPU's kernel on a CPU)."""
        if self.sdpa_backend in CUDA_SDPA_BACKENDS and device_type != "cuda":
            raise ConfigError(
                f"model.sdpa_backend: {self.sdpa_backend} is a CUDA kernel and this run is on {device_type}; "
                "choose flash or math there, or leave it unset (torch picks)"
            )

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, or None where it attends to every earlier position."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    @property
    def rotary_dim(self) -> int:
        """The dims of each head that RoPE rotates (the first ones; Hugging Face's int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def _rope_scaling_problems(self) -> Iterator[tuple[str, str, str]]:
        scaling, copy = self.rope_scaling, "copy the rope_scaling dict of the model's config.json"
        kind = scaling.get("rope_type") if isinstance(scaling, dict) else None
        if kind not in ROPE_SCALINGS:
            yield (
                "rope_scaling",
                f"unsupported RoPE scaling {kind!r}",
                f"minigpt computes rope_type {', '.join(ROPE_SCALINGS)}; leave it unset for plain RoPE",
            )
        elif missing := [k for k in ROPE_SCALINGS[kind] if not is_number(scaling.get(k), k in FACTOR_LISTS)]:
            yield "rope_scaling", f"rope_type {kind} needs numbers for {', '.join(missing)}", copy
        elif kind == "linear":
            if not scaling["factor"] > 0:
                yield "rope_scaling", f"linear needs factor > 0, got {scaling['factor']}", copy
        elif kind == "llama3":
            if not (scaling["factor"] > 0 and scaling["high_freq_factor"] > scaling["low_freq_factor"] > 0):
                yield "rope_scaling", "needs factor > 0 and high_freq_factor > low_freq_factor > 0", copy
        elif any(len(scaling[k]) != self.rotary_dim // 2 for k in FACTOR_LISTS):
            yield (
                "rope_scaling",
                f"longrope's short_factor and long_factor need one number per rotated pair ({self.rotary_dim // 2})",
                copy,
            )
        elif not (scaling["attention_factor"] > 0 and min(scaling["short_factor"]) > 0):
            yield "rope_scaling", "longrope needs attention_factor > 0 and every short_factor > 0", copy
        elif self.block_size > (original := scaling["original_max_position_embeddings"]):
            yield (
                "block_size",
                f"{self.block_size} is past longrope's original_max_position_embeddings {original}, where its "
                "long_factor takes over, which minigpt does not compute",
                f"set block_size to at most {original}",
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """The inverse of to_dict; a key this version does not know is an error, never silently dropped."""
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(
                f"unknown model config field(s): {', '.join(unknown)}; the config was written by "
                "another version of minigpt, or is damaged"
            )
        return cls(**d)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> GPTConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


# what a value of each declared scalar type must be, and its test (a bool is no whole number, nor a number)
KINDS: dict[type, tuple[str, Callable[[Any], bool]]] = {
    bool: ("true or false", lambda v: isinstance(v, bool)),
    int: ("a whole number", is_whole),
    float: ("a number", is_number),
}


@functools.cache
def declared_kinds(cls: type, kinds: tuple[type, ...]) -> dict[str, tuple[type, bool]]:
    """field -> (its type, whether it may be None), for the dataclass's fields declared as one of `kinds`."""
    found = {}
    for name, hint in get_type_hints(cls).items():
        if declared := [a for a in (hint, *get_args(hint)) if a in kinds]:
            found[name] = (declared[0], type(None) in get_args(hint))
    return found


def kind_problem(obj: Any, kinds: tuple[type, ...]) -> tuple[str, type, str] | None:
    """(field, its declared type, what is wrong) for the first field of dataclass `obj` whose value is not of its
    declared type among `kinds` (KINDS), or None: checked from the declarations, before a rule compares values."""
    for name, (kind, optional) in declared_kinds(type(obj), kinds).items():
        value = getattr(obj, name)
        if not (value is None and optional) and not KINDS[kind][1](value):
            return name, kind, f"must be {KINDS[kind][0]}, got {value!r}"
    return None


@functools.cache
def literal_fields() -> dict[str, tuple[tuple[Any, ...], bool]]:
    """field -> (the choices its Literal type declares, whether it may be unset), for GPTConfig's Literal fields."""
    found = {}
    for name, hint in get_type_hints(GPTConfig).items():
        choices = tuple(v for a in (hint, *get_args(hint)) if get_origin(a) is Literal for v in get_args(a))
        if choices:
            found[name] = (choices, type(None) in get_args(hint))
    return found


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
    "llama-small": dict(arch="llama", n_layer=6, n_head=6, n_kv_head=2, n_embd=384, block_size=256, vocab_size=65),
}
