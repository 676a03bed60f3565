"""Tensor names between minigpt and Hugging Face's GPT2LMHeadModel / LlamaForCausalLM (MistralForCausalLM
uses Llama's names), both ways.

The blocks compute the same functions, so converting is renaming plus three layout changes:
- GPT-2 stores its linear layers as `Conv1D`, (in, out): ours are `nn.Linear`, (out, in), so they transpose;
- Llama keeps q, k and v as three matrices (ours: one `c_attn`, rows q then k then v), and the SwiGLU gate and
  up as two (ours: one `c_fc`, rows gate then up);
- a tied output head is one tensor: HF leaves `lm_head.weight` out of its files, we share it with `wte`.
Both layouts rotate q and k the same way (pairs i and i + hs/2), so no permutation is needed.
"""

from __future__ import annotations

import re

import torch

from minigpt.core.config import GPTConfig
from minigpt.core.errors import CheckpointError
from minigpt.core.model import GPT

__all__ = ["check_unquantized", "from_hf_state_dict", "to_hf_state_dict"]

# minigpt name -> HF name, per block ({i} = layer); GPT-2's HF names equal ours
GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # stored (in, out) by HF
LLAMA_TOP = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "transformer.ln_f.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
LLAMA_BLOCK = {
    "ln_1.weight": "input_layernorm.weight",
    "ln_2.weight": "post_attention_layernorm.weight",
    "attn.c_proj.weight": "self_attn.o_proj.weight",
    "mlp.c_proj.weight": "mlp.down_proj.weight",
}
LLAMA_FUSED = {
    "attn.c_attn.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.c_fc.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def _fused_splits(config: GPTConfig) -> dict[str, list[int]]:
    hs = config.head_dim
    return {
        "attn.c_attn.weight": [config.n_head * hs, config.n_kv_head * hs, config.n_kv_head * hs],
        "mlp.c_fc.weight": [config.mlp_hidden, config.mlp_hidden],
    }


def to_hf_state_dict(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our GPT's state_dict -> the tensors of GPT2LMHeadModel (arch gpt) or LlamaForCausalLM (arch llama)."""
    out: dict[str, torch.Tensor] = {}
    splits = _fused_splits(config)
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_embeddings:
            continue  # the same tensor as the embedding; HF ties it back on load
        if config.arch == "gpt":
            is_conv = name.endswith(".weight") and name.rsplit(".", 1)[0].endswith(GPT2_CONV1D)
            out[name] = tensor.t() if is_conv else tensor
            continue
        if name in LLAMA_TOP:
            out[LLAMA_TOP[name]] = tensor
            continue
        _, _, i, rest = name.split(".", 3)  # transformer.h.{i}.rest
        prefix = f"model.layers.{i}."
        if rest in LLAMA_FUSED:
            for hf_name, part in zip(LLAMA_FUSED[rest], tensor.split(splits[rest], dim=0)):
                out[prefix + hf_name] = part
        else:  # KeyError: a model option with no Llama name, which export refuses first (unsupported_options)
            out[prefix + LLAMA_BLOCK[rest]] = tensor
    return {k: v.contiguous() for k, v in out.items()}


def _ours_from_gpt2(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in hf.items():
        name = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name  # GPT2Model files
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # old transformers saved its causal mask as a buffer
        is_conv = name.endswith(".weight") and name.rsplit(".", 1)[0].endswith(GPT2_CONV1D)
        out[name] = tensor.t() if is_conv else tensor
    return out


def _ours_from_llama(hf: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    top = {v: k for k, v in LLAMA_TOP.items()}
    out = {top[name]: t for name, t in hf.items() if name in top}
    for i in range(config.n_layer):
        prefix, ours = f"model.layers.{i}.", f"transformer.h.{i}."
        for rest, hf_name in LLAMA_BLOCK.items():
            if prefix + hf_name in hf:
                out[ours + rest] = hf[prefix + hf_name]
        for rest, hf_names in LLAMA_FUSED.items():  # every part is there: from_hf_state_dict checked
            parts = [hf[prefix + n] for n in hf_names]
            if len({p.size(1) for p in parts}) != 1:
                raise CheckpointError(
                    f"{prefix}{hf_names[0]} and its siblings disagree in width "
                    f"({', '.join(str(tuple(p.shape)) for p in parts)}); the weights do not "
                    "match config.json"
                )
            out[ours + rest] = torch.cat(parts, dim=0)
    return out


UNQUANTIZED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# the extra tensors quantized checkpoints hold beside their weights (the last part of the name): fp8's
# weight_scale_inv / input_scale, GPTQ and AWQ's qweight, qzeros, scales and g_idx, bitsandbytes' absmax, quant_map,
# SCB and quant_state.bitsandbytes__nf4, compressed-tensors' weight_packed and weight_zero_point
QUANTIZATION_TENSOR = re.compile(
    r"\w*_scale(_inv)?|scales|qweight|qzeros|g_idx|(nested_)?absmax|(nested_)?quant_map"
    r"|SCB|\w*_packed|\w*_zero_point|bitsandbytes__\w+"
)
GPT2_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")  # old GPT-2 files' causal mask, bool or uint8 at times


def check_unquantized(tensors: dict[str, torch.Tensor], source: str) -> None:
    """Refuse quantized weights (fp8, int8, 4-bit: a low-bit dtype, or the scales they come with), which the import
    would otherwise take without their scales: a model computing something else, silently."""
    for name, tensor in tensors.items():
        low_bit = tensor.dtype.itemsize == 1  # fp8, int8, uint8, the packed 4-bit dtypes
        if QUANTIZATION_TENSOR.fullmatch(name.rsplit(".", 1)[-1]):
            what = "a quantization's scale or index, so the weights are quantized"
        elif tensor.dtype in UNQUANTIZED or name.endswith(GPT2_MASK_BUFFERS):
            continue
        elif low_bit or expected_rank(name) is not None:  # extra integer buffers (position ids) are not read
            what = str(tensor.dtype).removeprefix("torch.") + (" (quantized)" if low_bit else "")
        else:
            continue
        raise CheckpointError(
            f"{source}: tensor {name} is {what}: minigpt imports unquantized float weights only; "
            "use the original (bf16/fp32) model"
        )


MATRICES = (
    "c_attn.weight",
    "c_proj.weight",
    "c_fc.weight",
    "_proj.weight",
    "wte.weight",
    "wpe.weight",
    "embed_tokens.weight",
    "lm_head.weight",
)
VECTORS = ("c_attn.bias", "c_proj.bias", "c_fc.bias", "_proj.bias")


def expected_rank(name: str) -> int | None:
    """2 for a projection or embedding matrix, 1 for its bias or a norm's gain, None for anything else a file may
    hold and the conversion does not read (GPT-2's causal-mask buffer attn.bias, a rotary inv_freq)."""
    if name.endswith(MATRICES):
        return 2
    if name.endswith(VECTORS) or (("ln_" in name or "norm" in name) and name.endswith((".weight", ".bias"))):
        return 1
    return None


def hf_shapes(config: GPTConfig, shapes: dict[str, torch.Size] | None = None) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor a Hugging Face file of `config` holds, by its HF name (our shapes, converted on
    the meta device: nothing is allocated).  shapes: our state's shapes for `config`, when already known."""
    shapes = GPT.state_shapes(config) if shapes is None else shapes
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    try:
        return {name: tuple(t.shape) for name, t in to_hf_state_dict(meta, config).items()}
    except KeyError:  # an option with no HF name: the import refuses such configs before this
        return {}


def from_hf_state_dict(
    hf_state: dict[str, torch.Tensor], config: GPTConfig, shapes: dict[str, torch.Size] | None = None
) -> dict[str, torch.Tensor]:
    """HF tensors (GPT-2 or Llama/Mistral names) -> our state_dict for `config`, every name and shape checked:
    a missing tensor or a shape that disagrees with the config is one line naming it.  shapes: our state's shapes
    for `config` (GPT.state_shapes), when the caller has them from a model it built already."""
    shapes = GPT.state_shapes(config) if shapes is None else shapes
    wanted = hf_shapes(config, shapes)
    for name, tensor in hf_state.items():  # before any transpose or concatenation would trip over it
        rank = expected_rank(name)
        if rank is not None and isinstance(tensor, torch.Tensor) and tensor.dim() != rank:
            shape = wanted.get(name, wanted.get("transformer." + name))  # GPT2Model files lack the prefix
            expected = f"config.json implies {shape}" if shape else f"this kind of weight has {rank}"
            raise CheckpointError(
                f"tensor {name} has {tensor.dim()} dimension(s) {tuple(tensor.shape)}, where "
                f"{expected}; the weight files are damaged or belong to another model"
            )
    # HF names (GPT2Model files lack the prefix); a tied head is left out of the files, and of `wanted`
    missing = next((n for n in wanted if n not in hf_state and n.removeprefix("transformer.") not in hf_state), None)
    if missing is not None:
        raise CheckpointError(
            f"the weights have no tensor for {missing}; the weight files are incomplete or belong to another model"
        )
    ours = _ours_from_gpt2(hf_state) if config.arch == "gpt" else _ours_from_llama(hf_state, config)
    expected = dict(shapes)  # a copy: the tied head is dropped from it below
    if config.tie_embeddings:
        ours.pop("lm_head.weight", None)  # some files store the tied head anyway: the embedding is the one
        expected.pop("lm_head.weight")
    for name, shape in expected.items():
        if ours[name].shape != shape:
            raise CheckpointError(
                f"tensor {name} has shape {tuple(ours[name].shape)} but config.json implies "
                f"{tuple(shape)}; the weights do not match config.json"
            )
    out = {name: ours[name] for name in expected}
    if config.tie_embeddings:  # load_state_dict(strict=True) wants both names; re-tie after assign=True loads
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out
