"""Mistral (`MistralForCausalLM`, model_type mistral): Llama's block and tensor names, attending within a sliding
window.  The import caps the context at the window, inside which sliding and full attention agree, so the model is
ours exactly; the export writes the model's own window (none for an import: full attention over that context, the same
function).  llama.cpp runs it
as its `llama` architecture, as convert_hf_to_gguf does."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from minigpt.core.config import GPTConfig
from minigpt.hf.families.llama import Llama


class Mistral(Llama):
    model_type = "mistral"
    hf_class = "MistralForCausalLM"
    gguf_pre_tokenizer = None  # SentencePiece (v0.1-v0.3), which the GGUF export refuses
    sliding_window = True  # a model trained here with --model.sliding_window exports its window

    def context(self, hf: dict[str, Any]) -> int | None:
        context, window = hf.get("max_position_embeddings"), hf.get("sliding_window")
        return min(context, window) if window is not None and context is not None else context

    def block_size_problems(self, hf: dict[str, Any], block_size: int) -> Iterator[str]:
        window = hf.get("sliding_window")
        if window is not None and block_size > window:
            yield (
                f"it attends within a sliding window of {window} tokens, so a block_size of {block_size} would "
                f"compute another function than the source; ask for a block_size of at most {window}"
            )
        else:
            yield from super().block_size_problems(hf, block_size)

    def hf_config(self, config: GPTConfig) -> dict[str, Any]:
        out = super().hf_config(config)
        del out["attention_bias"], out["mlp_bias"]  # MistralConfig has neither
        return {**out, "sliding_window": config.sliding_window}
