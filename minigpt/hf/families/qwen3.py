"""Qwen3 (`Qwen3ForCausalLM`, model_type qwen3): Qwen2's layout without biases, with each head's queries and keys
RMS-normalised before RoPE (q_norm / k_norm: one gain of head_dim values, eps rms_norm_eps: GPTConfig.qk_norm) and an
explicit head_dim (128 in the released models, not hidden_size / heads).  llama.cpp's `qwen3` architecture holds the
norms as attn_q_norm / attn_k_norm and rotates halves (NEOX rope), so q and k keep their row order."""

from __future__ import annotations

from typing import Any

from minigpt.core.config import GPTConfig
from minigpt.hf.families.llama import BLOCK, FUSED
from minigpt.hf.families.qwen2 import Qwen2

QK_NORMS = {"attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"}


class Qwen3(Qwen2):
    model_type = "qwen3"
    config_defaults = {"max_position_embeddings": 32768, "head_dim": 128}  # Qwen3Config's: head_dim not hidden/heads
    hf_class = "Qwen3ForCausalLM"
    gguf_arch = "qwen3"
    block_names = BLOCK | QK_NORMS
    fused = FUSED
    qkv_bias = False
    qk_norm = True

    def config_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        return super().config_fields(hf) | {"qk_norm": True}

    def hf_config(self, config: GPTConfig) -> dict[str, Any]:
        return {**super().hf_config(config), "attention_bias": False}
