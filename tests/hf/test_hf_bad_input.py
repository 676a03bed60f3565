"""Hugging Face folders from strangers: every JSON document is read whole and checked before use, so a damaged or
hostile one is one line naming the file (and the field), never a traceback, and never read outside the folder."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from minigpt.core.config import GPTConfig
from minigpt.core.errors import CheckpointError
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.export.hf import export_hf
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


@pytest.mark.parametrize(
    "file,content,match",
    [
        ("config.json", deeply_nested(), r"cannot read .*config.json \(nested more than 100 levels deep"),
        ("config.json", "[1, 2]", "config.json is not a JSON object"),
        ("config.json", "{not json", r"cannot read .*config.json \("),
        (
            "tokenizer_config.json",
            '{"a": ' + deeply_nested() + "}",
            r"cannot read .*tokenizer_config.json \(nested more than 100 levels deep",
        ),
    ],
)
def test_malformed_json_documents_are_one_line_naming_the_file(hf_folder, tmp_path, file, content, match):
    folder = copy_of(hf_folder, tmp_path)
    (folder / file).write_text(content)
    with pytest.raises(CheckpointError, match=match):
        load_model(folder)


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_type", ["llama"]),
        ("architectures", "LlamaForCausalLM"),
        ("hidden_act", {"name": "silu"}),
        ("num_hidden_layers", "2"),
        ("num_attention_heads", True),
        ("rope_theta", "big"),
        ("sliding_window", [4096]),
        ("rope_scaling", ["llama3"]),
        ("tie_word_embeddings", "no"),
        ("scale_attn_weights", "false"),  # was read as true: "sets scale_attn_weights='false' ... only true imports"
    ],
)
def test_config_fields_of_the_wrong_json_type_name_the_field(hf_folder, tmp_path, field, value):
    folder = copy_of(hf_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    kind = {str: "a string", list: "a list", dict: "an object", bool: "true or false"}[
        type(value)
    ]  # as JSON names it, not Python
    with pytest.raises(CheckpointError, match=f"config.json: field '{field}' is {kind} ") as e:
        load_model(folder)
    assert "where a model's config.json has" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "weight_map,match",
    [
        ({"model.embed_tokens.weight": 3}, "weight_map is not a map of tensor names to file names"),
        ({"model.embed_tokens.weight": None}, "weight_map is not a map"),
        ({"model.embed_tokens.weight": "../../etc/passwd"}, "points outside the model's folder"),
        ({"model.embed_tokens.weight": "/etc/passwd"}, "points outside the model's folder"),
        ({"model.embed_tokens.weight": "a\u0000b.safetensors"}, "points outside the model's folder or is no file name"),
        ({"model.embed_tokens.weight": "x" * 5000 + ".safetensors"}, "is no file name"),
        ({"model.embed_tokens.weight": ""}, "is no file name"),
        ({"model.embed_tokens.weight": "."}, "is no file name"),
        ({"model.embed_tokens.weight": "config.json"}, "'config.json', not a .safetensors file"),
    ],
)
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


@pytest.mark.parametrize("single", ["model.safetensors", "pytorch_model.bin"])
def test_a_symlinked_single_weight_file_leading_outside_is_refused(hf_folder, tmp_path, single):
    folder = copy_of(hf_folder, tmp_path)
    outside = tmp_path / "elsewhere"
    (folder / "model.safetensors").rename(outside)  # (its bytes do not matter: refused before it is read)
    (folder / single).symlink_to(outside)
    with pytest.raises(CheckpointError, match="is a link to a file outside the model's folder"):
        load_model(folder)


def test_the_sampler_says_it_in_one_line(hf_folder, tmp_path):
    folder = copy_of(hf_folder, tmp_path)
    (folder / "config.json").write_text(deeply_nested())
    done = subprocess.run(
        [sys.executable, str(REPO / "sample.py"), "--ckpt", str(folder), "--max_new_tokens", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "nested more than 100 levels deep" in done.stderr


@pytest.mark.parametrize(
    "arch,name,shape,expected",
    [
        ("gpt", "transformer.h.0.attn.c_attn.weight", (2, 16, 48), (16, 48)),
        ("gpt", "transformer.ln_f.weight", (16, 1), (16,)),
        ("llama", "model.layers.0.self_attn.q_proj.weight", (256,), (16, 16)),
        ("llama", "model.embed_tokens.weight", (), (256, 16)),
    ],
)
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
    (staged / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: shard for shard, part in halves.items() for n in part}})
    )
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


# ------------------------------------------------------------------------------------------- pytorch_model.bin


def torch_archive_with(
    source: Path, target: Path, data_pkl: bytes | None = None, compression: int = zipfile.ZIP_STORED
) -> Path:
    """A copy of the torch.save archive `source`, its data.pkl replaced (when given) or its records compressed."""
    staged = target.with_name(target.name + ".staged")
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(staged, "w", compression=compression) as new:
        for record in old.infolist():
            new.writestr(
                record.filename,
                data_pkl if data_pkl is not None and record.filename.endswith("data.pkl") else old.read(record),
            )
    return staged.replace(target)


@pytest.fixture
def bin_folder(hf_folder, tmp_path) -> Path:
    """The tiny model as an older save_pretrained wrote it: pytorch_model.bin (torch.save of the state dict)."""
    from safetensors.torch import load_file

    folder = copy_of(hf_folder, tmp_path)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder


def data_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))


def one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message and e.type is CheckpointError, message
    return message


def test_a_pytorch_model_bin_loads_like_its_safetensors(hf_folder, bin_folder):
    idx = torch.arange(12)[None]
    torch.testing.assert_close(load_model(bin_folder)[0](idx)[0], load_model(hf_folder)[0](idx)[0], rtol=0, atol=0)


MALFORMED_PICKLES = {  # a stream that is damaged rather than malicious; torch.load's own answer in the comment
    "PROTO then STOP": lambda good: b"\x80\x02.",  # IndexError: pop from empty list
    "an unset memo slot": lambda good: b"\x80\x02h\x05.",  # BINGET 5, never PUT: KeyError
    "cut mid-opcode": lambda good: good[: len(good) // 2],  # EOFError
    "SETITEM on an empty stack": lambda good: b"\x80\x02}s.",  # IndexError
    "an unknown opcode": lambda good: b"\x80\x02\xff.",
    "empty": lambda good: b"",
}


@pytest.mark.parametrize("case", MALFORMED_PICKLES)
def test_a_malformed_pickle_in_pytorch_model_bin_is_one_line(bin_folder, case):
    path = bin_folder / "pytorch_model.bin"
    torch_archive_with(path, path, MALFORMED_PICKLES[case](data_pkl(path)))
    with pytest.raises(CheckpointError) as e:
        load_model(bin_folder)
    assert f"cannot read {path}: it is truncated or damaged" in one_line(e)


class Allocates:
    """Unpickled as call(n): globals weights_only allows that allocate n bytes or elements."""

    def __init__(self, call, n: int):
        self.call, self.n = call, n

    def __reduce__(self):
        return self.call, (self.n,)


class StorageRef:
    """Pickled as torch.save pickles a storage: the persistent id ('storage', type, record key, location, numel)."""

    def __init__(self, key: str, numel: int):
        self.key, self.numel = key, numel

    def __reduce__(self):  # never reached: persistent_id answers first
        raise AssertionError


class TensorOn:
    """Pickled as torch.save pickles a float32 vector of `numel` elements on a StorageRef."""

    def __init__(self, storage: StorageRef):
        self.storage = storage

    def __reduce__(self):
        from collections import OrderedDict

        return torch._utils._rebuild_tensor_v2, (self.storage, 0, (self.storage.numel,), (1,), False, OrderedDict())


def storage_pickle(name: str, key: str, numel: int) -> bytes:
    """A data.pkl as torch.save writes it for {name: tensor}, whose tensor asks record data/KEY for numel floats."""
    import io

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel) if isinstance(obj, StorageRef) else None

    out = io.BytesIO()
    Pickler(out, protocol=2).dump({name: TensorOn(StorageRef(key, numel))})
    return out.getvalue()


def sparse_state(folder: Path) -> dict:
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"].to_sparse()
    return state


@pytest.mark.parametrize(
    "case,needle",
    [
        ("compressed records (a zip bomb)", "it holds compressed records"),
        ("bytearray(8e9)", "its pickle calls bytearray"),
        ("torch.FloatTensor(1e10)", "its pickle calls torch.FloatTensor, which allocates from a number"),
        ("torch.UntypedStorage(1e10)", "its pickle calls torch.storage.UntypedStorage"),
        (
            "a storage larger than its record",
            "asks for 4000000000 bytes of torch.float32 from the record data/0, which holds",
        ),
        ("a legacy (non-zip) file", "it is not a zip archive as torch.save writes it"),
        ("a sparse tensor", "it holds a sparse tensor (torch._utils._rebuild_sparse_tensor)"),
        ("a meta-device tensor", "it holds a meta-device tensor"),
        ("a pickled os.system", "holds objects other than tensors and plain data (GLOBAL posix.system)"),
    ],
)
def test_pytorch_model_bin_gets_the_checks_of_our_checkpoints(bin_folder, hf_folder, case, needle):
    """What a crafted .bin could make torch.load allocate or build is refused first, from the archive alone: every
    storage is exactly its record, and the records fit the file, so the load is bounded by the file's size."""
    path = bin_folder / "pytorch_model.bin"
    if case.startswith("compressed"):
        torch_archive_with(path, path, compression=zipfile.ZIP_DEFLATED)
    elif case == "a storage larger than its record":
        torch_archive_with(path, path, storage_pickle("model.norm.weight", "0", 10**9))
    elif case == "a legacy (non-zip) file":
        torch.save({"w": torch.zeros(2)}, path, _use_new_zipfile_serialization=False)
    elif case == "a sparse tensor":
        torch.save(sparse_state(hf_folder), path)
    elif case == "a meta-device tensor":
        torch.save({"model.norm.weight": torch.empty(16, device="meta")}, path)
    else:
        call = {
            "bytearray(8e9)": (bytearray, 8 * 10**9),
            "torch.FloatTensor(1e10)": (torch.FloatTensor, 10**10),
            "torch.UntypedStorage(1e10)": (torch.UntypedStorage, 10**10),
            "a pickled os.system": (os.system, ""),
        }
        torch_archive_with(path, path, pickle.dumps(Allocates(*call[case]), protocol=2))
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as e:
        load_model(bin_folder)
    assert f"refusing to load {path}: " in one_line(e) and needle in str(e.value)
    assert time.perf_counter() - start < 1.0


# ------------------------------------------------------------------------------------------- quantized weights


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "key,spec,named",
    [
        (
            "quantization_config",
            {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
            "fp8",
        ),
        ("quantization_config", {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "bitsandbytes"),
        ("quantization_config", {"quant_method": "gptq", "bits": 4}, "gptq"),
        ("compression_config", {"quant_method": "compressed-tensors"}, "compressed-tensors"),
    ],
)
def test_a_config_json_saying_quantized_is_refused_before_the_weights_are_read(hf_folder, tmp_path, key, spec, named):
    folder = copy_of(hf_folder, tmp_path)
    edit_config(folder, **{key: spec})
    (folder / "model.safetensors").write_bytes(b"never read")  # the refusal comes before any weight file is opened
    with pytest.raises(CheckpointError) as e:
        load_model(folder)
    assert (
        f"its config.json has {key} ({named}): minigpt imports unquantized float weights only; use the original "
        "(bf16/fp32) model"
    ) in one_line(e)


def quantized(state: dict, scheme: str) -> dict:
    """The tiny model's tensors as a quantizer would have written them (without a quantization_config)."""
    q = "model.layers.0.self_attn.q_proj"
    w = state[f"{q}.weight"]
    if scheme == "fp8 with weight_scale_inv":
        return {**state, f"{q}.weight": w.to(torch.float8_e4m3fn), f"{q}.weight_scale_inv": torch.ones(1)}
    if scheme == "fp8 alone":
        return {**state, f"{q}.weight": w.to(torch.float8_e5m2)}
    if scheme == "int8 alone":
        return {**state, f"{q}.weight": (w * 100).to(torch.int8)}
    if scheme == "a float weight with its input_scale":
        return {**state, f"{q}.input_scale": torch.ones(())}
    if scheme == "bitsandbytes 4-bit":
        return {**state, f"{q}.weight": torch.zeros(128, 1, dtype=torch.uint8), f"{q}.weight.absmax": torch.ones(4)}
    if scheme == "gptq":  # qweight replaces weight; the float scales come along
        rest = {k: v for k, v in state.items() if k != f"{q}.weight"}
        return {**rest, f"{q}.qweight": torch.zeros(2, 16, dtype=torch.int32), f"{q}.scales": torch.ones(1, 16)}
    raise AssertionError(scheme)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize(
    "scheme,needle",
    [
        ("fp8 with weight_scale_inv", "is float8_e4m3fn (quantized)"),
        ("fp8 alone", "self_attn.q_proj.weight is float8_e5m2 (quantized)"),
        ("int8 alone", "self_attn.q_proj.weight is int8 (quantized)"),
        ("a float weight with its input_scale", "self_attn.q_proj.input_scale is a quantization's scale"),
        ("bitsandbytes 4-bit", "is uint8 (quantized)"),
        ("gptq", "self_attn.q_proj.qweight is a quantization's scale or index"),
    ],
)
def test_quantized_tensors_are_refused_naming_the_file_and_tensor(hf_folder, tmp_path, fmt, scheme, needle):
    """Without the scales the import would compute another model, silently: the dtype or the extra tensors say it."""
    from safetensors.torch import load_file, save_file

    folder = copy_of(hf_folder, tmp_path)
    state = quantized(load_file(folder / "model.safetensors"), scheme)
    (folder / "model.safetensors").unlink()
    path = folder / ("model.safetensors" if fmt == "safetensors" else "pytorch_model.bin")
    save_file(state, path) if fmt == "safetensors" else torch.save(state, path)
    with pytest.raises(CheckpointError) as e:
        load_model(folder)
    assert f"{path}: tensor model.layers.0." in one_line(e) and needle in str(e.value)
    assert "minigpt imports unquantized float weights only; use the original (bf16/fp32) model" in str(e.value)


# ------------------------------------------------------------------------------------------- RoPE in config.json


def with_rope(folder: Path, **rope) -> Path:
    """config.json with these RoPE fields only (the export writes rope_parameters and a top-level rope_theta)."""
    edit_config(folder, rope_parameters=None, rope_scaling=None, rope_theta=None)
    edit_config(folder, **rope)
    return folder


@pytest.fixture(scope="module")
def sharp_folder(tmp_path_factory) -> Path:
    """A tiny Llama whose every weight is drawn at std 0.5, so that a RoPE setting moves the logits by far more than
    the tolerance."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(arch="llama", n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=256))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    out = tmp_path_factory.mktemp("sharp") / "model"
    export_hf(model, ByteTokenizer(), out)
    return out


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 4,
}  # a context of 4 in a block of 16: the scaling bites


@pytest.mark.parametrize(
    "changes,needle",
    [
        (
            dict(
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                rope_scaling={"rope_type": "linear", "factor": 2.0},
            ),
            "holds both rope_parameters ({'rope_type': 'default', 'rope_theta': 10000.0}) and rope_scaling "
            "({'rope_type': 'linear', 'factor': 2.0}), which disagree",
        ),
        (
            dict(
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rope_scaling={"rope_type": "default"}
            ),
            "holds both rope_parameters",
        ),  # rope_scaling wins in transformers 5, and with it rope_theta 10000
        (
            dict(rope_parameters={**LLAMA3, "rope_theta": 10000.0}, rope_scaling={**LLAMA3, "factor": 4.0}),
            "holds both rope_parameters",
        ),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rope_theta=10000.0),
            "gives rope_theta 10000.0 at the top level and 500000.0 in rope_parameters; transformers 4 reads the "
            "first, transformers 5 the second",
        ),
        (
            dict(rope_parameters=None, rope_scaling={**LLAMA3, "rope_theta": 20000.0}, rope_theta=10000.0),
            "gives rope_theta 10000.0 at the top level and 20000.0 in rope_scaling",
        ),
        (dict(partial_rotary_factor=0.5), "sets partial_rotary_factor 0.5"),
    ],
)
def test_rope_fields_that_transformers_versions_read_differently_are_refused(hf_folder, tmp_path, changes, needle):
    folder = with_rope(copy_of(hf_folder, tmp_path), **changes)
    with pytest.raises(CheckpointError) as e:
        load_model(folder)
    assert needle in one_line(e) and "config.json" in str(e.value)


def rope_types_minigpt_lacks() -> list[str]:
    """Every RoPE scaling transformers computes, but llama3 and linear (minigpt's): asked of transformers, so a new
    one is tested as soon as it exists."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return sorted(set(ROPE_INIT_FUNCTIONS) - {"llama3", "linear"})


@pytest.mark.parametrize("field", ["rope_parameters", "rope_scaling", "rope_scaling with the old `type` key"])
@pytest.mark.parametrize("rope_type", rope_types_minigpt_lacks())
def test_every_rope_scaling_minigpt_does_not_compute_is_refused(hf_folder, tmp_path, field, rope_type):
    kind_key = "type" if "type" in field.split("`") else "rope_type"
    folder = with_rope(copy_of(hf_folder, tmp_path), **{field.split()[0]: {kind_key: rope_type, "factor": 2.0}})
    with pytest.raises(CheckpointError) as e:
        load_model(folder)
    assert f"its RoPE scaling is '{rope_type}', which minigpt does not compute" in one_line(e)


@pytest.mark.parametrize(
    "rope",
    [
        dict(
            rope_parameters={**LLAMA3, "rope_theta": 5000.0},
            rope_scaling={**LLAMA3, "rope_theta": 5000.0},
            rope_theta=5000.0,
        ),  # both forms, and both rope_theta, agreeing
        dict(rope_parameters=None, rope_scaling=LLAMA3, rope_theta=5000.0),  # as transformers 4 wrote Llama 3.1
        dict(rope_parameters={**LLAMA3, "rope_theta": 5000.0}),  # as transformers 5 writes it
        dict(rope_parameters={"rope_type": "default"}, rope_scaling={"type": "default"}, rope_theta=5000.0),
    ],
)
def test_rope_fields_that_agree_give_transformers_logits(sharp_folder, tmp_path, rope):
    """Read as LlamaForCausalLM reads the same folder: logits equal within 1e-4 (float32), where plain RoPE differs."""
    transformers = pytest.importorskip("transformers")
    folder = with_rope(copy_of(sharp_folder, tmp_path), **rope)
    ours = load_model(folder)[0]
    theirs = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours_logits, their_logits = ours(idx)[0], theirs.eval()(idx).logits
    assert (ours_logits - their_logits).abs().max().item() < 1e-4
    with torch.no_grad():
        plain = load_model(sharp_folder)[0](idx)[0]
    assert (plain - their_logits).abs().max().item() > 1e-3  # the RoPE settings change the function
