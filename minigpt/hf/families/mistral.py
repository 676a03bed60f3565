"""Mistral (`MistralForCausalLM`, model_type mistral): Llama's block and tensor names, attending within a sliding
window on every layer (config.json's sliding_window; MistralConfig's default of 4096 where the key is absent, none
where it is null).  The import keeps the source's whole context (max_position_embeddings) and the window
(GPTConfig.sliding_window, the same meaning as transformers': a query sees itself and the window - 1 keys before), so
the model is ours exactly past the window; the export writes the model's own window.  llama.cpp runs it as its
`llama` architecture, as convert_hf_to_gguf does, which has no window: the GGUF export refuses a window shorter than
the context."""

from __future__ import annotations

from typing import Any

from minigpt.core.config import GPTConfig
from minigpt.hf.families.llama import Llama

DEFAULT_WINDOW = 4096  # MistralConfig's sliding_window where config.json has no such key


class Mistral(Llama):
    model_type = "mistral"
    config_defaults = {"max_position_embeddings": 131072}  # MistralConfig's (4096 * 32)
    hf_class = "MistralForCausalLM"
    gguf_pre_tokenizer = None  # SentencePiece-style BPE (v0.1-v0.3): llama.cpp's SentencePiece vocabulary
    sliding_window = True

    def config_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        return super().config_fields(hf) | {"sliding_window": hf.get("sliding_window", DEFAULT_WINDOW)}

    def hf_config(self, config: GPTConfig) -> dict[str, Any]:
        out = super().hf_config(config)
        del out["attention_bias"], out["mlp_bias"]  # MistralConfig has neither
        return {**out, "sliding_window": config.sliding_window}
