"""The JSON documents of a Hugging Face folder minigpt did not write (config.json, tokenizer_config.json, index
files): each read whole and checked before any field is used, so a damaged or hostile file is one line naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from minigpt.core.errors import CheckpointError, first_line

# fields minigpt reads from config.json, and the JSON type each must have
CONFIG_FIELD_TYPES = {"model_type": str, "activation_function": str, "hidden_act": str, "architectures": list,
                      "rope_scaling": (dict, type(None)), "tie_word_embeddings": bool}


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`: anything else (not JSON, nested past Python's recursion limit, not an object) is
    one CheckpointError naming the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise CheckpointError(f"cannot read {path}: it is nested too deeply to be a model's file; download the model "
                              "again") from None
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"cannot read {path} ({first_line(e)}); download the model again") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is not a JSON object; download the model again")
    return value


def check_config_fields(config: dict[str, Any], path: Path) -> None:
    for key, kind in CONFIG_FIELD_TYPES.items():
        if key in config and not isinstance(config[key], kind):
            raise CheckpointError(f"{path}: field {key!r} is a {type(config[key]).__name__}, not what a model's "
                                  "config holds; download the model again")


def shard_paths(index: Path, model_dir: Path) -> list[Path]:
    """The weight shards a *.index.json lists, each a file name inside model_dir (symlinks resolved)."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: its weight_map is not a map of tensor names to file names; download the "
                              "model again")
    root = model_dir.resolve()
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not (model_dir / shard).resolve().is_relative_to(root):
            raise CheckpointError(f"{index} points outside the model's folder ({shard!r}); refusing to read it: "
                                  "download the model again from a source you trust")
    return [model_dir / s for s in shards]
