"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`, model_type qwen2): Llama's block and names with biases on the q, k and v
projections (none on o_proj or the MLP: GPTConfig.qkv_bias), a tied or untied head, rope_theta 1e6 in the released
models.  llama.cpp's `qwen2` architecture rotates halves as HF does (NEOX rope), so q and k keep their row order.
Sliding-window attention (use_sliding_window) is refused: minigpt's attention is full."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from minigpt.core.config import GPTConfig
from minigpt.hf.families.llama import FUSED, Llama

QKV_BIASES = {"attn.c_attn.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")}
PATTERN = (  # Qwen2's tokenizer.json (Qwen3's too): single digits
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"""
    r"""|\s+"""
)


def qwen_pipeline(doc: dict[str, Any]) -> bool:
    """Whether a tokenizer.json is the pipeline transformers' Qwen2Tokenizer builds: NFC, Qwen's split, byte-level
    BPE (its ids are then the file's)."""
    model, pre = doc.get("model") or {}, doc.get("pre_tokenizer") or {}
    split, byte_level = (pre.get("pretokenizers") or [{}, {}]) if pre.get("type") == "Sequence" else ({}, {})
    return (
        (doc.get("normalizer") or {}).get("type") == "NFC"
        and (model.get("type"), model.get("byte_fallback", False)) == ("BPE", False)
        and (doc.get("decoder") or {}).get("type") == "ByteLevel"
        and (split.get("type"), (split.get("pattern") or {}).get("Regex")) == ("Split", PATTERN)
        and (split.get("behavior"), split.get("invert", False)) == ("Isolated", False)
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("add_prefix_space")
        and not byte_level.get("use_regex", True)
    )


class Qwen2(Llama):
    model_type = "qwen2"
    config_defaults = {"max_position_embeddings": 32768}  # Qwen2Config's
    hf_class = "Qwen2ForCausalLM"
    gguf_arch = "qwen2"
    gguf_pre_tokenizer = (PATTERN, "qwen2")
    fused = FUSED | QKV_BIASES
    gguf_permute = False
    gguf_rope_kinds = ("default",)  # llama.cpp's qwen2 and qwen3 load no rope_freqs (Llama 3's factors)
    qkv_bias = True

    def import_problems(self, hf: dict[str, Any]) -> Iterator[str]:
        if hf.get("use_sliding_window"):
            yield (
                "its config.json sets use_sliding_window=true, which minigpt does not compute (its attention is "
                "full); use a model with use_sliding_window false"
            )
        yield from super().import_problems(hf)

    def config_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        return super().config_fields(hf) | {"qkv_bias": self.qkv_bias}

    def tokenizer_notes(self, tokenizer_json: dict[str, Any]) -> list[str]:
        # transformers 5 loads a qwen2 folder's tokenizer as Qwen2Tokenizer whatever tokenizer_config.json says: it
        # builds Qwen's pipeline around tokenizer.json's vocab and merges and drops the file's own
        if qwen_pipeline(tokenizer_json):
            return []
        return [
            "transformers' AutoTokenizer loads a qwen2 folder as Qwen2Tokenizer, which rebuilds Qwen's byte-level "
            "BPE (NFC, Qwen's split pattern) around the vocabulary and would encode text to other ids than this "
            "tokenizer; load it with PreTrainedTokenizerFast.from_pretrained(folder), which reads tokenizer.json as "
            "written"
        ]

    def hf_config(self, config: GPTConfig) -> dict[str, Any]:
        out = super().hf_config(config)
        del out["attention_bias"], out["mlp_bias"]  # Qwen2Config has neither: its biases are q, k and v's
        return {**out, "use_sliding_window": False, "sliding_window": None, "max_window_layers": config.n_layer}
