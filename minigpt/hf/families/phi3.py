"""Phi-3 / Phi-4-mini (`Phi3ForCausalLM`, model_type phi3): Llama's block with q, k and v fused in one qkv_proj (rows
q, k, v) and the SwiGLU gate and up in one gate_up_proj (rows gate, up), which are exactly our c_attn and c_fc; RoPE
on the first partial_rotary_factor of each head's dims (Phi-4-mini: 0.75); a sliding window on every layer where
config.json sets one (Phi-3-mini-4k: 2047, as transformers masks it: a query sees itself and the 2046 keys before).

LongRoPE (rope_scaling longrope: Phi-3-mini-128k, Phi-4-mini) imports within original_max_position_embeddings, where
transformers divides each frequency by its short_factor and scales cos/sin by an attention factor (given, or from
max_position_embeddings / original_max_position_embeddings); the long_factor beyond is not computed, so the context
is capped there.  llama.cpp's `phi3` architecture keeps the fused tensors (attn_qkv; ffn_up holding gate then up),
rotates halves (NEOX rope) over rope.dimension_count dims and holds LongRoPE as the rope_factors_short/long tensors
and rope.scaling.attn_factor.  It computes no sliding window for Phi-3 (its loader turns Phi SWA off), so a window
shorter than the context is refused there.  Phi-3's tokenizer is SentencePiece-style BPE (as Mistral's: llama.cpp's
SentencePiece vocabulary in a GGUF, under a name that says phi3 for its rstrip tokens); Phi-4-mini's is o200k-style
byte-level BPE, llama.cpp's `gpt-4o` pre-tokenizer."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from minigpt.core.config import GPTConfig, is_number, is_whole
from minigpt.hf.families.llama import BLOCK, Llama, rope, rope_problems

FUSED_NAMES = {"attn.c_attn.weight": "self_attn.qkv_proj.weight", "mlp.c_fc.weight": "mlp.gate_up_proj.weight"}
O200K = (  # Phi-4-mini's tokenizer.json (tiktoken's o200k_base pattern)
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
ORIGINAL_CONTEXT = 4096  # Phi3Config's original_max_position_embeddings where config.json gives none


def rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json with its RoPE as Phi3Config reads it: the old kinds su and yarn are longrope, and
    partial_rotary_factor (top level or in the RoPE dict) is taken out (this family computes it)."""
    out = {k: v for k, v in hf.items() if k != "partial_rotary_factor"}
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(params := hf.get(key), dict):
            params = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
            for kind_key in ("rope_type", "type"):
                if params.get(kind_key) in ("su", "yarn"):
                    params[kind_key] = "longrope"
            out[key] = params
    return out


def partial_rotary_factor(hf: dict[str, Any]) -> Any:
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    return params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))


def original_context(hf: dict[str, Any]) -> int:
    """Phi3Config prefers its top-level original_max_position_embeddings over the RoPE dict's."""
    return hf.get("original_max_position_embeddings") or ORIGINAL_CONTEXT


def is_longrope(hf: dict[str, Any]) -> bool:
    return (rope(rope_fields(hf))[1] or {}).get("rope_type") == "longrope"


class Phi3(Llama):
    model_type = "phi3"
    config_defaults = {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5}  # Phi3Config's (Llama's eps is 1e-6)
    hf_class = "Phi3ForCausalLM"
    gguf_arch = "phi3"
    gguf_pre_tokenizer = (O200K, "gpt-4o")  # Phi-4-mini's (Phi-3's SentencePiece-style BPE needs no pattern)
    block_names = BLOCK | FUSED_NAMES
    fused = {}
    peft_modules = {
        "attn.c_attn": "self_attn.qkv_proj",
        "attn.c_proj": "self_attn.o_proj",
        "mlp.c_fc": "mlp.gate_up_proj",
        "mlp.c_proj": "mlp.down_proj",
    }
    peft_fused = True  # q, k, v adapters -> one of rank 3r on qkv_proj; gate, up -> one of rank 2r on gate_up_proj
    gguf_permute = False  # llama.cpp's phi3 rotates halves, as HF does
    rope_kinds = ("default", "longrope")
    sliding_window = True
    partial_rotary = True

    # ------------------------------------------------------------------------------------------- import
    def import_problems(self, hf: dict[str, Any]) -> Iterator[str]:
        if hf.get("hidden_act", "silu") != "silu":
            yield f"its hidden_act is {hf.get('hidden_act')!r}; minigpt's SwiGLU MLP computes silu only"
        fields = rope_fields(hf)
        yield from rope_problems(fields, self.rope_kinds)
        factor = (rope(fields)[1] or {}).get("factor")
        partial, original = partial_rotary_factor(hf), hf.get("original_max_position_embeddings")
        for key, value, ok in (
            ("partial_rotary_factor", partial, is_number(partial)),
            ("original_max_position_embeddings", original, original is None or is_whole(original) and original > 1),
            ("rope_scaling's factor", factor, factor is None or is_number(factor)),
        ):
            if not ok:
                yield f"its config.json's {key} is {value!r}, where Phi3Config reads a number; fix the field"

    def config_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        fields = super().config_fields(rope_fields(hf))
        fields |= {"partial_rotary_factor": partial_rotary_factor(hf), "sliding_window": hf.get("sliding_window")}
        if is_longrope(hf):
            scaling = fields["rope_scaling"]
            original = original_context(hf)
            factor = scaling.pop("factor", None) or (hf.get("max_position_embeddings") or original) / original
            if scaling.get("attention_factor") is None:  # transformers' default for LongRoPE
                scaling["attention_factor"] = (
                    1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
                )
            scaling["original_max_position_embeddings"] = original
        return fields

    def context(self, hf: dict[str, Any]) -> int | None:
        context = hf.get("max_position_embeddings")
        return min(context, original_context(hf)) if is_longrope(hf) and context is not None else context

    def block_size_problems(self, hf: dict[str, Any], block_size: int) -> Iterator[str]:
        original = original_context(hf)
        if is_longrope(hf) and block_size > original:
            yield (
                f"its rope_scaling longrope switches to long_factor past original_max_position_embeddings "
                f"{original}, which minigpt does not compute; ask for a block_size of at most {original}"
            )
        else:
            yield from super().block_size_problems(hf, block_size)

    # ------------------------------------------------------------------------------------------- export
    def export_problems(self, config: GPTConfig) -> Iterator[str]:
        yield from super().export_problems(config)
        yield from self.rope_kind_problems(config, self.hf_class)
        if config.rope_scaling is not None and config.head_dim * config.n_head != config.n_embd:
            yield (
                f"head_dim={config.head_dim} with rope_scaling longrope: {self.hf_class} checks longrope's factors "
                f"against hidden_size / heads = {config.n_embd / config.n_head:g} dims; train without head_dim"
            )

    def rope_kind_problems(self, config: GPTConfig, target: str) -> Iterator[str]:
        kind = (config.rope_scaling or {}).get("rope_type", "default")
        if kind not in self.rope_kinds:
            yield f"rope_scaling {kind}: {target} computes plain RoPE or longrope; train without rope_scaling"

    def hf_config(self, config: GPTConfig) -> dict[str, Any]:
        out = super().hf_config(config)
        del out["attention_bias"], out["mlp_bias"]  # Phi3Config has neither
        original = (config.rope_scaling or {}).get("original_max_position_embeddings", config.block_size)
        return {
            **out,
            "partial_rotary_factor": config.partial_rotary_factor,
            "original_max_position_embeddings": original,  # read over the RoPE dict's by Phi3Config
            "sliding_window": config.sliding_window,
            "resid_pdrop": config.dropout,
            "embd_pdrop": config.dropout,
            "pad_token_id": None,  # Phi3Config's default (32000) is past a smaller vocabulary
        }

    # ------------------------------------------------------------------------------------------- GGUF
    def gguf_problems(self, config: GPTConfig) -> Iterator[str]:
        yield from super().gguf_problems(config)
        yield from self.rope_kind_problems(config, self.gguf_target)
        if config.head_dim * config.n_head != config.n_embd:
            yield (
                f"head_dim={config.head_dim}: llama.cpp's phi3 head size is n_embd / n_head = "
                f"{config.n_embd / config.n_head:g}; train without head_dim"
            )

    def gguf_notes(self, config: GPTConfig) -> list[str]:
        if config.rope_scaling is None:
            return []
        original = config.rope_scaling["original_max_position_embeddings"]
        return [
            f"llama.cpp switches to longrope's long_factor when its context (-c, rounded up to 256) is longer than "
            f"original_max_position_embeddings {original}: within it the GGUF computes this model's function"
        ]

    def gguf_layer(self, get: Any, config: GPTConfig) -> dict[str, torch.Tensor | None]:
        return {  # q, k, v and gate, up stay fused, as llama.cpp's phi3 reads them
            "attn_norm": get("ln_1"),
            "ffn_norm": get("ln_2"),
            "attn_qkv": get("attn.c_attn"),  # rows q, k, v
            "attn_output": get("attn.c_proj"),
            "ffn_up": get("mlp.c_fc"),  # rows gate, up: llama.cpp's SwiGLU splits it in halves
            "ffn_down": get("mlp.c_proj"),
        }

    def gguf_metadata(self, writer: Any, config: GPTConfig) -> None:
        writer.add_layer_norm_rms_eps(config.norm_eps)
        writer.add_rope_freq_base(config.rope_base)
        writer.add_rope_dimension_count(config.rotary_dim)
        writer.add_sliding_window(0)  # none: a shorter window is refused (gguf_problems)
        if config.rope_scaling is not None:
            writer.add_rope_scaling_orig_ctx_len(config.rope_scaling["original_max_position_embeddings"])
            writer.add_rope_scaling_attn_factors(config.rope_scaling["attention_factor"])
