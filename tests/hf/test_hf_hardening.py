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
                                         ("hidden_act", {"name": "silu"}), ("num_hidden_layers", "2"),
                                         ("num_attention_heads", True), ("rope_theta", "big"),
                                         ("sliding_window", [4096]), ("rope_scaling", ["llama3"]),
                                         ("tie_word_embeddings", "no")])
def test_config_fields_of_the_wrong_json_type_name_the_field(hf_folder, tmp_path, field, value):
    folder = copy_of(hf_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"config.json: field '{field}' is a {type(value).__name__}") as e:
        load_model(folder)
    assert "where a model's config.json has" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("weight_map,match", [
    ({"model.embed_tokens.weight": 3}, "weight_map is not a map of tensor names to file names"),
    ({"model.embed_tokens.weight": None}, "weight_map is not a map"),
    ({"model.embed_tokens.weight": "../../etc/passwd"}, "points outside the model's folder"),
    ({"model.embed_tokens.weight": "/etc/passwd"}, "points outside the model's folder"),
    ({"model.embed_tokens.weight": "a\u0000b.safetensors"}, "points outside the model's folder or is no file name"),
    ({"model.embed_tokens.weight": "x" * 5000 + ".safetensors"}, "is no file name"),
    ({"model.embed_tokens.weight": ""}, "is no file name"),
    ({"model.embed_tokens.weight": "."}, "is no file name"),
    ({"model.embed_tokens.weight": "config.json"}, "'config.json', not a .safetensors file"),
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


@pytest.mark.parametrize("arch,name,shape,expected", [
    ("gpt", "transformer.h.0.attn.c_attn.weight", (2, 16, 48), (16, 48)),
    ("gpt", "transformer.ln_f.weight", (16, 1), (16,)),
    ("llama", "model.layers.0.self_attn.q_proj.weight", (256,), (16, 16)),
    ("llama", "model.embed_tokens.weight", (), (256, 16)),
])
def test_a_tensor_of_the_wrong_rank_is_one_line_naming_it(tmp_path, arch, name, shape, expected):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = GPT(GPTConfig(arch=arch, n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=256))
    folder = tmp_path / arch
    export_hf(model, ByteTokenizer(), folder)
    tensors = load_file(folder / "model.safetensors")
    assert name in tensors
    tensors[name] = torch.zeros(shape)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor {name} has {len(shape)} dimension\(s\)") as e:
        load_model(folder)
    assert f"where config.json implies {expected}" in str(e.value)


# ------------------------------------------------------------------------------------------- the hub's cache

@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty huggingface_hub cache, offline (the variables as huggingface_hub read them at import)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def sharded_in_cache(folder: Path, cache: Path, repo_id: str, commit: str = "0" * 40) -> Path:
    """`folder`'s weights as two shards, laid out as huggingface_hub's cache lays out a download: every snapshot
    file a relative link into the repository's blobs/."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    staged = cache.parent / "staged"
    staged.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (staged / f.name).write_bytes(f.read_bytes())
    for shard, part in halves.items():
        save_file({n: tensors[n] for n in part}, staged / shard, metadata={"format": "pt"})
    (staged / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: shard for shard, part in halves.items() for n in part}}))
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(staged.iterdir())):
        f.rename(repo / "blobs" / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    return snapshot


def test_a_sharded_model_in_the_hub_cache_loads_through_its_blob_links(hf_folder, hub_cache):
    """The cache's snapshot files are links into blobs/, outside the snapshot folder: still the model's own."""
    sharded_in_cache(hf_folder, hub_cache, "someorg/sharded")
    model, _ = load_model("hf:someorg/sharded")
    reference, _ = load_model(hf_folder)
    idx = torch.arange(8)[None]
    torch.testing.assert_close(model(idx)[0], reference(idx)[0], rtol=0, atol=0)


def test_a_partial_download_in_the_cache_is_not_taken_for_complete(hf_folder, hub_cache):
    """A shard missing from the cache (an interrupted download) sends the command back to the hub to finish it,
    instead of failing on the cache forever; offline, it is one line naming the missing shard."""
    from minigpt.hf.hub import _cached_snapshot

    snapshot = sharded_in_cache(hf_folder, hub_cache, "someorg/partial")
    assert _cached_snapshot("someorg/partial", None) == snapshot
    (snapshot / "model-00002-of-00002.safetensors").unlink()
    assert _cached_snapshot("someorg/partial", None) is None
    with pytest.raises(CheckpointError, match="lacks the weight shard model-00002-of-00002.safetensors"):
        load_model("hf:someorg/partial")
