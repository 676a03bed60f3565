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

import re
from pathlib import Path
from typing import Any

import torch

from minigpt.core.torch_files import load_torch_file
from minigpt.core.limits import check_config_size
from minigpt.core.config import GPTConfig
from minigpt.core.errors import CheckpointError, UserError, first_line
from minigpt.hf.files import check_config_fields, read_json_object, weight_files
from minigpt.hf.hub import download_hf
from minigpt.hf.tokenizer_files import load_hf_tokenizer
from minigpt.hf.weights import check_unquantized, from_hf_state_dict
from minigpt.core.model import GPT
from minigpt.core.tokenizers import Tokenizer

__all__ = ["HUB_PREFIX", "SUPPORTED_ARCHITECTURES", "config_from_hf", "load_hf_model", "read_hf_weights",
           "resolve_hf_source"]

HUB_PREFIX = "hf:"
SUPPORTED_ARCHITECTURES = ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM")
MODEL_TYPES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
# where config.json says its weights are quantized (compressed-tensors models wrote the second)
QUANTIZATION_KEYS = ("quantization_config", "compression_config")
# GPT-2's activation_function -> our gelu_approximate (gelu_new, gelu_fast and gelu_pytorch_tanh are one formula)
GPT2_GELU = {"gelu_new": "tanh", "gelu_fast": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none",
             "gelu_python": "none"}


# ------------------------------------------------------------------------------------------------ config.json

def hf_architecture(hf_config: dict[str, Any]) -> str:
    """The model class config.json names (its `architectures`, else its `model_type`), if minigpt reads it."""
    names, model_type = hf_config.get("architectures"), hf_config.get("model_type")
    if isinstance(names, list) and names:
        found = str(names[0])
    elif model_type is not None:
        found = MODEL_TYPES.get(model_type, f"model_type {model_type!r}")
    else:
        raise CheckpointError("its config.json names no architecture (no `architectures`, no `model_type`), so it is "
                              "not a Hugging Face model's; pass a model directory written by save_pretrained")
    if found not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"its architecture is {found}, which minigpt cannot import; it imports "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return found


def _get(hf_config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of `keys` config.json sets to something other than null (configs rename keys across versions)."""
    return next((hf_config[k] for k in keys if hf_config.get(k) is not None), default)


def _gpt2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    activation = hf.get("activation_function", "gelu_new")
    if GPT2_GELU.get(activation) is None:
        raise CheckpointError(f"its activation_function is {activation!r}; minigpt's GPT-2 block computes "
                              f"{', '.join(GPT2_GELU)} only")
    # attention variants GPT-2's class can be switched to, which our block does not compute (reorder_and_upcast_attn
    # is not one: it computes the same scores in float32, as our float32 model does)
    for key, ours in (("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True),
                      ("add_cross_attention", False)):
        if bool(hf.get(key, ours)) != ours:
            raise CheckpointError(f"its config.json sets {key}={hf.get(key)!r}, which minigpt's GPT-2 block does "
                                  f"not compute; only {key}={str(ours).lower()} imports")
    n_embd = _get(hf, "n_embd", "hidden_size")
    return dict(arch="gpt", n_layer=_get(hf, "n_layer", "num_hidden_layers"),
                n_head=_get(hf, "n_head", "num_attention_heads"), n_embd=n_embd,
                block_size=_get(hf, "n_positions", "n_ctx", "max_position_embeddings"),
                vocab_size=hf.get("vocab_size"), bias=True, mlp="gelu", gelu_approximate=GPT2_GELU[activation],
                mlp_hidden=_get(hf, "n_inner", default=4 * n_embd if isinstance(n_embd, int) else None),
                norm_eps=_get(hf, "layer_norm_epsilon", default=1e-5),
                tie_embeddings=bool(hf.get("tie_word_embeddings", True)))


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, scaling dict or None), read as every transformers version reads config.json, else refused.

    transformers 5 writes `rope_parameters` with rope_theta inside; older versions wrote a top-level `rope_theta`
    and a `rope_scaling` dict (whose kind is `rope_type`, or `type` before that).  A file holding both forms, or
    two rope_theta, is read one way by transformers 4 (rope_scaling and the top-level rope_theta) and another by
    transformers 5 (rope_scaling over rope_parameters, the rope_theta inside over the top-level one): unless the
    two agree, it is refused, never guessed.  Every rope_type but llama3 is refused too (linear, dynamic, yarn...)."""
    top_theta = hf.get("rope_theta")
    readings = {}  # field -> (theta, kind, the other parameters)
    for key in ("rope_parameters", "rope_scaling"):
        params = hf.get(key)
        if not params:  # null or {}: transformers takes it for absent
            continue
        if not isinstance(params, dict):
            raise CheckpointError(f"its {key} is {str(params)[:60]}, not a dict; the config.json is damaged")
        theta = params.get("rope_theta", top_theta)
        if top_theta is not None and theta != top_theta:
            raise CheckpointError(f"its config.json gives rope_theta {top_theta} at the top level and {theta} in "
                                  f"{key}; transformers 4 reads the first, transformers 5 the second: keep the one "
                                  "the model was trained with")
        kind = params.get("rope_type", params.get("type", "default"))
        readings[key] = (theta, kind, {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type", "type")})
    if len(readings) == 2 and readings["rope_parameters"] != readings["rope_scaling"]:
        raise CheckpointError(f"its config.json holds both rope_parameters ({str(hf['rope_parameters'])[:80]}) and "
                              f"rope_scaling ({str(hf['rope_scaling'])[:80]}), which disagree; transformers 5 reads "
                              "rope_scaling over rope_parameters, other versions one or the other: keep the one the "
                              "model was trained with")
    theta, kind, rest = next(iter(readings.values()), (top_theta, "default", {}))
    theta = 10000.0 if theta is None else theta
    theta = float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else theta
    partial = rest.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise CheckpointError(f"its config.json sets partial_rotary_factor {partial}; minigpt's RoPE rotates the "
                              "whole head (factor 1.0) only")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"its RoPE scaling is {kind!r}, which minigpt does not compute; it imports plain RoPE "
                              "and rope_type llama3 (Llama 3.1/3.2)")
    return theta, {k: v for k, v in rest.items() if k != "partial_rotary_factor"} | {"rope_type": kind}


def _llama_fields(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"its hidden_act is {hf.get('hidden_act')!r}; minigpt's SwiGLU MLP computes silu only")
    for key in ("attention_bias", "mlp_bias"):  # our bias is all-or-nothing, and Llama checkpoints have none
        if hf.get(key):
            raise CheckpointError(f"its config.json sets {key}=true; minigpt imports Llama-family models without "
                                  "biases only")
    theta, scaling = _rope(hf)
    n_embd, n_head = hf.get("hidden_size"), hf.get("num_attention_heads")
    return dict(arch="llama", n_layer=hf.get("num_hidden_layers"), n_head=n_head,
                n_kv_head=_get(hf, "num_key_value_heads", default=n_head), n_embd=n_embd,
                head_dim=_get(hf, "head_dim"), block_size=hf.get("max_position_embeddings"),
                vocab_size=hf.get("vocab_size"), bias=False, mlp="swiglu", mlp_hidden=hf.get("intermediate_size"),
                rope_base=theta, rope_scaling=scaling, norm_eps=_get(hf, "rms_norm_eps", default=1e-6),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _refuse_quantized(hf: dict[str, Any]) -> None:
    """A quantized model's weights need their scales, which minigpt's float model has no place for: refused from
    config.json before a weight is read (check_unquantized refuses the tensors of one that does not say so)."""
    for key in QUANTIZATION_KEYS:
        spec = hf.get(key)
        if spec is None:
            continue
        method = spec.get("quant_method") if isinstance(spec, dict) else None
        if method is None and isinstance(spec, dict) and (spec.get("load_in_4bit") or spec.get("load_in_8bit")):
            method = "bitsandbytes"
        raise CheckpointError(f"its config.json has {key} ({str(method or spec)[:40]}): minigpt imports unquantized "
                              "float weights only; use the original (bf16/fp32) model")


def config_from_hf(hf_config: dict[str, Any], block_size: int | None = None, **overrides: Any) -> GPTConfig:
    """A Hugging Face config.json (as a dict) -> the GPTConfig computing the same function.

    block_size: a shorter context than the source's (learned positions are cropped to it); a longer one is an
    error.  A Mistral model's context is capped at its sliding window, inside which its attention is ours.
    overrides: other GPTConfig fields, e.g. attention='manual'.
    """
    architecture = hf_architecture(hf_config)
    _refuse_quantized(hf_config)
    fields = _gpt2_fields(hf_config) if architecture == "GPT2LMHeadModel" else _llama_fields(hf_config)
    source_block = fields["block_size"]
    if architecture == "MistralForCausalLM":
        window = hf_config.get("sliding_window")
        if window is not None and block_size is not None and block_size > window:
            raise CheckpointError(f"it attends within a sliding window of {window} tokens, so a block_size of "
                                  f"{block_size} would compute another function than the source; ask for a "
                                  f"block_size of at most {window}")
        if isinstance(window, int) and isinstance(source_block, int):
            source_block = min(source_block, window)  # exact: within the window, sliding and full attention agree
    if block_size is not None:
        if isinstance(source_block, int) and block_size > source_block:
            raise CheckpointError(f"block_size {block_size} is longer than the source's context of {source_block} "
                                  f"tokens; ask for at most {source_block}")
        source_block = block_size
    fields["block_size"] = source_block
    try:
        return GPTConfig(**{**fields, **overrides})
    except UserError as e:
        raise CheckpointError(f"its config.json gives an unusable model ({first_line(e)})") from None
    except TypeError as e:  # a null or a string where a number belongs
        raise CheckpointError(f"its config.json is damaged or incomplete ({first_line(e)})") from None


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json; a Hugging Face model directory holds config.json "
                              "and the weight files (as written by save_pretrained)")
    hf_config = read_json_object(path)
    check_config_fields(hf_config, path)
    return hf_config


# ------------------------------------------------------------------------------------------------ weight files

def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        # pread, not mmap: the tensors own their memory, so a model trained in place never writes into (or
        # crashes with SIGBUS on) a file that is replaced or truncated under it
        with safe_open(path, framework="pt", backend="pread") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {path}: it is truncated or not a safetensors file ({first_line(e, 120)});"
                              " download the model again") from None


def _read_bin(path: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin, read as minigpt's own checkpoints are (minigpt.core.torch_files)."""
    state = load_torch_file(path, fix="use the model's safetensors weights, or download it again",
                            damaged_fix="download the model again")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} is not a state dict of tensors; download the model again")
    return state


def read_hf_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of the weight files (see weight_files), by its Hugging Face name."""
    state: dict[str, torch.Tensor] = {}
    for path in files:
        tensors = _read_safetensors(path) if path.suffix == ".safetensors" else _read_bin(path)
        check_unquantized(tensors, str(path))  # before the next shard is read
        state.update(tensors)
    return state


def resolve_hf_source(source: str | Path) -> tuple[Path, str]:
    """A model directory or hf:ORG/NAME[@REVISION] -> (local directory, the name to show and to call its
    tokenizer)."""
    text = str(source)
    if not text.startswith(HUB_PREFIX):
        return Path(source), Path(source).name or str(source)
    repo_id, _, revision = text[len(HUB_PREFIX):].partition("@")
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", repo_id):
        raise CheckpointError(f"{text!r} is not a hub model id; write hf:ORG/NAME, e.g. hf:openai-community/gpt2")
    return download_hf(repo_id, revision or None), repo_id


# ------------------------------------------------------------------------------------------------ the model

def _our_weights(hf_state: dict[str, torch.Tensor], source_config: GPTConfig,
                 config: GPTConfig) -> dict[str, torch.Tensor]:
    """The HF tensors renamed and checked against the source's config, then each made a contiguous float32 tensor
    of its own, one at a time, so that each source tensor (a GPT-2 Conv1D's, transposed; a bf16 one) is freed as
    soon as its copy exists: the weights are held about once, never three times."""
    state = from_hf_state_dict(hf_state, source_config)
    hf_state.clear()  # from here on, only `state` keeps the file's tensors alive
    if config.tie_embeddings:
        del state["lm_head.weight"]  # the embedding itself: converted once, tied again by GPT.from_weights
    if "transformer.wpe.weight" in state:  # learned positions beyond a shorter context are dropped
        state["transformer.wpe.weight"] = state["transformer.wpe.weight"][:config.block_size].clone()
    for name in list(state):
        state[name] = state[name].to(torch.float32).contiguous()
    if config.tie_embeddings:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def load_hf_model(source: str | Path, device: str | torch.device = "cpu", attention: str | None = None,
                  block_size: int | None = None) -> tuple[GPT, Tokenizer]:
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
        check_config_size(config, "its config.json", CheckpointError)  # before anything is built or read
        files = weight_files(model_dir)  # missing weights are named before the tokenizer may reach for a download
        tokenizer = load_hf_tokenizer(model_dir, {**hf_config, "_name_or_path": name})  # before the big read
        model = GPT.from_weights(config, _our_weights(read_hf_weights(files), source_config, config))
    except UserError as e:
        message = first_line(e, 1000)
        raise CheckpointError(message if message.startswith(label) else f"{label}: {message}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"{label}: its tokenizer has {tokenizer.vocab_size} tokens but the model only "
                              f"{config.vocab_size}; the tokenizer is not this model's")
    return model.to(device).eval(), tokenizer
