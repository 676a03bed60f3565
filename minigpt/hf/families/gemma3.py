"""Gemma 3 text (`Gemma3ForCausalLM`, model_type gemma3_text: Gemma 3 270M and 1B): the `llama` block with Gemma's
variants, each a GPTConfig option: token embeddings scaled by sqrt(hidden) (scale_embeddings), a GELU-gated MLP with
tanh GELU (mlp geglu, gelu_approximate tanh), four norms per block (post_norms: HF's post_attention_layernorm is the
attention output's norm, pre_feedforward_layernorm our ln_2), q/k RMSNorm per head (qk_norm), attention scaled by
query_pre_attn_scalar (attn_scale_dim), and sliding-window attention on the layers config.json's layer_types (or its
older sliding_window_pattern) names, with their own RoPE base (rope_local_base).  Gemma 3 4B, 12B and 27B
(`Gemma3ForConditionalGeneration`, model_type gemma3) import text-only (Family.reads): their text_config and the
language model's tensors, the vision tower's never read; they then export as Gemma3ForCausalLM.  Their full layers
scale RoPE linearly (rope_scaling linear, factor 8: GPTConfig.rope_scaling, which scales the rope_base layers only),
the sliding ones rotate at rope_local_base unscaled; llama.cpp's gemma3 reads the same from rope.scaling.type/factor.

Gemma's RMSNorm multiplies by (1 + weight): ours by weight, so a norm gain is HF's + 1 on import (in float32, what
HF's forward computes) and ours - 1 on export (exact for gains in [0.5, 2]; HF then adds the 1 back).  llama.cpp's
`gemma3` architecture stores the gains with the 1 added, as ours; it rotates halves (NEOX rope), so q and k keep their
row order; and it hard-codes what config.json says for HF: every 6th layer full (5, 11, ...), the others sliding with
RoPE base 10000, attention scaled by 1/sqrt(head_dim) (1/sqrt(hidden / heads) for a 62-layer model, Gemma 3 27B).
The GGUF export refuses a model that differs.  Gemma's tokenizer.json is SentencePiece-style BPE (byte fallback, no
dummy prefix), which reads through the HF tokenizer path and goes into a GGUF as llama.cpp's SentencePiece vocabulary
(minigpt.export.gguf_vocab, as Llama 2's)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, get_args

import torch

from minigpt.core.config import GPTConfig, LayerType, is_number
from minigpt.hf.families.base import get
from minigpt.hf.families.llama import FUSED, PEFT_MODULES, Llama, hf_shape

BLOCK = {  # ours -> HF, per block
    "ln_1.weight": "input_layernorm.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "ln_2.weight": "pre_feedforward_layernorm.weight",
    "post_mlp_norm.weight": "post_feedforward_layernorm.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "attn.c_proj.weight": "self_attn.o_proj.weight",
    "mlp.c_proj.weight": "mlp.down_proj.weight",
}
NORMS = ("ln_1.weight", "ln_2.weight", "norm.weight", "ln_f.weight")  # norm.weight: the post norms', q_norm, k_norm
# hidden_activation -> GPTConfig.gelu_approximate (gelu_new is the tanh formula written out)
GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}
# what Gemma3TextConfig assumes of a key config.json leaves out
DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "num_key_value_heads": 4}
# Gemma3ForConditionalGeneration (Gemma 3 4B, 12B, 27B: model_type gemma3) holds the text model's config.json as
# text_config, often only the keys that differ from Gemma3TextConfig's defaults (these), beside a vision tower's
MULTIMODAL = {"Gemma3ForConditionalGeneration": "gemma3"}
TEXT_DEFAULTS = {
    "model_type": "gemma3_text",
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    **DEFAULTS,
}
# its language model's tensors: `language_model.model.` (transformers 4.49, the published files) or
# `model.language_model.` (4.52 on) before Gemma3ForCausalLM's `model.` names; lm_head stays (or is
# `language_model.lm_head`); the vision tower's and the projector's are not read
TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
ROPE_KINDS = ("default", "linear")  # linear on the full layers only (Gemma 3 4B-27B's factor 8)
GGUF_PATTERN, GGUF_LOCAL_BASE = 6, 10000.0  # llama.cpp's gemma3: every 6th layer full, the others at base 10000


def is_norm(name: str) -> bool:
    return name.endswith(NORMS)


def layer_types(hf: dict[str, Any]) -> list[Any]:
    """config.json's layer_types, else the pattern of Gemma3TextConfig's sliding_window_pattern (default 6)."""
    if hf.get("layer_types") is not None:
        return list(hf["layer_types"])
    pattern = get(hf, "sliding_window_pattern", "_sliding_window_pattern", default=6)
    n = hf.get("num_hidden_layers") or 0
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


def rope_params(hf: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each layer type's RoPE parameters: transformers 5's rope_parameters per layer type, else the older rope_theta,
    rope_local_base_freq and rope_scaling (which applies to the full layers), as Gemma3TextConfig reads them."""
    params = hf.get("rope_parameters") or {}
    if not set(params) <= {"full_attention", "sliding_attention"}:  # one flat dict: the full layers'
        params = {"full_attention": params}
    full = {**(params.get("full_attention") or {}), **(hf.get("rope_scaling") or {})}
    sliding = dict(params.get("sliding_attention") or {})
    full.setdefault("rope_theta", get(hf, "rope_theta", default=1e6))
    sliding.setdefault("rope_theta", get(hf, "rope_local_base_freq", default=1e4))
    return {"full_attention": full, "sliding_attention": sliding}


def is_multimodal(hf: dict[str, Any]) -> bool:
    names = hf.get("architectures")
    return names[0] in MULTIMODAL if names else hf.get("model_type") in MULTIMODAL.values()


class Gemma3(Llama):
    model_type = "gemma3_text"
    config_defaults = {}  # Gemma3TextConfig's are read where they are used (DEFAULTS, context)
    hf_class = "Gemma3ForCausalLM"
    reads = MULTIMODAL
    gguf_arch = "gemma3"
    gguf_pre_tokenizer = None  # SentencePiece-style BPE: llama.cpp's SentencePiece vocabulary, no pre-tokenizer
    peft_modules = PEFT_MODULES
    block_names, fused = BLOCK, FUSED
    gguf_permute = False  # NEOX rope: halves, as HF
    rope_kinds = ROPE_KINDS
    qk_norm = True
    sliding_window = True
    geglu = scaled_embeddings = post_norms = attn_scale = True

    # ------------------------------------------------------------------------------------------- import
    def text_config(self, hf: dict[str, Any]) -> dict[str, Any] | None:
        """A Gemma3ForConditionalGeneration's text_config over Gemma3TextConfig's defaults; its head is tied where
        the outer config says (transformers ties by it)."""
        if not is_multimodal(hf):
            return hf
        text = hf.get("text_config")
        if not isinstance(text, dict):
            return None
        return TEXT_DEFAULTS | text | {"tie_word_embeddings": hf.get("tie_word_embeddings", True) is not False}

    def text_weight_name(self, hf: dict[str, Any], name: str) -> str | None:
        if not is_multimodal(hf):
            return name
        if name.startswith("lm_head."):
            return name
        prefix = next((p for p in TEXT_PREFIXES if name.startswith(p)), None)
        return None if prefix is None else TEXT_PREFIXES[prefix] + name.removeprefix(prefix)

    def import_notes(self, hf: dict[str, Any]) -> list[str]:
        if not is_multimodal(hf):
            return []
        return [
            f"the import is text-only: {hf['architectures'][0] if hf.get('architectures') else 'the model'}'s vision "
            f"tower and multimodal projector are not read; the model exports as {self.hf_class}"
        ]

    def import_problems(self, hf: dict[str, Any]) -> Iterator[str]:
        act = get(hf, "hidden_activation", default="gelu_pytorch_tanh")
        if act not in GELU:
            yield f"its hidden_activation is {act!r}; minigpt's GeGLU computes {', '.join(GELU)}"
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hf.get(key) is not None:
                yield f"its config.json sets {key}={hf[key]}, which minigpt does not compute; use a model without it"
        if hf.get("use_bidirectional_attention"):
            yield (
                "its config.json sets use_bidirectional_attention=true (an encoder, EmbeddingGemma's), which minigpt "
                "does not compute; its attention is causal"
            )
        if hf.get("attention_bias"):
            yield "its config.json sets attention_bias=true; minigpt imports Gemma 3 models without biases only"
        yield from self.layer_type_problems(hf)
        for layer, params in rope_params(hf).items():
            kind = params.get("rope_type", params.get("type", "default"))
            if kind not in (ROPE_KINDS if layer == "full_attention" else ROPE_KINDS[:1]):
                yield (
                    f"its RoPE scaling on {layer} layers is {kind!r} (rope_parameters / rope_scaling), which minigpt "
                    "does not compute; it imports Gemma 3 models with plain RoPE on sliding layers and plain or "
                    "linear RoPE on full ones"
                )
            elif kind == "linear" and not is_number(params.get("factor")):
                yield f"its linear RoPE scaling on {layer} layers has no numeric factor ({params.get('factor')!r})"

    def layer_type_problems(self, hf: dict[str, Any]) -> Iterator[str]:
        """Gemma3TextConfig refuses a layer_types that is not one known kind per layer (a list of other names, or of
        another length, would otherwise import as some layout of its own), and a sliding_window_pattern below 1."""
        pattern = get(hf, "sliding_window_pattern", "_sliding_window_pattern", default=6)
        types, n = hf.get("layer_types"), hf.get("num_hidden_layers")
        if types is None and pattern < 1:
            yield f"its config.json's sliding_window_pattern is {pattern}; fix the field (6: every 6th layer full)"
        elif (
            types is not None
            and n is not None
            and (len(types) != n or any(t not in get_args(LayerType) for t in types))
        ):
            yield (
                f"its config.json's layer_types ({str(types)[:60]}) does not name "
                f"{' or '.join(get_args(LayerType))} for each of its {n} layers; fix the field"
            )

    def config_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        types, rope = layer_types(hf), rope_params(hf)
        sliding = "sliding_attention" in types
        head_dim = get(hf, "head_dim", default=DEFAULTS["head_dim"])
        scale_dim = get(hf, "query_pre_attn_scalar", default=DEFAULTS["query_pre_attn_scalar"])
        global_base, local_base = rope["full_attention"]["rope_theta"], rope["sliding_attention"]["rope_theta"]
        # absent: Gemma3TextConfig's default (as Mistral's); null: a sliding layer sees the context
        window = hf.get("sliding_window", DEFAULTS["sliding_window"])
        window = self.context(hf) if window is None else window
        full = rope["full_attention"]
        kind = full.get("rope_type", full.get("type", "default"))
        scaling = None if kind == "default" else {"rope_type": kind, "factor": full["factor"]}
        return dict(
            arch="llama",
            n_layer=hf.get("num_hidden_layers"),
            n_head=hf.get("num_attention_heads"),
            n_kv_head=get(hf, "num_key_value_heads", default=DEFAULTS["num_key_value_heads"]),
            n_embd=hf.get("hidden_size"),
            head_dim=head_dim,
            vocab_size=hf.get("vocab_size"),
            bias=False,
            mlp="geglu",
            gelu_approximate=GELU[get(hf, "hidden_activation", default="gelu_pytorch_tanh")],
            mlp_hidden=hf.get("intermediate_size"),
            rope_base=float(global_base) if isinstance(global_base, int) else global_base,
            rope_scaling=scaling,  # the full layers'; sliding ones rotate at rope_local_base, unscaled
            norm_eps=get(hf, "rms_norm_eps", default=1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            qk_norm=True,
            scale_embeddings=True,
            post_norms=True,
            attn_scale_dim=None if scale_dim == head_dim else scale_dim,
            # the same function written one way: no window where no layer slides, no layer_types where all do, no
            # local base where it is the global one (a model exported from here imports back to an equal config)
            sliding_window=window if sliding else None,
            layer_types=types if sliding and "full_attention" in types else None,
            rope_local_base=float(local_base) if sliding and (local_base != global_base or scaling) else None,
        )

    def context(self, hf: dict[str, Any]) -> int | None:
        return get(hf, "max_position_embeddings", default=131072)

    # ------------------------------------------------------------------------------------------- export
    def export_problems(self, config: GPTConfig) -> Iterator[str]:
        if config.mlp != "geglu":
            yield f"mlp={config.mlp}: {self.hf_class}'s MLP is GELU-gated (GeGLU); train with mlp geglu"
        yield from super().export_problems(config)

    def hf_position_problems(self, config: GPTConfig) -> Iterator[str]:
        if config.partial_rotary_factor != 1.0:  # its default RoPE rotates the whole head whatever the config says
            yield (
                f"partial_rotary_factor={config.partial_rotary_factor:g}: {self.hf_class} rotates every dimension "
                "of a head; train with partial_rotary_factor 1"
            )
        kind = (config.rope_scaling or {}).get("rope_type", (config.rope_scaling or {}).get("type"))
        if kind is not None and kind not in ROPE_KINDS:
            yield (
                f"rope_scaling={kind}: minigpt exports Gemma 3 models with plain or linear RoPE; train without "
                "rope_scaling, or with rope_type linear"
            )
        elif (
            kind is not None
            and config.rope_local_base is None
            and any(config.layer_window(i) for i in range(config.n_layer))
        ):
            yield (
                f"rope_scaling={kind} without rope_local_base: {self.hf_class} never scales its sliding layers' "
                "RoPE; set rope_local_base (the sliding layers' base, unscaled)"
            )

    def hf_config(self, config: GPTConfig) -> dict[str, Any]:
        local_base = config.rope_local_base or config.rope_base
        scaling = None  # the full layers' linear scaling (hf_position_problems refused every other kind)
        if config.rope_scaling is not None:
            scaling = {"rope_type": "linear", "factor": config.rope_scaling["factor"]}
        return {
            **hf_shape(config),
            "hidden_activation": "gelu_pytorch_tanh" if config.gelu_approximate == "tanh" else "gelu",
            "attention_bias": False,
            "attention_dropout": config.dropout,
            "query_pre_attn_scalar": config.attn_scale_dim or config.head_dim,
            "sliding_window": config.sliding_window or config.block_size,  # HF builds a sliding mask regardless
            "layer_types": [
                "full_attention" if config.layer_window(i) is None else "sliding_attention"
                for i in range(config.n_layer)
            ],
            "rope_parameters": {
                "full_attention": {**(scaling or {"rope_type": "default"}), "rope_theta": config.rope_base},
                "sliding_attention": {"rope_type": "default", "rope_theta": local_base},
            },
            # the keys transformers 4, vLLM and llama.cpp's converter read
            "rope_theta": config.rope_base,
            "rope_local_base_freq": local_base,
            "rope_scaling": scaling,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "use_bidirectional_attention": False,
        }

    def to_hf(self, state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
        return super().to_hf({n: t - 1 if is_norm(n) else t for n, t in state.items()}, config)

    def from_hf(self, hf: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
        ours = super().from_hf(hf, config)
        return {n: t.float() + 1 if is_norm(n) else t for n, t in ours.items()}  # float32, as HF's forward adds it

    # ------------------------------------------------------------------------------------------- GGUF
    def gguf_position_problems(self, config: GPTConfig) -> Iterator[str]:
        target = self.gguf_target
        yield from self.hf_position_problems(config)
        slides = [i % GGUF_PATTERN < GGUF_PATTERN - 1 for i in range(config.n_layer)]  # llama.cpp's sliding layers
        windows = [config.layer_window(i) for i in range(config.n_layer)]
        ours = [w is not None and w < config.block_size for w in windows]  # a window past the context: full
        if any(ours) and ours != slides:
            yield (
                f"layer_types: {target} slides on every layer but each {GGUF_PATTERN}th ({GGUF_PATTERN - 1}, "
                f"{2 * GGUF_PATTERN - 1}, ...); train with that pattern, or without sliding_window"
            )
        bases = [config.rope_local_base or config.rope_base if w else config.rope_base for w in windows]
        if any(b != (GGUF_LOCAL_BASE if s else config.rope_base) for b, s in zip(bases, slides)):
            yield (
                f"rope_local_base={config.rope_local_base or config.rope_base:g}: {target} rotates its sliding "
                f"layers (all but each {GGUF_PATTERN}th) with base {GGUF_LOCAL_BASE:g} and the others with "
                f"rope_base; train with rope_local_base {GGUF_LOCAL_BASE:g} and that layer pattern"
            )

    def gguf_problems(self, config: GPTConfig) -> Iterator[str]:
        target = self.gguf_target
        yield from self.qk_norm_problems(config, target)
        if config.mlp != "geglu":
            yield f"mlp={config.mlp}: {target}'s MLP is GELU-gated (GeGLU); train with mlp geglu"
        if config.bias or config.qkv_bias:
            yield f"bias=true: {target} has no biases; train with bias false and qkv_bias false"
        expected = config.n_embd // config.n_head if config.n_layer == 62 else config.head_dim
        if (config.attn_scale_dim or config.head_dim) != expected:
            yield (
                f"attn_scale_dim={config.attn_scale_dim}: {target} scales attention by 1/sqrt({expected}) (head_dim; "
                "n_embd / n_head with 62 layers); leave attn_scale_dim unset"
            )

    def gguf_notes(self, config: GPTConfig) -> list[str]:
        if config.gelu_approximate == "none":  # GeGLU's gate: LLM_FFN_GELU, ggml's tanh form
            return [
                f"the model's exact (erf) GELU runs as llama.cpp's {self.gguf_arch} tanh GELU, a difference of about "
                "1e-3 in the activations"
            ]
        return []

    def gguf_layer(self, get: Any, config: GPTConfig) -> dict[str, torch.Tensor | None]:
        # ffn_norm (llama's ln_2) is the MLP's input norm, pre_feedforward_layernorm; the gains as ours (1 + HF's)
        return super().gguf_layer(get, config) | {
            "post_attention_norm": get("post_attn_norm"),
            "post_ffw_norm": get("post_mlp_norm"),
        }

    def gguf_metadata(self, writer: Any, config: GPTConfig) -> None:
        super().gguf_metadata(writer, config)
        writer.add_sliding_window(min(config.sliding_window or config.block_size, config.block_size))
        if config.rope_scaling is not None:  # linear: llama.cpp's gemma3 scales the full layers' RoPE alone
            from gguf import RopeScalingType  # the GGUF export's optional dependency, there when a writer is

            writer.add_rope_scaling_type(RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(config.rope_scaling["factor"])
