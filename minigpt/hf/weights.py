"""Tensor names between minigpt and a Hugging Face family's, both ways, every name and shape checked.

Each family's module (minigpt.hf.families) holds its renaming and layout changes (GPT-2's transposed Conv1D, Llama's
split q/k/v and gate/up...); this module checks what a file holds against the config before and after, and refuses
quantized weights.  A tied output head is one tensor: HF leaves `lm_head.weight` out of its files, we share it with
`wte`.
"""

from __future__ import annotations

import re

import torch

from minigpt.core.config import GPTConfig
from minigpt.core.errors import CheckpointError
from minigpt.core.model import GPT
from minigpt.hf.families import family_of

__all__ = ["check_unquantized", "from_hf_state_dict", "to_hf_state_dict"]


def to_hf_state_dict(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our GPT's state_dict -> the tensors of config's family's HF class (a tied head left out)."""
    if config.tie_embeddings:
        state = {name: t for name, t in state.items() if name != "lm_head.weight"}  # HF ties it back on load
    return {k: v.contiguous() for k, v in family_of(config).to_hf(state, config).items()}


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


LAYER_INDEX = re.compile(r"\.(\d+)\.")  # a block's tensors: transformer.h.N.*, model.layers.N.*


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
    """HF tensors (config's family's names) -> our state_dict for `config`, every name and shape checked:
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
    for name in hf_state:  # a layer past config.json's count: a config that describes fewer layers than the file
        if (found := LAYER_INDEX.search(name)) and int(found[1]) >= config.n_layer:
            first = f"{name[: found.start()]}.0.{name[found.end() :]}"  # the same tensor of layer 0
            if first in wanted or f"transformer.{first}" in wanted:
                raise CheckpointError(
                    f"the weights have a tensor of layer {found[1]} ({name}), but config.json has "
                    f"{config.n_layer} layer{'s' * (config.n_layer != 1)}; the weights do not match config.json"
                )
    for name, shape in wanted.items():  # by the file's own names and shapes, before any fusing or transposing
        name = name if name in hf_state else name.removeprefix("transformer.")
        tensor = hf_state[name]
        if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"tensor {name} has shape {tuple(tensor.shape)} but config.json implies {shape}; "
                "the weights do not match config.json"
            )
    ours = family_of(config).from_hf(hf_state, config)
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
