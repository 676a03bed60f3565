"""GPT-2 (`GPT2LMHeadModel`, model_type gpt2): the `gpt` block (LayerNorm, learned positions, GELU, biases).

HF stores the linear layers as `Conv1D`, (in, out): ours are `nn.Linear`, (out, in), so they transpose; the other
names equal ours.  llama.cpp's `gpt2` architecture keeps q/k/v fused (attn_qkv) and needs every bias.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from minigpt.core.config import GPTConfig
from minigpt.hf.families.base import Family, get, gguf_blocks

CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # stored (in, out) by HF
# activation_function -> our gelu_approximate (gelu_new, gelu_fast and gelu_pytorch_tanh are one formula)
GELU = {"gelu_new": "tanh", "gelu_fast": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none", "gelu_python": "none"}
EXACT_GELU_NOTE = (
    "the model's exact (erf) GELU runs as llama.cpp's gpt2 tanh GELU, a difference of about 1e-3 in the activations"
)


def is_conv(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 1)[0].endswith(CONV1D)


class GPT2(Family):
    model_type = "gpt2"
    hf_class = "GPT2LMHeadModel"
    block = "gpt"
    gguf_arch = "gpt2"
    gguf_pre_tokenizer = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""", "gpt-2")
    tiktoken_fallback = "gpt2"  # GPT-2's vocab.json + merges.txt are this encoding
    all_biases = True
    peft_block = "transformer.h.{i}."
    peft_embedding = "transformer.wte"
    peft_modules = {name: name for name in CONV1D}
    peft_fused = True
    fan_in_fan_out = True

    def import_problems(self, hf: dict[str, Any]) -> Iterator[str]:
        activation = hf.get("activation_function", "gelu_new")
        if GELU.get(activation) is None:
            yield f"its activation_function is {activation!r}; minigpt's GPT-2 block computes {', '.join(GELU)} only"
        # attention variants GPT-2's class can be switched to, which our block does not compute
        # (reorder_and_upcast_attn is not one: it computes the same scores in float32, as our float32 model does)
        for key, ours in (
            ("scale_attn_by_inverse_layer_idx", False),
            ("scale_attn_weights", True),
            ("add_cross_attention", False),
        ):
            if bool(hf.get(key, ours)) != ours:
                yield (
                    f"its config.json sets {key}={hf.get(key)!r}, which minigpt's GPT-2 block does not compute; "
                    f"only {key}={str(ours).lower()} imports"
                )

    def config_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        n_embd = get(hf, "n_embd", "hidden_size")
        return dict(
            arch="gpt",
            n_layer=get(hf, "n_layer", "num_hidden_layers"),
            n_head=get(hf, "n_head", "num_attention_heads"),
            n_embd=n_embd,
            vocab_size=hf.get("vocab_size"),
            bias=True,
            mlp="gelu",
            gelu_approximate=GELU[hf.get("activation_function", "gelu_new")],
            mlp_hidden=get(hf, "n_inner", default=4 * n_embd if isinstance(n_embd, int) else None),
            norm_eps=get(hf, "layer_norm_epsilon", default=1e-5),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        )

    def context(self, hf: dict[str, Any]) -> int | None:
        return get(hf, "n_positions", "n_ctx", "max_position_embeddings")

    def export_problems(self, config: GPTConfig) -> Iterator[str]:
        if config.qk_norm:
            yield "qk_norm=true: GPT2LMHeadModel has no query/key normalisation; train with qk_norm false"
        yield from super().export_problems(config)
        if config.mlp == "swiglu":
            yield "mlp=swiglu with arch gpt: GPT2LMHeadModel's MLP is not gated; use arch llama for SwiGLU"
        if config.n_kv_head != config.n_head:
            yield (
                f"n_kv_head={config.n_kv_head} (grouped-query attention) with arch gpt: GPT2LMHeadModel "
                "has one key/value head per query head; use arch llama for GQA"
            )
        if config.head_dim * config.n_head != config.n_embd:
            yield (
                f"head_dim={config.head_dim} with arch gpt: GPT2LMHeadModel's head size is always "
                f"n_embd / n_head = {config.n_embd / config.n_head:g}; use arch llama for another size"
            )

    def hf_config(self, config: GPTConfig) -> dict[str, Any]:
        return {
            "n_positions": config.block_size,
            "n_ctx": config.block_size,
            "n_embd": config.n_embd,
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "n_inner": config.mlp_hidden,
            # gelu_new is GPT-2's own tanh formula; "gelu" is the exact (erf) one
            "activation_function": "gelu_new" if config.gelu_approximate == "tanh" else "gelu",
            "layer_norm_epsilon": config.norm_eps,
            "resid_pdrop": config.dropout,
            "embd_pdrop": config.dropout,
            "attn_pdrop": config.dropout,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }

    def to_hf(self, state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
        return {name: t.t() if is_conv(name) else t for name, t in state.items()}

    def from_hf(self, hf: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
        out = {}
        for name, tensor in hf.items():
            name = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name  # GPT2Model files
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # old transformers saved its causal mask as a buffer
            out[name] = tensor.t() if is_conv(name) else tensor
        return out

    def gguf_problems(self, config: GPTConfig) -> Iterator[str]:
        if config.qk_norm:
            yield "qk_norm=true: llama.cpp's gpt2 architecture has no query/key normalisation; train with qk_norm false"
        if config.mlp != "gelu":
            yield (
                f"mlp={config.mlp} with arch gpt: llama.cpp's gpt2 MLP is GELU only; use mlp gelu, or arch llama "
                "for SwiGLU"
            )
        if config.head_dim * config.n_head != config.n_embd:
            yield (
                f"head_dim={config.head_dim} with arch gpt: llama.cpp's gpt2 head size is always n_embd / "
                f"n_head = {config.n_embd / config.n_head:g}; use arch llama for another size"
            )

    def gguf_notes(self, config: GPTConfig) -> list[str]:
        return [EXACT_GELU_NOTE] if config.gelu_approximate == "none" else []

    def gguf_tensors(self, state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
        out = {
            "token_embd.weight": state["transformer.wte.weight"],
            "position_embd.weight": state["transformer.wpe.weight"],
        }
        out |= gguf_blocks(
            state,
            config,
            lambda get: {
                "attn_norm": get("ln_1"),
                "ffn_norm": get("ln_2"),
                "attn_output": get("attn.c_proj"),
                "ffn_down": get("mlp.c_proj"),
                "attn_qkv": get("attn.c_attn"),
                "ffn_up": get("mlp.c_fc"),
            },
        )
        out["output_norm.weight"] = state["transformer.ln_f.weight"]
        out["output_norm.bias"] = state["transformer.ln_f.bias"]
        if not config.tie_embeddings:
            out["output.weight"] = state["lm_head.weight"]
        return out

    def gguf_metadata(self, writer: Any, config: GPTConfig) -> None:
        writer.add_layer_norm_eps(config.norm_eps)
