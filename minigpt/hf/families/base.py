"""What every Hugging Face family module answers, and the defaults most of them share.

A family is one class (one instance in the registry, minigpt.hf.families): how its config.json maps to GPTConfig
and back, its tensor names both ways, its GGUF architecture and tensor layout, its PEFT module names, the llama.cpp
pre-tokenizer of its own tokenizer, and what it refuses.  The import (minigpt.hf.load, minigpt.hf.weights), the
three exports (minigpt.export.hf, .gguf, .peft) and export.py ask the family, never name one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from minigpt.core.config import GPTConfig


def get(hf: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of `keys` config.json sets to something other than null (configs rename keys across versions)."""
    return next((hf[k] for k in keys if hf.get(k) is not None), default)


class Family:
    model_type: ClassVar[str]
    """config.json's model_type, and GPTConfig.family's value."""
    hf_class: ClassVar[str]
    """The transformers class config.json's `architectures` names."""
    reads: ClassVar[dict[str, str]] = {}
    """Other HF classes (-> their model_type) whose text model this family imports (text_config, text_weight_name),
    exported then as hf_class: Gemma3ForConditionalGeneration's language model, a Gemma3ForCausalLM."""
    block: ClassVar[str]
    """The GPTConfig.arch (block kind) this family's models are built of."""
    gguf_arch: ClassVar[str]
    """llama.cpp's architecture name (general.architecture)."""
    gguf_pre_tokenizer: ClassVar[tuple[str, str] | None] = None
    """(the split pattern of the family's own byte-level BPE tokenizer.json, the llama.cpp pre-tokenizer that splits
    text alike): minigpt.export.gguf_vocab names the GGUF's pre-tokenizer from it.  None: not byte-level BPE (a
    SentencePiece-style one goes into the GGUF as llama.cpp's SentencePiece vocabulary, which has no pre-tokenizer)."""
    tiktoken_fallback: ClassVar[str | None] = None
    """The tiktoken encoding of a model folder that holds no tokenizer files (GPT-2's vocab.json/merges.txt)."""
    config_defaults: ClassVar[dict[str, Any]] = {}
    """What the HF config class reads where config.json leaves a field out (transformers' defaults that no other
    field derives): read as if config.json held them, so an import computes what transformers computes."""
    all_biases: ClassVar[bool] = False
    """The HF and llama.cpp layouts always hold every bias: a bias-free model exports zeros there."""
    # PEFT: where our adapters sit in the HF model
    peft_block: ClassVar[str] = "model.layers.{i}."
    peft_embedding: ClassVar[str] = "model.embed_tokens"
    peft_modules: ClassVar[dict[str, str]] = {}
    """Our projection (q, k, v, o, gate, up, down), or with peft_fused our block layer, -> the HF module."""
    peft_fused: ClassVar[bool] = False
    """HF fuses q, k and v in one module: their adapters become one of rank 3r (A stacked, B block-diagonal)."""
    fan_in_fan_out: ClassVar[bool] = False
    sliding_window: ClassVar[bool] = False
    """The HF class attends within config.json's sliding_window on every layer."""
    partial_rotary: ClassVar[bool] = False
    """The HF class and llama.cpp's architecture rotate the first partial_rotary_factor of each head's dims."""
    # the block variants (GPTConfig options) the class always has (mlp geglu, scale_embeddings, post_norms), and
    # whether it takes a softmax scale of its own (attn_scale_dim); a class without one refuses it
    geglu: ClassVar[bool] = False
    scaled_embeddings: ClassVar[bool] = False
    post_norms: ClassVar[bool] = False
    attn_scale: ClassVar[bool] = False

    # ------------------------------------------------------------------------------------------- import
    def import_problems(self, hf: dict[str, Any]) -> Iterator[str]:
        """Why a config.json of this family does not import (fields already of the right JSON types)."""
        return iter(())

    def text_config(self, hf: dict[str, Any]) -> dict[str, Any] | None:
        """The config.json of the text model the import reads (hf itself over config_defaults, or a class in
        `reads`'s text part); None: that class's config.json has none."""
        return self.config_defaults | hf

    def text_weight_name(self, hf: dict[str, Any], name: str) -> str | None:
        """A weight file's tensor name -> the text model's (None: not the text model's, not read)."""
        return name

    def import_notes(self, hf: dict[str, Any]) -> list[str]:
        """What a user should know of an import that succeeds (printed as `note:` lines)."""
        return []

    def config_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        """config.json -> GPTConfig's fields (block_size apart: context())."""
        raise NotImplementedError

    def context(self, hf: dict[str, Any]) -> int | None:
        """The source's context in tokens, the default block_size of the import."""
        return hf.get("max_position_embeddings")

    def block_size_problems(self, hf: dict[str, Any], block_size: int) -> Iterator[str]:
        context = self.context(hf)
        if context is not None and block_size > context:
            yield (
                f"block_size {block_size} is longer than the source's context of {context} tokens; ask for at "
                f"most {context}"
            )

    # ------------------------------------------------------------------------------------------- export
    def block_problems(self, config: GPTConfig) -> Iterator[str]:
        """A model of another block kind than this family's (a gpt block has no Llama layout, and the reverse)."""
        if config.arch != self.block:
            yield (
                f"model.family={self.model_type} with arch {config.arch}: {self.hf_class} is built of {self.block} "
                f"blocks; train with arch {self.block}, or leave model.family unset"
            )

    def export_problems(self, config: GPTConfig) -> Iterator[str]:
        """Each option the HF class cannot express, as "option: why; fix"."""
        yield from self.hf_position_problems(config)
        yield from self.variant_problems(config, self.hf_class)
        if config.mlp == "relu2":
            yield f"mlp=relu2: {self.hf_class} has no squared-ReLU MLP; train with mlp gelu (gpt) or swiglu (llama)"

    def tokenizer_notes(self, tokenizer_json: dict[str, Any]) -> list[str]:
        """What a user should know of the exported tokenizer.json as transformers loads it with this family's
        AutoTokenizer (printed as `note:` lines)."""
        return []

    def hf_position_problems(self, config: GPTConfig) -> Iterator[str]:
        """Sliding windows, several RoPE bases and partial rotary, where the HF class computes none of them."""
        return position_problems(config, self.hf_class, sliding=self.sliding_window, partial=self.partial_rotary)

    def variant_problems(self, config: GPTConfig, target: str) -> Iterator[str]:
        """The block variants `target` (this family's HF class or llama.cpp architecture) computes always or never."""
        if config.mlp == "geglu" and not self.geglu:
            yield f"mlp=geglu: {target}'s MLP is not GELU-gated; train with mlp swiglu (arch llama) or gelu"
        for option, has, what in (
            ("scale_embeddings", self.scaled_embeddings, "scales its token embeddings"),
            ("post_norms", self.post_norms, "normalises sublayer outputs"),
        ):
            if getattr(config, option) and not has:
                yield f"{option}=true: {target} never {what}; train with {option} false"
            elif has and not getattr(config, option):
                yield f"{option}=false: {target} always {what}; train with {option} true, or leave model.family unset"
        if config.attn_scale_dim not in (None, config.head_dim) and not self.attn_scale:
            yield (
                f"attn_scale_dim={config.attn_scale_dim}: {target} scales attention by 1/sqrt(head_dim); leave "
                "attn_scale_dim unset"
            )

    def hf_config(self, config: GPTConfig) -> dict[str, Any]:
        """config.json's family keys (export.hf adds the ones every class shares)."""
        raise NotImplementedError

    def to_hf(self, state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
        """Our state dict -> the HF class's tensors (a tied head left out)."""
        raise NotImplementedError

    def from_hf(self, hf: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
        """HF tensors (every name to_hf gives is there: checked before) -> our names."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------- GGUF
    @property
    def gguf_target(self) -> str:
        """How a refusal names llama.cpp's architecture of this family."""
        return f"llama.cpp's {self.gguf_arch} architecture"

    def gguf_problems(self, config: GPTConfig) -> Iterator[str]:
        """Each option llama.cpp's architecture cannot express, as "option: why; fix"."""
        return iter(())

    def gguf_position_problems(self, config: GPTConfig) -> Iterator[str]:
        """Sliding windows, several RoPE bases and partial rotary, which llama.cpp's architecture cannot express."""
        return position_problems(config, self.gguf_target, sliding=False, partial=self.partial_rotary)

    def gguf_notes(self, config: GPTConfig) -> list[str]:
        return []

    def gguf_tensors(self, state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
        """Our float32 state -> llama.cpp's tensor names and layout."""
        raise NotImplementedError

    def gguf_metadata(self, writer: Any, config: GPTConfig) -> None:
        """The architecture's own keys (export.gguf writes the shared ones)."""


def position_problems(config: GPTConfig, target: str, sliding: bool, partial: bool = False) -> Iterator[str]:
    """Sliding-window attention and partial rotary where `target` does not compute them (a window at least as long as
    the context is full attention)."""
    if config.sliding_window is not None and config.sliding_window < config.block_size:
        if not sliding:
            yield (  # an imported model (Mistral 7B v0.1, Phi-3-mini-4k) cannot be trained without: fine-tuned
                f"sliding_window={config.sliding_window}: {target} attends to the whole context; train without "
                f"sliding_window (or with one >= block_size {config.block_size}), or fine-tune with "
                f"--model.block_size {config.sliding_window} or less"
            )
        elif config.layer_types and "full_attention" in config.layer_types:
            yield f"layer_types: {target} slides on every layer; train with every layer sliding_attention"
    if config.rope_local_base is not None:
        yield f"rope_local_base={config.rope_local_base:g}: {target} has one RoPE base; leave rope_local_base unset"
    if config.partial_rotary_factor != 1.0 and not partial:
        yield (
            f"partial_rotary_factor={config.partial_rotary_factor:g}: {target} rotates every dimension of a head; "
            "train with partial_rotary_factor 1"
        )


def gguf_blocks(state: dict[str, torch.Tensor], config: GPTConfig, layer: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(llama.cpp name, tensor) of every block: layer(get) maps one block's tensors (get(our name) -> tensor or
    None), called for weights and again for biases."""
    for i in range(config.n_layer):
        for kind in ("weight", "bias"):
            tensors = layer(lambda name: state.get(f"transformer.h.{i}.{name}.{kind}"))  # noqa: B023 (called here)
            yield from ((f"blk.{i}.{name}.{kind}", t) for name, t in tensors.items() if t is not None)
