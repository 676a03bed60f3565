"""Hugging Face models as minigpt sources: a model directory (`config.json` + weights + tokenizer files) or
`hf:ORG/NAME` from the hub, read into our GPT and tokenizer.

    model, tok = load_hf_model("hf:openai-community/gpt2")   # or a directory written by save_pretrained
    config = config_from_hf(json.load(open("config.json")))   # GPT2LMHeadModel / LlamaForCausalLM / Mistral...

minigpt.loading.load_model sends such sources here, so sample.py --ckpt, eval.py --ckpt and train.py's
init_from take them too.  The tensor renaming lives in minigpt.hf.weights, the tokenizer in minigpt.hf.tokenizer_files;
this module maps config.json onto GPTConfig, finds and reads the weight files, and fetches hub models.

Imported models are float32 whatever the files hold (bf16 sources are upcast): training, precision handling and
the equality checks against transformers all start from float32 weights, as they do for our own checkpoints.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from minigpt.core.checkpoint import CONFIG_LIMITS
from minigpt.core.config import GPTConfig
from minigpt.core.errors import CheckpointError, UserError, first_line
from minigpt.hf.files import check_config_fields, read_json_object, shard_paths
from minigpt.hf.tokenizer_files import load_hf_tokenizer
from minigpt.hf.weights import from_hf_state_dict
from minigpt.core.model import GPT
from minigpt.core.tokenizers import Tokenizer

__all__ = ["HUB_PREFIX", "SUPPORTED_ARCHITECTURES", "config_from_hf", "load_hf_model", "read_hf_weights",
           "resolve_hf_source"]

HUB_PREFIX = "hf:"
SUPPORTED_ARCHITECTURES = ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM")
MODEL_TYPES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
# GPT-2's activation_function -> our gelu_approximate (gelu_new, gelu_fast and gelu_pytorch_tanh are one formula)
GPT2_GELU = {"gelu_new": "tanh", "gelu_fast": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none",
             "gelu_python": "none"}
# hub files worth fetching: the config, the tokenizer, and one of the two weight formats (safetensors first)
META_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json"]
SAFETENSORS_FILES = ["model.safetensors", "model.safetensors.index.json", "model-*-of-*.safetensors"]
BIN_FILES = ["pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*-of-*.bin"]
# (single file, index of shards) per weight format, in the order they are looked for
WEIGHT_LAYOUTS = (("model.safetensors", "model.safetensors.index.json"),
                  ("pytorch_model.bin", "pytorch_model.bin.index.json"))


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
    """(rope theta, scaling dict or None).  transformers 5 writes both into `rope_parameters`; older configs have
    a top-level `rope_theta` and a `rope_scaling` dict (whose kind is `rope_type`, or `type` before that)."""
    params = _get(hf, "rope_parameters", "rope_scaling", default={})
    if not isinstance(params, dict):
        raise CheckpointError(f"its rope_parameters/rope_scaling is {params!r}, not a dict; the config.json is damaged")
    theta = _get(hf, "rope_theta", default=params.get("rope_theta", 10000.0))
    theta = float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else theta
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"its RoPE scaling is {kind!r}, which minigpt does not compute; it imports plain RoPE "
                              "and rope_type llama3 (Llama 3.1/3.2)")
    return theta, {k: v for k, v in params.items() if k not in ("rope_theta", "type")} | {"rope_type": kind}


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


def config_from_hf(hf_config: dict[str, Any], block_size: int | None = None, **overrides: Any) -> GPTConfig:
    """A Hugging Face config.json (as a dict) -> the GPTConfig computing the same function.

    block_size: a shorter context than the source's (learned positions are cropped to it); a longer one is an
    error.  A Mistral model's context is capped at its sliding window, inside which its attention is ours.
    overrides: other GPTConfig fields, e.g. attention='manual'.
    """
    architecture = hf_architecture(hf_config)
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

def weight_files(model_dir: Path) -> list[Path]:
    """The files holding the weights: model.safetensors, the shards its index lists, or pytorch_model.bin (or its
    shards).  A shard the index names but the directory lacks is an error naming it."""
    for single, index in WEIGHT_LAYOUTS:
        if (model_dir / single).is_file():
            return [model_dir / single]
        if (model_dir / index).is_file():
            shards = shard_paths(model_dir / index, model_dir)
            missing = [s.name for s in shards if not s.is_file()]
            if missing:
                raise CheckpointError(f"{model_dir} lacks the weight shard {missing[0]} that {index} lists "
                                      f"({len(missing)} of {len(shards)} missing); download the model again")
            return shards
    raise CheckpointError(f"{model_dir} has no weight file (model.safetensors, its sharded index, or "
                          "pytorch_model.bin); download the weights into it, e.g. `hf download ORG/NAME "
                          f"--local-dir {model_dir}`")


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
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data only
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"refusing to load {path}: it holds objects other than tensors "
                              f"({first_line(e, 120)}); use the model's safetensors weights instead") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: it is truncated or not a PyTorch weight file "
                              f"({type(e).__name__}); download the model again") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} is not a state dict of tensors; download the model again")
    return state


def read_hf_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of the weight files (see weight_files), by its Hugging Face name."""
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(_read_safetensors(path) if path.suffix == ".safetensors" else _read_bin(path))
    return state


# ------------------------------------------------------------------------------------------------ the hub

def _hub_cache() -> str:
    """Where huggingface_hub keeps downloads, as the variable that sets it."""
    from huggingface_hub import constants

    if Path(constants.HF_HUB_CACHE) == Path(constants.HF_HOME) / "hub":
        return f"HF_HOME={constants.HF_HOME}"
    return f"HF_HUB_CACHE={constants.HF_HUB_CACHE}"


HUB_TIMEOUT_S = 20  # connect and read: a hub (or proxy) that accepts and never answers must not hang a command


def _bounded_timeouts(request: Any) -> None:
    """An httpx request hook: huggingface_hub asks for no timeout (None) on its metadata calls; give each phase
    (connect, read, write, pool) HUB_TIMEOUT_S instead, through the request's documented `timeout` extension."""
    asked = request.extensions.get("timeout") or {}
    request.extensions["timeout"] = {phase: asked.get(phase) or HUB_TIMEOUT_S
                                     for phase in ("connect", "read", "write", "pool")}


def _cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The model's snapshot when the cache already holds its config and weights: used without the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True,
                                      allow_patterns=META_FILES + SAFETENSORS_FILES + BIN_FILES))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    weights = any(path.glob("model*.safetensors")) or any(path.glob("pytorch_model*.bin"))
    return path if (path / "config.json").is_file() and weights else None


def download_hf(repo_id: str, revision: str | None = None) -> Path:
    """hf:ORG/NAME -> the local snapshot directory in huggingface_hub's cache (downloaded if absent and online).
    Only the config, tokenizer and one weight format are fetched (safetensors when the repository has it)."""
    import httpx2
    from huggingface_hub import constants, get_session, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"hf:{repo_id}" + (f"@{revision}" if revision else "")
    if (cached := _cached_snapshot(repo_id, revision)) is not None:
        return cached
    hooks = get_session().event_hooks  # huggingface_hub's shared client: waits forever unless bounded
    if _bounded_timeouts not in hooks["request"]:
        get_session().event_hooks = {**hooks, "request": [*hooks["request"], _bounded_timeouts]}
    beforehand = (f"set HF_HUB_OFFLINE=1 to use the cache only, or download the model beforehand with "
                  f"`hf download {repo_id}` (or pass a local model directory)")
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=META_FILES + SAFETENSORS_FILES))
        if not any(path.glob("model*.safetensors")):  # an older repository: PyTorch weights only
            path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=META_FILES + BIN_FILES))
    except HFValidationError as e:
        raise CheckpointError(f"{where} is not a valid hub model id ({first_line(e, 120)}); write hf:ORG/NAME, "
                              "e.g. hf:openai-community/gpt2") from None
    except GatedRepoError:
        raise CheckpointError(f"{where} is gated: accept its license on huggingface.co and log in with "
                              "`hf auth login`, then try again") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{where} was not found on the Hugging Face hub (or is private); check the name, "
                              "or log in with `hf auth login` for a private model") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{where}: the repository has no revision {revision!r}; leave out @REVISION for "
                              "the newest") from None
    except LocalEntryNotFoundError:  # offline (HF_HUB_OFFLINE=1 or no network) and not in the cache
        reach = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else
                 f"the hub at {constants.ENDPOINT} cannot be reached or did not answer in {HUB_TIMEOUT_S} s: offline? "
                 "check HF_ENDPOINT")
        raise CheckpointError(f"{where} is not in the Hugging Face cache ({_hub_cache()}) and {reach}; download it "
                              f"beforehand with `hf download {repo_id}` (or run this once online), or pass a local "
                              "model directory") from None
    except httpx2.TimeoutException:
        raise CheckpointError(f"the hub at {constants.ENDPOINT} did not answer for {where} within {HUB_TIMEOUT_S} s "
                              f"(check HF_ENDPOINT and the network); {beforehand}") from None
    except (ValueError, KeyError, TypeError, httpx2.HTTPError) as e:  # HTML from a captive portal, `{}`, a cut answer
        raise CheckpointError(f"the hub at {constants.ENDPOINT} gave an answer for {where} that is not the hub's "
                              f"({type(e).__name__}; a proxy or captive portal? check HF_ENDPOINT); "
                              f"{beforehand}") from None
    except OSError as e:  # HTTP errors are OSErrors too: the hub is down, a proxy refuses, the disk is full
        raise CheckpointError(f"cannot download {where} ({first_line(e, 160)}); try again, or download it with "
                              f"`hf download {repo_id}` and pass the directory") from None
    return path


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
        for key, limit in CONFIG_LIMITS.items():  # before anything is built from a crafted config.json
            if getattr(source_config, key) > limit:
                raise CheckpointError(f"its config.json says {key}={getattr(source_config, key)}, over the "
                                      f"plausible limit {limit}; the config is damaged")
        config = config_from_hf(hf_config, block_size, **overrides)
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
