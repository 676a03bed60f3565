"""Hugging Face models as minigpt sources: a model directory (`config.json` + weights + tokenizer files) or
`hf:ORG/NAME` from the hub, read into our GPT and tokenizer.

    model, tok = load_hf_model("hf:openai-community/gpt2")   # or a directory written by save_pretrained
    config = config_from_hf(json.load(open("config.json")))   # GPT2LMHeadModel / LlamaForCausalLM / Mistral...

minigpt.loading.load_model sends such sources here, so sample.py --ckpt, eval.py --ckpt and train.py's
init_from take them too.  The tensor renaming lives in minigpt.hf.weights, the tokenizer in minigpt.hf.tokenizer_files;
this module maps config.json onto GPTConfig and reads the weight files (minigpt.hf.files finds them,
minigpt.hf.hub fetches hub models).

Imported models are float32 whatever the files hold (bf16 sources are upcast): training, precision handling and
the equality checks against transformers all start from float32 weights, as they do for our own checkpoints.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from minigpt.core.config import GPTConfig
from minigpt.core.errors import CheckpointError, UserError, first_line
from minigpt.core.limits import check_config_size, state_shapes
from minigpt.core.model import GPT
from minigpt.core.tokenizers import Tokenizer
from minigpt.core.torch_files import load_torch_file
from minigpt.hf.families import family_field, family_of_hf, hf_classes
from minigpt.hf.files import config_field_problems, read_json_object, weight_files
from minigpt.hf.hub import download_hf
from minigpt.hf.tokenizer_files import load_hf_tokenizer
from minigpt.hf.weights import check_unquantized, from_hf_state_dict

__all__ = [
    "HUB_PREFIX",
    "SUPPORTED_ARCHITECTURES",
    "config_from_hf",
    "load_hf_model",
    "read_hf_weights",
    "resolve_hf_source",
]

HUB_PREFIX = "hf:"
SUPPORTED_ARCHITECTURES = hf_classes()
# where config.json says its weights are quantized (compressed-tensors models wrote the second)
QUANTIZATION_KEYS = ("quantization_config", "compression_config")


# ------------------------------------------------------------------------------------------------ config.json


def hf_architecture(hf_config: dict[str, Any]) -> str | None:
    """The model class config.json names: its `architectures`, else its `model_type`'s class (None: neither)."""
    names, model_type = hf_config.get("architectures"), hf_config.get("model_type")
    if names:
        return str(names[0])
    if model_type is None:
        return None
    family = family_of_hf(hf_config)
    if family is None:
        return f"model_type {model_type!r}"
    return next((name for name, kind in family.reads.items() if kind == model_type), family.hf_class)


def unsupported(hf: dict[str, Any], block_size: int | None = None) -> Iterator[str]:
    """Why minigpt cannot import the model config.json describes (as GPTConfig.problems, one message each, the
    first one is raised): a field of the wrong JSON type, an architecture or a variant our blocks do not compute
    (the family says which), a quantized model (its weights need scales our float model has no place for), a
    block_size past the source's."""
    if fields := [f"its config.json: {problem}" for problem in config_field_problems(hf)]:
        yield from fields  # the rules below read the fields as their types
        return
    architecture, family = hf_architecture(hf), family_of_hf(hf)
    if architecture is None:
        yield (
            "its config.json names no architecture (no `architectures`, no `model_type`), so it is not a Hugging "
            "Face model's; pass a model directory written by save_pretrained"
        )
    elif family is None:
        yield (
            f"its architecture is {architecture}, which minigpt cannot import; it imports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    else:
        for key in QUANTIZATION_KEYS:  # check_unquantized refuses the tensors of a model that does not say so
            if (spec := hf.get(key)) is not None:
                method = spec.get("quant_method") if isinstance(spec, dict) else None
                if method is None and isinstance(spec, dict) and (spec.get("load_in_4bit") or spec.get("load_in_8bit")):
                    method = "bitsandbytes"
                yield (
                    f"its config.json has {key} ({str(method or spec)[:40]}): minigpt imports unquantized float "
                    "weights only; use the original (bf16/fp32) model"
                )
        text = family.text_config(hf)  # a multimodal class's text model (Family.reads), else hf
        if text is None:
            yield f"its config.json ({architecture}) has no text_config object; pass the folder save_pretrained wrote"
            return
        if text is not hf and (fields := [f"its text_config: {problem}" for problem in config_field_problems(text)]):
            yield from fields
            return
        yield from family.import_problems(text)
        if block_size is not None:
            yield from family.block_size_problems(text, block_size)


def config_from_hf(hf_config: dict[str, Any], block_size: int | None = None, **overrides: Any) -> GPTConfig:
    """A Hugging Face config.json (as a dict) -> the GPTConfig computing the same function.

    block_size: a shorter context than the source's (learned positions are cropped to it); a longer one is an
    error (a family may cap it: Phi-3's LongRoPE at original_max_position_embeddings, past which it is not ours).
    overrides: other GPTConfig fields, e.g. attention='manual'.
    """
    for problem in unsupported(hf_config, block_size):
        raise CheckpointError(problem)
    family = family_of_hf(hf_config)
    text = family.text_config(hf_config)
    fields = family.config_fields(text) | {"family": family_field(family)}
    fields["block_size"] = block_size if block_size is not None else family.context(text)
    try:
        return GPTConfig(**{**fields, **overrides})
    except (UserError, TypeError) as e:  # TypeError: a null where a number belongs
        raise CheckpointError(f"its config.json gives no usable model ({first_line(e)})") from None


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(
            f"{model_dir} has no config.json; a Hugging Face model directory holds config.json "
            "and the weight files (as written by save_pretrained)"
        )
    return read_json_object(path)


# ------------------------------------------------------------------------------------------------ weight files


def _read_safetensors(path: Path, rename: Callable[[str], str | None] | None = None) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    rename = rename or (lambda name: name)
    try:
        # pread, not mmap: the tensors own their memory, so a model trained in place never writes into (or
        # crashes with SIGBUS on) a file that is replaced or truncated under it
        with safe_open(path, framework="pt", backend="pread") as f:
            return {new: f.get_tensor(name) for name in f.keys() if (new := rename(name)) is not None}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            f"cannot read {path}: it is truncated or not a safetensors file ({first_line(e, 120)});"
            " download the model again"
        ) from None


def _read_bin(path: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin, read as minigpt's own checkpoints are (minigpt.core.torch_files)."""
    state = load_torch_file(
        path, fix="use the model's safetensors weights, or download it again", damaged_fix="download the model again"
    )
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} is not a state dict of tensors; download the model again")
    return state


def read_hf_weights(files: list[Path], rename: Callable[[str], str | None] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the weight files (see weight_files), by its Hugging Face name; with `rename`, by the name it
    gives, and only those it names (a multimodal model's text weights: the others are never read)."""
    state: dict[str, torch.Tensor] = {}
    for path in files:
        tensors = _read_safetensors(path, rename) if path.suffix == ".safetensors" else _read_bin(path)
        if rename is not None and path.suffix != ".safetensors":
            tensors = {new: t for name, t in tensors.items() if (new := rename(name)) is not None}
        check_unquantized(tensors, str(path))  # before the next shard is read
        state.update(tensors)
    return state


def resolve_hf_source(source: str | Path) -> tuple[Path, str]:
    """A model directory or hf:ORG/NAME[@REVISION] -> (local directory, the name to show and to call its
    tokenizer)."""
    text = str(source)
    if not text.startswith(HUB_PREFIX):
        return Path(source), Path(source).name or str(source)
    repo_id, _, revision = text[len(HUB_PREFIX) :].partition("@")  # huggingface_hub checks the id (download_hf)
    return download_hf(repo_id, revision or None), repo_id


# ------------------------------------------------------------------------------------------------ the model


def source_shapes(skeleton: GPT, source_config: GPTConfig) -> dict[str, torch.Size]:
    """Our state's shapes for the source's config, from the meta model of the config we build (skeleton): the two
    differ at most in block_size, which in a state dict is only the learned positions' rows (RoPE's tables are not
    in it), so the source's shapes need no second model."""
    shapes = state_shapes(skeleton)
    if "transformer.wpe.weight" in shapes:
        shapes["transformer.wpe.weight"] = torch.Size((source_config.block_size, source_config.n_embd))
    return shapes


def _our_weights(
    hf_state: dict[str, torch.Tensor], source_config: GPTConfig, config: GPTConfig, skeleton: GPT
) -> dict[str, torch.Tensor]:
    """The HF tensors renamed and checked against the source's config, then each made a contiguous float32 tensor
    of its own, one at a time, so that each source tensor (a GPT-2 Conv1D's, transposed; a bf16 one) is freed as
    soon as its copy exists: the weights are held about once, never three times.  skeleton: config's meta model."""
    state = from_hf_state_dict(hf_state, source_config, source_shapes(skeleton, source_config))
    hf_state.clear()  # from here on, only `state` keeps the file's tensors alive
    if config.tie_embeddings:
        del state["lm_head.weight"]  # the embedding itself: converted once, tied again by GPT.from_weights
    if "transformer.wpe.weight" in state:  # learned positions beyond a shorter context are dropped
        state["transformer.wpe.weight"] = state["transformer.wpe.weight"][: config.block_size].clone()
    for name in list(state):
        state[name] = state[name].to(torch.float32).contiguous()
    if config.tie_embeddings:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def load_hf_model(
    source: str | Path, device: str | torch.device = "cpu", attention: str | None = None, block_size: int | None = None
) -> tuple[GPT, Tokenizer]:
    """A Hugging Face model directory or hf:ORG/NAME -> (GPT in eval mode, float32, its tokenizer).

    attention picks the attention path; block_size a shorter context than the source's.  Every problem (an
    unsupported architecture, a missing or truncated file, a tensor that disagrees with config.json, a hub id
    while offline) is a CheckpointError of one line naming the source.
    """

    model_dir, name = resolve_hf_source(source)
    label = f"hf:{name}" if str(source).startswith(HUB_PREFIX) else str(source)
    try:
        hf_config = read_hf_config(model_dir)
        overrides = {"attention": attention} if attention is not None else {}
        source_config = config_from_hf(hf_config, **overrides)  # the shapes the files must have
        config = config_from_hf(hf_config, block_size, **overrides)
        # before anything is read; the meta model it measured is the one this load fills
        skeleton = check_config_size(config, "its config.json", CheckpointError)
        files = weight_files(model_dir)  # missing weights are named before the tokenizer may reach for a download
        family = family_of_hf(hf_config)
        text = family.text_config(hf_config)  # a multimodal model's text part: its vocab_size, token ids
        tokenizer = load_hf_tokenizer(model_dir, {**hf_config, **text, "_name_or_path": name})  # before the big read
        hf_state = read_hf_weights(files, functools.partial(family.text_weight_name, hf_config))
        model = GPT.from_weights(config, _our_weights(hf_state, source_config, config, skeleton), skeleton)
        for note in family.import_notes(hf_config):
            print(f"note: {label}: {note}", file=sys.stderr, flush=True)
    except UserError as e:
        message = first_line(e, 1000)
        raise CheckpointError(message if message.startswith(label) else f"{label}: {message}") from None
    return model.to(device).eval(), tokenizer
