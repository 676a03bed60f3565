"""Hugging Face folders from strangers: every JSON document is read whole and checked before use, so a damaged or
hostile one is one line naming the file (and the field), never a traceback, and never read outside the folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minigpt.core.config import GPTConfig
from minigpt.core.errors import CheckpointError
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.hf.export import export_hf
from minigpt.loading import load_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = GPT(GPTConfig(arch="llama", n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=256))
    out = tmp_path_factory.mktemp("hf") / "model"
    export_hf(model, ByteTokenizer(), out)
    return out


def copy_of(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    out.mkdir()
    for f in folder.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def deeply_nested(depth: int = 100_000) -> str:
    return "[" * depth + "]" * depth


def test_the_export_itself_loads(hf_folder):
    model, _ = load_model(hf_folder)
    assert model.config.n_layer == 1


@pytest.mark.parametrize("file,content,match", [
    ("config.json", deeply_nested(), "config.json: it is nested too deeply"),
    ("config.json", "[1, 2]", "config.json is not a JSON object"),
    ("config.json", "{not json", r"cannot read .*config.json \("),
    ("tokenizer_config.json", '{"a": ' + deeply_nested() + "}", "tokenizer_config.json: it is nested too deeply"),
])
def test_malformed_json_documents_are_one_line_naming_the_file(hf_folder, tmp_path, file, content, match):
    folder = copy_of(hf_folder, tmp_path)
    (folder / file).write_text(content)
    with pytest.raises(CheckpointError, match=match):
        load_model(folder)


@pytest.mark.parametrize("field,value", [("model_type", ["llama"]), ("architectures", "LlamaForCausalLM"),
                                         ("hidden_act", {"name": "silu"})])
def test_config_fields_of_the_wrong_json_type_name_the_field(hf_folder, tmp_path, field, value):
    folder = copy_of(hf_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"config.json: field '{field}' is a {type(value).__name__}"):
        load_model(folder)


@pytest.mark.parametrize("weight_map,match", [
    ({"model.embed_tokens.weight": 3}, "weight_map is not a map of tensor names to file names"),
    ({"model.embed_tokens.weight": None}, "weight_map is not a map"),
    ({"model.embed_tokens.weight": "../../etc/passwd"}, "points outside the model's folder"),
    ({"model.embed_tokens.weight": "/etc/passwd"}, "points outside the model's folder"),
])
def test_a_sharded_index_is_checked_and_confined_to_the_folder(hf_folder, tmp_path, weight_map, match):
    folder = copy_of(hf_folder, tmp_path)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=match):
        load_model(folder)


def test_a_symlinked_shard_leading_outside_is_refused(hf_folder, tmp_path):
    folder = copy_of(hf_folder, tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    (folder / "model.safetensors").rename(outside)
    (folder / "shard.safetensors").symlink_to(outside)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "shard.safetensors"}}))
    with pytest.raises(CheckpointError, match="points outside the model's folder"):
        load_model(folder)


def test_the_sampler_says_it_in_one_line(hf_folder, tmp_path):
    folder = copy_of(hf_folder, tmp_path)
    (folder / "config.json").write_text(deeply_nested())
    done = subprocess.run([sys.executable, str(REPO / "sample.py"), "--ckpt", str(folder), "--max_new_tokens", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "nested too deeply" in done.stderr


@pytest.mark.parametrize("arch,name,shape", [
    ("gpt", "transformer.h.0.attn.c_attn.weight", (2, 16, 48)),
    ("llama", "model.layers.0.self_attn.q_proj.weight", (256,)),
])
def test_a_tensor_of_the_wrong_rank_is_one_line_naming_it(tmp_path, arch, name, shape):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = GPT(GPTConfig(arch=arch, n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=256))
    folder = tmp_path / arch
    export_hf(model, ByteTokenizer(), folder)
    tensors = load_file(folder / "model.safetensors")
    assert name in tensors
    tensors[name] = torch.zeros(shape)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor {name} has {len(shape)} dimension\(s\)"):
        load_model(folder)
