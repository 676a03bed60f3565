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

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from minigpt.core.config import GPTConfig
from minigpt.core.errors import CheckpointError, UserError, first_line
from minigpt.core.limits import check_config_size, state_shapes
from minigpt.core.model import GPT
from minigpt.core.tokenizers import Tokenizer
from minigpt.core.torch_files import load_torch_file
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
SUPPORTED_ARCHITECTURES = ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM")
MODEL_TYPES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
# where config.json says its weights are quantized (compressed-tensors models wrote the second)
QUANTIZATION_KEYS = ("quantization_config", "compression_config")
# GPT-2's activation_function -> our gelu_approximate (gelu_new, gelu_fast and gelu_pytorch_tanh are one formula)
GPT2_GELU = {
    "gelu_new": "tanh",
    "gelu_fast": "tanh",
    "gelu_pytorch_tanh": "tanh",
    "gelu": "none",
    "gelu_python": "none",
}


# ------------------------------------------------------------------------------------------------ config.json


def hf_architecture(hf_config: dict[str, Any]) -> str | None:
    """The model class config.json names: its `architectures`, else its `model_type`'s class (None: neither)."""
    names, model_type = hf_config.get("architectures"), hf_config.get("model_type")
    if names:
        return str(names[0])
    return None if model_type is None else MODEL_TYPES.get(model_type, f"model_type {model_type!r}")


def _get(hf_config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of `keys` config.json sets to something other than null (configs rename keys across versions)."""
    return next((hf_config[k] for k in keys if hf_config.get(k) is not None), default)


def _context(hf: dict[str, Any], architecture: str) -> int | None:
    """The source's context in tokens; a Mistral model's is capped at its sliding window, inside which its
    attention is ours (exact: within the window, sliding and full attention agree)."""
    if architecture == "GPT2LMHeadModel":
        return _get(hf, "n_positions", "n_ctx", "max_position_embeddings")
    context, window = hf.get("max_position_embeddings"), hf.get("sliding_window")
    if architecture == "MistralForCausalLM" and window is not None and context is not None:
        return min(context, window)
    return context


def _rope_readings(hf: dict[str, Any]) -> dict[str, tuple[Any, str, dict[str, Any]]]:
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


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, scaling dict or None) of a config.json that unsupported() passed."""
    theta, kind, rest = next(iter(_rope_readings(hf).values()), (hf.get("rope_theta"), "default", {}))
    theta = 10000.0 if theta is None else theta
    theta = float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else theta  # else refused
    if kind == "default":
        return theta, None
    return theta, {k: v for k, v in rest.items() if k != "partial_rotary_factor"} | {"rope_type": kind}


def _rope_problems(hf: dict[str, Any]) -> Iterator[str]:
    """A file holding both RoPE forms, or two rope_theta, is read one way by transformers 4 (rope_scaling and the
    top-level rope_theta) and another by transformers 5 (rope_scaling over rope_parameters, the rope_theta inside
    over the top-level one): unless the two agree, it is refused, never guessed.  Every rope_type but llama3 is
    refused too (linear, dynamic, yarn...)."""
    top_theta, readings = hf.get("rope_theta"), _rope_readings(hf)
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
    if kind not in ("default", "llama3"):
        yield (
            f"its RoPE scaling is {kind!r}, which minigpt does not compute; it imports plain RoPE and rope_type "
            "llama3 (Llama 3.1/3.2)"
        )


def unsupported(hf: dict[str, Any], block_size: int | None = None) -> Iterator[str]:
    """Why minigpt cannot import the model config.json describes (as GPTConfig.problems, one message each, the
    first one is raised): a field of the wrong JSON type, an architecture or a variant our blocks do not compute,
    a quantized model (its weights need scales our float model has no place for), a block_size past the source's."""
    if fields := [f"its config.json: {problem}" for problem in config_field_problems(hf)]:
        yield from fields  # the rules below read the fields as their types
        return
    architecture = hf_architecture(hf)
    if architecture is None:
        yield (
            "its config.json names no architecture (no `architectures`, no `model_type`), so it is not a Hugging "
            "Face model's; pass a model directory written by save_pretrained"
        )
    elif architecture not in SUPPORTED_ARCHITECTURES:
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
        if architecture == "GPT2LMHeadModel":
            yield from _gpt2_problems(hf)
        else:
            yield from _llama_problems(hf)
        window, context = hf.get("sliding_window"), _context(hf, architecture)
        mistral = architecture == "MistralForCausalLM"
        if mistral and window is not None and block_size is not None and block_size > window:
            yield (
                f"it attends within a sliding window of {window} tokens, so a block_size of {block_size} would "
                f"compute another function than the source; ask for a block_size of at most {window}"
            )
        elif block_size is not None and context is not None and block_size > context:
            yield (
                f"block_size {block_size} is longer than the source's context of {context} tokens; ask for at "
                f"most {context}"
            )


def _gpt2_problems(hf: dict[str, Any]) -> Iterator[str]:
    activation = hf.get("activation_function", "gelu_new")
    if GPT2_GELU.get(activation) is None:
        yield f"its activation_function is {activation!r}; minigpt's GPT-2 block computes {', '.join(GPT2_GELU)} only"
    # attention variants GPT-2's class can be switched to, which our block does not compute (reorder_and_upcast_attn
    # is not one: it computes the same scores in float32, as our float32 model does)
    for key, ours in (
        ("scale_attn_by_inverse_layer_idx", False),
        ("scale_attn_weights", True),
        ("add_cross_attention", False),
    ):
        if bool(hf.get(key, ours)) != ours:
            yield (
                f"its config.json sets {key}={hf.get(key)!r}, which minigpt's GPT-2 block does not compute; only "
                f"{key}={str(ours).lower()} imports"
            )


def _llama_problems(hf: dict[str, Any]) -> Iterator[str]:
    if hf.get("hidden_act", "silu") != "silu":
        yield f"its hidden_act is {hf.get('hidden_act')!r}; minigpt's SwiGLU MLP computes silu only"
    for key in ("attention_bias", "mlp_bias"):  # our bias is all-or-nothing, and Llama checkpoints have none
        if hf.get(key):
            yield f"its config.json sets {key}=true; minigpt imports Llama-family models without biases only"
    yield from _rope_problems(hf)


def _gpt2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    n_embd = _get(hf, "n_embd", "hidden_size")
    return dict(
        arch="gpt",
        n_layer=_get(hf, "n_layer", "num_hidden_layers"),
        n_head=_get(hf, "n_head", "num_attention_heads"),
        n_embd=n_embd,
        vocab_size=hf.get("vocab_size"),
        bias=True,
        mlp="gelu",
        gelu_approximate=GPT2_GELU[hf.get("activation_function", "gelu_new")],
        mlp_hidden=_get(hf, "n_inner", default=4 * n_embd if isinstance(n_embd, int) else None),
        norm_eps=_get(hf, "layer_norm_epsilon", default=1e-5),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def _llama_fields(hf: dict[str, Any]) -> dict[str, Any]:
    theta, scaling = _rope(hf)
    n_head = hf.get("num_attention_heads")
    return dict(
        arch="llama",
        n_layer=hf.get("num_hidden_layers"),
        n_head=n_head,
        n_kv_head=_get(hf, "num_key_value_heads", default=n_head),
        n_embd=hf.get("hidden_size"),
        head_dim=_get(hf, "head_dim"),
        vocab_size=hf.get("vocab_size"),
        bias=False,
        mlp="swiglu",
        mlp_hidden=hf.get("intermediate_size"),
        rope_base=theta,
        rope_scaling=scaling,
        norm_eps=_get(hf, "rms_norm_eps", default=1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def config_from_hf(hf_config: dict[str, Any], block_size: int | None = None, **overrides: Any) -> GPTConfig:
    """A Hugging Face config.json (as a dict) -> the GPTConfig computing the same function.

    block_size: a shorter context than the source's (learned positions are cropped to it); a longer one is an
    error.  A Mistral model's context is capped at its sliding window, inside which its attention is ours.
    overrides: other GPTConfig fields, e.g. attention='manual'.
    """
    for problem in unsupported(hf_config, block_size):
        raise CheckpointError(problem)
    architecture = hf_architecture(hf_config)
    fields = _gpt2_fields(hf_config) if architecture == "GPT2LMHeadModel" else _llama_fields(hf_config)
    fields["block_size"] = block_size if block_size is not None else _context(hf_config, architecture)
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


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        # pread, not mmap: the tensors own their memory, so a model trained in place never writes into (or
        # crashes with SIGBUS on) a file that is replaced or truncated under it
        with safe_open(path, framework="pt", backend="pread") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
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
        tokenizer = load_hf_tokenizer(model_dir, {**hf_config, "_name_or_path": name})  # before the big read
        model = GPT.from_weights(
            config, _our_weights(read_hf_weights(files), source_config, config, skeleton), skeleton
        )
    except UserError as e:
        message = first_line(e, 1000)
        raise CheckpointError(message if message.startswith(label) else f"{label}: {message}") from None
    return model.to(device).eval(), tokenizer
