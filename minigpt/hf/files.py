"""The files of a Hugging Face folder minigpt did not write.  Its JSON documents (config.json,
tokenizer_config.json, special_tokens_map.json, index files) are each read whole and checked before any field is
used, and its weight files are found inside the folder only, so a damaged or hostile folder is one line naming
the file (and the field)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from minigpt.core.errors import CheckpointError, first_line
from minigpt.core.user_files import DOCUMENT_BYTES, loads, read_user_bytes

# (single file, index of shards) per weight format, in the order they are looked for
WEIGHT_LAYOUTS = (
    ("model.safetensors", "model.safetensors.index.json"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json"),
)
# fields minigpt reads from config.json: the Python types `json` gives for the JSON types each may hold
TEXT, FLAG = ((str,), "a string"), ((bool,), "true or false")
OPTION = ((bool, type(None)), "true, false or null")  # a variant a family refuses where it is true
SIZE = ((int, type(None)), "an integer or null")
NUMBER = ((int, float, type(None)), "a number or null")
OBJECT, NAMES = ((dict, type(None)), "an object or null"), ((list, type(None)), "an array of names or null")
CONFIG_FIELD_TYPES = {
    "model_type": TEXT,
    "activation_function": TEXT,
    "hidden_act": TEXT,
    "architectures": NAMES,
    "hidden_activation": ((str, type(None)), "a string or null"),  # Gemma's: null reads as its default
    "tie_word_embeddings": FLAG,
    **dict.fromkeys(("use_sliding_window", "attention_bias", "mlp_bias", "use_bidirectional_attention"), OPTION),
    **dict.fromkeys(("scale_attn_weights", "scale_attn_by_inverse_layer_idx", "add_cross_attention"), OPTION),
    "layer_types": NAMES,
    "rope_local_base_freq": NUMBER,
    "rope_scaling": OBJECT,
    "rope_parameters": OBJECT,
    "rope_theta": NUMBER,
    "layer_norm_epsilon": NUMBER,
    "rms_norm_eps": NUMBER,
    **dict.fromkeys(
        (
            "n_layer",
            "num_hidden_layers",
            "n_head",
            "num_attention_heads",
            "num_key_value_heads",
            "n_embd",
            "hidden_size",
            "head_dim",
            "n_positions",
            "n_ctx",
            "max_position_embeddings",
            "vocab_size",
            "n_inner",
            "intermediate_size",
            "sliding_window",
            "sliding_window_pattern",
            "_sliding_window_pattern",
        ),
        SIZE,
    ),
}


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`: anything else (not JSON, nested past MAX_JSON_DEPTH, not an object, a device or a
    file too large) is one CheckpointError naming the file."""
    try:
        value = loads(read_user_bytes(path, DOCUMENT_BYTES))
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError, too deep or too large
        raise CheckpointError(f"cannot read {path} ({first_line(e)}); download the model again") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is not a JSON object; download the model again")
    return value


# a value's kind as JSON names it (the file's author wrote JSON, not Python: "a string", not "a str")
JSON_KINDS = {str: "a string", int: "a number", float: "a number", bool: "true or false", list: "a list"}


def config_field_problems(config: dict[str, Any]) -> Iterator[str]:
    """Every field minigpt reads that does not hold its JSON type: a list where a name belongs, or a string where a
    size does, is one line naming the field (minigpt.hf.load.unsupported), not a TypeError deep in the conversion."""
    for key, (types, described) in CONFIG_FIELD_TYPES.items():
        value = config.get(key)
        if key in config and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            yield (
                f"field {key!r} is {JSON_KINDS.get(type(value), 'an object')} ({json.dumps(value)[:40]}), where a "
                "model's config.json has "
                f"{described}; fix the field or download the model again"
            )


def _confines(model_dir: Path) -> list[Path]:
    """Where the folder's files may really live: the folder, and for a snapshot of huggingface_hub's cache
    (REPO/snapshots/COMMIT, whose files are links to REPO/blobs/HASH) its repository's blobs."""
    root = model_dir.resolve()
    return [root, root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [root]


def _outside(model_dir: Path, name: str) -> bool:
    """Whether the file `name` in model_dir really lives outside it (symlinks resolved), or is no file name."""
    confines = _confines(model_dir)
    try:
        real = (model_dir / name).resolve()
        real.is_file()  # an absent file is named later; a name no file can have raises here
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a name too long, a symlink loop
        return True
    return real in confines or not any(real.is_relative_to(c) for c in confines)


def shard_paths(index: Path, model_dir: Path) -> list[Path]:
    """The weight shards a *.index.json lists, each a file of the index's format inside model_dir (symlinks
    resolved): a name leading outside, to the folder itself, or of another format is one line naming it."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(
            f"{index}: its weight_map is not a map of tensor names to file names; download the model again"
        )
    suffix = ".safetensors" if index.name.startswith("model.safetensors") else ".bin"
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        outside = _outside(model_dir, shard)
        if outside or not shard.endswith(suffix):
            why = (
                "which points outside the model's folder or is no file name; refusing to read it: download the "
                "model again from a source you trust"
                if outside
                else f"not a {suffix} file as the index's format says; download the model again"
            )
            raise CheckpointError(f"{index}: its weight_map names {shard[:80]!r}, {why}")
    return [model_dir / s for s in shards]


def weight_files(model_dir: Path) -> list[Path]:
    """The files holding the weights: model.safetensors, the shards its index lists, or pytorch_model.bin (or its
    shards).  A shard the index names but the directory lacks is an error naming it."""
    for single, index in WEIGHT_LAYOUTS:
        if (model_dir / single).is_file():
            if _outside(model_dir, single):  # a link out of the folder, as a shard's is refused
                raise CheckpointError(
                    f"{model_dir / single} is a link to a file outside the model's folder; refusing to read it: "
                    "download the model again from a source you trust (or copy the file into the folder)"
                )
            return [model_dir / single]
        if (model_dir / index).is_file():
            shards = shard_paths(model_dir / index, model_dir)
            missing = [s.name for s in shards if not s.is_file()]
            if missing:
                raise CheckpointError(
                    f"{model_dir} lacks the weight shard {missing[0]} that {index} lists "
                    f"({len(missing)} of {len(shards)} missing); download the model again"
                )
            return shards
    raise CheckpointError(
        f"{model_dir} has no weight file (model.safetensors, its sharded index, or "
        "pytorch_model.bin); download the weights into it, e.g. `hf download ORG/NAME "
        f"--local-dir {model_dir}`"
    )
