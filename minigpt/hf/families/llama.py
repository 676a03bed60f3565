"""Llama (`LlamaForCausalLM`, model_type llama: Llama 2/3.x, TinyLlama, SmolLM): the `llama` block (RMSNorm, RoPE,
GQA, SwiGLU, no biases), and the layout the other llama-style families (Mistral, Qwen2, Qwen3) extend.

HF keeps q, k and v as three matrices (ours: one `c_attn`, rows q then k then v) and the SwiGLU gate and up as two
(ours: one `c_fc`, rows gate then up).  Both rotate q and k the same way (pairs i and i + hs/2), so HF needs no
permutation; llama.cpp's `llama` architecture rotates interleaved pairs (2i, 2i + 1), so its q and k rows are
permuted (convert_hf_to_gguf's LlamaModel.permute).  Llama 3 RoPE scaling goes to GGUF as the rope_freqs factors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from minigpt.core.config import GPTConfig
from minigpt.core.model import llama3_scaled_frequencies
from minigpt.hf.families.base import Family, get, gguf_blocks

TOP = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "transformer.ln_f.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
BLOCK = {  # ours -> HF, per block
    "ln_1.weight": "input_layernorm.weight",
    "ln_2.weight": "post_attention_layernorm.weight",
    "attn.c_proj.weight": "self_attn.o_proj.weight",
    "mlp.c_proj.weight": "mlp.down_proj.weight",
}
FUSED = {  # one of ours -> several HF tensors, stacked by rows
    "attn.c_attn.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.c_fc.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
PEFT_MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def hf_shape(config: GPTConfig) -> dict[str, Any]:
    """The config.json keys of a llama-style model's shape, which every llama-block family writes alike."""
    return {
        "hidden_size": config.n_embd,
        "intermediate_size": config.mlp_hidden,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.norm_eps,
    }


# ------------------------------------------------------------------------------------------------ RoPE in config.json


def rope_readings(hf: dict[str, Any]) -> dict[str, tuple[Any, str, dict[str, Any]]]:
    """RoPE as each of config.json's two fields says it: field -> (theta, kind, the other parameters).

    transformers 5 writes `rope_parameters` with rope_theta inside; older versions wrote a top-level `rope_theta`
    and a `rope_scaling` dict (whose kind is `rope_type`, or `type` before that).  A null or {} field is absent."""
    top_theta = hf.get("rope_theta")
    return {
        key: (
            params.get("rope_theta", top_theta),
            params.get("rope_type", params.get("type", "default")),
            {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type", "type")},
        )
        for key in ("rope_parameters", "rope_scaling")
        if (params := hf.get(key))
    }


def rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, scaling dict or None) of a config.json that rope_problems() passed."""
    theta, kind, rest = next(iter(rope_readings(hf).values()), (hf.get("rope_theta"), "default", {}))
    theta = 10000.0 if theta is None else theta
    theta = float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else theta  # else refused
    if kind == "default":
        return theta, None
    return theta, {k: v for k, v in rest.items() if k != "partial_rotary_factor"} | {"rope_type": kind}


def rope_problems(hf: dict[str, Any], kinds: tuple[str, ...] = ("default", "llama3", "linear")) -> Iterator[str]:
    """A file holding both RoPE forms, or two rope_theta, is read one way by transformers 4 (rope_scaling and the
    top-level rope_theta) and another by transformers 5 (rope_scaling over rope_parameters, the rope_theta inside
    over the top-level one): unless the two agree, it is refused, never guessed.  Every rope_type but `kinds` is
    refused too (dynamic, yarn...)."""
    top_theta, readings = hf.get("rope_theta"), rope_readings(hf)
    for key, (theta, _, _) in readings.items():
        if top_theta is not None and theta != top_theta:
            yield (
                f"its config.json gives rope_theta {top_theta} at the top level and {theta} in {key}; "
                "transformers 4 reads the first, transformers 5 the second: keep the one the model was trained with"
            )
    if len(readings) == 2 and readings["rope_parameters"] != readings["rope_scaling"]:
        yield (
            f"its config.json holds both rope_parameters ({str(hf['rope_parameters'])[:80]}) and rope_scaling "
            f"({str(hf['rope_scaling'])[:80]}), which disagree; transformers 5 reads rope_scaling over "
            "rope_parameters, other versions one or the other: keep the one the model was trained with"
        )
    _, kind, rest = next(iter(readings.values()), (None, "default", {}))
    partial = rest.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        yield (
            f"its config.json sets partial_rotary_factor {partial}; minigpt's RoPE rotates the whole head (factor "
            "1.0) only"
        )
    if kind not in kinds:
        imported = "plain RoPE" + (" and rope_type llama3 (Llama 3.1/3.2) or linear" if "llama3" in kinds else " only")
        yield f"its RoPE scaling is {kind!r}, which minigpt does not compute for this family; it imports {imported}"


def rope_config(config: GPTConfig) -> dict[str, Any]:
    """config.json's RoPE keys: transformers 5 reads rope_parameters; rope_theta / rope_scaling are the keys older
    transformers, vLLM and llama.cpp's converter read (5 takes rope_scaling over rope_parameters: equal here)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_base}
    legacy: dict[str, Any] = {"rope_theta": config.rope_base}
    if config.rope_scaling is not None:
        params = {**config.rope_scaling, "rope_theta": config.rope_base}
        legacy["rope_scaling"] = dict(config.rope_scaling)
    return {"rope_parameters": params, **legacy}


def rotary_pairs(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """q or k rows (heads x hs, ...) from rotate-half order (pairs i, i + hs/2) to llama.cpp's interleaved pairs
    (2i, 2i + 1): convert_hf_to_gguf's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ------------------------------------------------------------------------------------------------ the family


class Llama(Family):
    model_type = "llama"
    config_defaults = {"max_position_embeddings": 2048}  # LlamaConfig's
    hf_class = "LlamaForCausalLM"
    block = "llama"
    gguf_arch = "llama"
    gguf_pre_tokenizer = (  # Llama 3's tokenizer.json (Llama 2's SentencePiece-style BPE needs no pattern)
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
        r"""|\s+(?!\S)|\s+""",
        "llama-bpe",
    )
    peft_modules = PEFT_MODULES
    top, block_names, fused = TOP, BLOCK, FUSED
    gguf_permute = True  # llama.cpp's llama rotates interleaved pairs (LLAMA_ROPE_TYPE_NORM)
    rope_kinds = ("default", "llama3", "linear")
    qkv_bias = False  # the class has biases on q, k and v alone (GPTConfig.qkv_bias)
    qk_norm = False  # the class RMS-normalises each head's queries and keys (GPTConfig.qk_norm)

    # ------------------------------------------------------------------------------------------- import
    def import_problems(self, hf: dict[str, Any]) -> Iterator[str]:
        if hf.get("hidden_act", "silu") != "silu":
            yield f"its hidden_act is {hf.get('hidden_act')!r}; minigpt's SwiGLU MLP computes silu only"
        for key in ("attention_bias", "mlp_bias"):  # our bias is all-or-nothing, and Llama checkpoints have none
            if hf.get(key):
                yield f"its config.json sets {key}=true; minigpt imports Llama-family models without biases only"
        yield from rope_problems(hf, self.rope_kinds)

    def config_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        theta, scaling = rope(hf)
        n_head = hf.get("num_attention_heads")
        return dict(
            arch="llama",
            n_layer=hf.get("num_hidden_layers"),
            n_head=n_head,
            n_kv_head=get(hf, "num_key_value_heads", default=n_head),
            n_embd=hf.get("hidden_size"),
            head_dim=get(hf, "head_dim"),
            vocab_size=hf.get("vocab_size"),
            bias=False,
            mlp="swiglu",
            mlp_hidden=hf.get("intermediate_size"),
            rope_base=theta,
            rope_scaling=scaling,
            norm_eps=get(hf, "rms_norm_eps", default=1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )

    # ------------------------------------------------------------------------------------------- export
    def export_problems(self, config: GPTConfig) -> Iterator[str]:
        yield from self.qk_norm_problems(config, self.hf_class)
        yield from super().export_problems(config)
        if config.mlp == "gelu":
            yield (
                f"mlp=gelu with arch llama: {self.hf_class}'s MLP is always gated (SwiGLU); use arch gpt for a GELU MLP"
            )
        if config.bias:  # LlamaConfig has attention_bias/mlp_bias, but the mapping here is for bias-free models
            yield (
                f"bias=true with arch llama: minigpt exports {self.hf_class} models without biases only; train with "
                "bias false"
            )
        if config.qkv_bias and not self.qkv_bias:
            yield (
                f"qkv_bias=true: {self.hf_class} has no biases on q/k/v alone (its attention_bias adds o_proj's); "
                "export as Qwen2 (model.family qwen2)"
            )
        if self.qkv_bias and not config.qkv_bias:
            yield (
                f"qkv_bias=false: {self.hf_class}'s q, k and v projections always have biases; train with qkv_bias "
                "true, or leave model.family unset to export as Llama"
            )
        if config.n_embd % config.n_head:  # LlamaConfig checks it even when head_dim is given
            yield (
                f"n_embd={config.n_embd} with n_head={config.n_head}: {self.hf_class}'s config requires n_embd "
                "divisible by n_head (even with an explicit head_dim)"
            )

    def qk_norm_problems(self, config: GPTConfig, target: str) -> Iterator[str]:
        if config.qk_norm and not self.qk_norm:
            yield (
                f"qk_norm=true: {target} has no query/key normalisation; train with qk_norm false, or with "
                "model.family qwen3 to export as Qwen3"
            )
        if self.qk_norm and not config.qk_norm:
            yield (
                f"qk_norm=false: {target} always normalises queries and keys; train with qk_norm true, or leave "
                "model.family unset to export as Llama"
            )

    def hf_config(self, config: GPTConfig) -> dict[str, Any]:
        return {
            **hf_shape(config),
            "hidden_act": "silu",
            "attention_bias": config.bias,
            "mlp_bias": config.bias,
            "attention_dropout": config.dropout,
            **rope_config(config),
        }

    def _splits(self, config: GPTConfig) -> dict[str, list[int]]:
        q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
        return {
            "attn.c_attn.weight": [q, kv, kv],
            "attn.c_attn.bias": [q, kv, kv],
            "mlp.c_fc.weight": [config.mlp_hidden, config.mlp_hidden],
        }

    def to_hf(self, state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        splits = self._splits(config)
        for name, tensor in state.items():
            if name in self.top:
                out[self.top[name]] = tensor
                continue
            _, _, i, rest = name.split(".", 3)  # transformer.h.{i}.rest
            prefix = f"model.layers.{i}."
            if rest in self.fused:
                for hf_name, part in zip(self.fused[rest], tensor.split(splits[rest], dim=0)):
                    out[prefix + hf_name] = part
            else:  # KeyError: a model option with no HF name, which export refuses first (export_problems)
                out[prefix + self.block_names[rest]] = tensor
        return out

    def from_hf(self, hf: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
        top = {v: k for k, v in self.top.items()}
        out = {top[name]: t for name, t in hf.items() if name in top}
        for i in range(config.n_layer):
            prefix, ours = f"model.layers.{i}.", f"transformer.h.{i}."
            for rest, hf_name in self.block_names.items():
                if prefix + hf_name in hf:
                    out[ours + rest] = hf[prefix + hf_name]
            for rest, hf_names in self.fused.items():
                if prefix + hf_names[0] not in hf:  # a tensor this config has not (biases): checked before
                    continue
                # each part's shape was checked against config.json's before (weights.from_hf_state_dict)
                out[ours + rest] = torch.cat([hf[prefix + n] for n in hf_names], dim=0)
        return out

    # ------------------------------------------------------------------------------------------- GGUF
    @property
    def gguf_rope_kinds(self) -> tuple[str, ...]:
        """The RoPE kinds the GGUF export writes for this family: those the import reads, unless a family says less."""
        return self.rope_kinds

    def gguf_problems(self, config: GPTConfig) -> Iterator[str]:
        yield from self.qk_norm_problems(config, self.gguf_target)
        scaling = config.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "longrope" and kind not in self.rope_kinds:  # rope_freqs holds one set of factors, llama3's
            yield (
                f"rope_scaling longrope: {self.gguf_target} holds Llama 3 frequency factors "
                "only; export as Phi-3 (model.family phi3)"
            )
        if kind == "linear":  # rope_freqs would hold it, but minigpt writes Llama 3's factors there only
            yield (
                f"rope_scaling linear: minigpt writes {self.gguf_target} without linear RoPE "
                "scaling; train without rope_scaling (or with model.family gemma3_text to export as Gemma 3)"
            )
        if kind not in (None, *self.gguf_rope_kinds):
            kinds = " or ".join("plain RoPE" if k == "default" else k for k in self.gguf_rope_kinds)
            yield (
                f"rope_scaling {kind}: minigpt writes {self.gguf_target} with {kinds} only (llama.cpp would not "
                "load the file); train without rope_scaling"
            )
        if config.mlp != "swiglu":
            yield (
                f"mlp={config.mlp} with arch llama: llama.cpp's {self.gguf_arch} MLP is always gated (SwiGLU); use "
                "arch gpt for a GELU MLP"
            )

    def gguf_layer(self, get: Any, config: GPTConfig) -> dict[str, torch.Tensor | None]:
        """One block's tensors (weights or biases) by llama.cpp name."""
        layer = {
            "attn_norm": get("ln_1"),
            "ffn_norm": get("ln_2"),
            "attn_output": get("attn.c_proj"),
            "ffn_down": get("mlp.c_proj"),
            "attn_q_norm": get("attn.q_norm"),  # qk_norm: one gain per head_dim, shared by the heads
            "attn_k_norm": get("attn.k_norm"),
        }
        if get("attn.c_attn") is not None:
            q_rows, kv_rows = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
            q, k, v = get("attn.c_attn").split([q_rows, kv_rows, kv_rows])
            if self.gguf_permute:
                q, k = rotary_pairs(q, config.n_head), rotary_pairs(k, config.n_kv_head)
            layer |= {"attn_q": q, "attn_k": k, "attn_v": v}
        if get("mlp.c_fc") is not None:
            layer["ffn_gate"], layer["ffn_up"] = get("mlp.c_fc").chunk(2)
        return layer

    def gguf_tensors(self, state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
        out = {"token_embd.weight": state["transformer.wte.weight"]}
        out |= gguf_blocks(state, config, lambda get: self.gguf_layer(get, config))
        out["output_norm.weight"] = state["transformer.ln_f.weight"]
        if not config.tie_embeddings:
            out["output.weight"] = state["lm_head.weight"]
        scaling = config.rope_scaling
        if scaling is not None and scaling["rope_type"] == "longrope":  # Phi-3's (gguf_problems: phi3 arch only)
            for kind in ("short", "long"):  # llama.cpp divides each frequency by its factor
                out[f"rope_factors_{kind}.weight"] = torch.tensor(scaling[f"{kind}_factor"])
        elif scaling is not None and scaling["rope_type"] == "llama3":  # as the factors llama.cpp divides each by
            exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
            inv_freq = 1.0 / config.rope_base**exponents
            out["rope_freqs.weight"] = inv_freq / llama3_scaled_frequencies(inv_freq, scaling)
        return out

    def gguf_metadata(self, writer: Any, config: GPTConfig) -> None:
        writer.add_layer_norm_rms_eps(config.norm_eps)
        writer.add_rope_freq_base(config.rope_base)
        writer.add_rope_dimension_count(config.head_dim)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
