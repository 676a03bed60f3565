"""The checkpoint format: one module writes and reads it; checkpoints written before format 2 still load."""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
import zipfile

import pytest
import torch

from minigpt import GPT, GPTConfig, load_model
from minigpt.core.checkpoint import (
    FORMAT_VERSION,
    RNG_STATE_KEY,
    model_checkpoint,
    model_state_dict,
    pack,
    read_checkpoint,
    save_file,
)
from minigpt.core.errors import CheckpointError
from minigpt.core.generation import generate
from minigpt.core.tokenizers import CharTokenizer
from support import count_model_builds


def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(arch="llama", n_layer=1, n_head=2, n_kv_head=1, n_embd=16, block_size=8, vocab_size=5))


def test_format_1_checkpoints_still_load_and_their_rng_state_moves_to_its_callback(tmp_path):
    """What train.py wrote before the redesign: weights under 'model.', the RNG state in our section."""
    model, tok = tiny_model(), CharTokenizer("abcde")
    rng = torch.get_rng_state()
    old = {
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "minigpt": {"model_config": model.config.to_dict(), "tokenizer": tok.to_dict(), "rng": {"cpu": rng}},
        "global_step": 3,
        "epoch": 0,
    }
    torch.save(old, tmp_path / "old.ckpt")
    loaded, tokenizer = load_model(tmp_path / "old.ckpt")
    idx = torch.tensor([[0, 1, 2, 3]])
    assert torch.equal(loaded(idx)[0], model.eval()(idx)[0])
    assert tokenizer.encode("cab") == tok.encode("cab")
    ckpt = read_checkpoint(tmp_path / "old.ckpt")
    assert ckpt["minigpt"]["format"] == FORMAT_VERSION
    assert torch.equal(ckpt["callbacks"][RNG_STATE_KEY]["cpu"], rng)


def test_the_weights_prefix_is_found_not_assumed(tmp_path):
    """A LightningModule that keeps the GPT under another attribute name still writes loadable checkpoints."""
    model, tok = tiny_model(), CharTokenizer("abcde")
    holder = torch.nn.Module()
    holder.net = torch.nn.Module()
    holder.net.gpt = model
    ckpt = {"state_dict": holder.state_dict(), "global_step": 0}
    pack(ckpt, holder, model, tok)
    assert ckpt["minigpt"]["weights_prefix"] == "net.gpt."
    save_file(ckpt, tmp_path / "x.ckpt")
    loaded, _ = load_model(tmp_path / "x.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_model_checkpoint_round_trip(tmp_path):
    model, tok = tiny_model(), CharTokenizer("abcde")
    save_file(model_checkpoint(model, tok), tmp_path / "m.ckpt")
    weights = model_state_dict(read_checkpoint(tmp_path / "m.ckpt"))
    assert weights.keys() == model.state_dict().keys()
    assert not list(tmp_path.glob(".*tmp*")), "no temporary file left behind"


@pytest.mark.parametrize("kernel", ["efficient", "cudnn"])
def test_a_run_trained_on_a_gpus_attention_kernel_samples_on_a_cpu(tmp_path, kernel):
    """sdpa_backend efficient/cudnn (GPU kernels) kept in the checkpoint: on a CPU torch picks, same outputs."""
    model, tok = tiny_model(), CharTokenizer("abcde")
    model.config.sdpa_backend = kernel
    save_file(model_checkpoint(model, tok), tmp_path / "m.ckpt")
    loaded, _ = load_model(tmp_path / "m.ckpt")
    idx = torch.tensor([[0, 1, 2, 3]])
    assert loaded.config.sdpa_backend is None
    assert torch.equal(
        generate(loaded, idx, 4, temperature=0.0), generate(tiny_model().eval(), idx, 4, temperature=0.0)
    )


def test_a_load_builds_the_model_once_on_the_meta_device(tmp_path, monkeypatch):
    """The size check's meta model is the one whose shapes the weights are checked against and that is filled."""
    model, tok = tiny_model(), CharTokenizer("abcde")
    save_file(model_checkpoint(model, tok), tmp_path / "m.ckpt")
    builds = count_model_builds(monkeypatch)
    loaded, _ = load_model(tmp_path / "m.ckpt")
    assert builds == ["meta"]
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    assert torch.equal(loaded.rope_cos, model.rope_cos)  # computed for real, not left on the meta device


class _Bomb:
    """Unpickled by a weights_only load as bytearray(8 GB): a global that weights_only allows."""

    def __reduce__(self):
        return (bytearray, (8 * 10**9,))


def _zip(path, records: dict, compress=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression=compress) as z:
        for name, data in records.items():
            z.writestr(name, data)
    return path


@pytest.mark.parametrize(
    "kind,needle",
    [
        ("bare pickle", "bare pickle"),
        ("zip with an allocating pickle", "its pickle calls bytearray"),
        ("compressed zip record", "compressed records"),
        ("absurd config", "n_layer=10000000, over the plausible limit"),
    ],
)
def test_implausible_checkpoints_are_refused_fast_before_allocating(tmp_path, kind, needle):
    path = tmp_path / "x.ckpt"
    if kind == "bare pickle":
        path.write_bytes(pickle.dumps(_Bomb(), protocol=2))
        assert path.stat().st_size < 200
    elif kind == "zip with an allocating pickle":
        _zip(path, {"archive/data.pkl": pickle.dumps(_Bomb(), protocol=2), "archive/version": "3\n"})
    elif kind == "compressed zip record":
        _zip(
            path,
            {"archive/data.pkl": pickle.dumps({}, protocol=2), "archive/data/0": b"\0" * (1 << 20)},
            zipfile.ZIP_DEFLATED,
        )
    else:
        ckpt = model_checkpoint(tiny_model(), CharTokenizer("abcde"))
        ckpt["minigpt"]["model_config"]["n_layer"] = 10**7
        save_file(ckpt, path)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=needle):
        load_model(path)
    assert time.perf_counter() - start < 1.0


def test_loading_a_checkpoint_and_sampling_never_start_torchs_compiler(tmp_path):
    """Building a model from its weights initialises nothing: normal_ on the meta device would import
    torch._dynamo, 1.5 s of every sampler's start-up (issue 25's start-up goal)."""
    for arch in ("gpt", "llama"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(arch=arch, n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=5))
        save_file(model_checkpoint(model, CharTokenizer("abcde")), tmp_path / f"{arch}.ckpt")
    code = (
        "import sys\nimport torch\nfrom minigpt import load_model, generate\n"
        f"for arch in ('gpt', 'llama'):\n    m, tok = load_model({str(tmp_path)!r} + f'/{{arch}}.ckpt')\n"
        "    out = generate(m, torch.tensor([tok.encode('ab')]), max_new_tokens=5, temperature=0)\n"
        "    print(out.shape[1])\n"
        "print('torch._dynamo' in sys.modules)"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["7", "7", "False"]


def _with_data_pkl(path, data: bytes):
    """The torch.save archive at `path` with its data.pkl replaced, every other record kept."""
    with zipfile.ZipFile(path) as archive:
        records = {r.filename: archive.read(r) for r in archive.infolist()}
    name = next(n for n in records if n.endswith("data.pkl"))
    return _zip(path, {**records, name: data})


MALFORMED_PICKLES = {  # damaged rather than malicious; torch.load's own answer in the comment
    "PROTO then STOP": lambda good: b"\x80\x02.",  # IndexError: pop from empty list
    "an unset memo slot": lambda good: b"\x80\x02h\x05.",  # BINGET of a slot never PUT: KeyError
    "cut mid-opcode": lambda good: good[: len(good) // 3],  # EOFError
    "an unknown opcode": lambda good: b"\x80\x02\xff.",
    "a dict missing its value": lambda good: b"\x80\x02}X\x01\x00\x00\x00as.",  # IndexError
}


@pytest.mark.parametrize("case", MALFORMED_PICKLES)
def test_a_malformed_pickle_in_a_checkpoint_is_one_line(tmp_path, case):
    path = tmp_path / "m.ckpt"
    save_file(model_checkpoint(tiny_model(), CharTokenizer("abcde")), path)
    with zipfile.ZipFile(path) as archive:
        good = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    _with_data_pkl(path, MALFORMED_PICKLES[case](good))
    with pytest.raises(CheckpointError, match=f"cannot read {path}: it is truncated or damaged") as e:
        load_model(path)
    assert "\n" not in str(e.value)


def test_a_checkpoint_with_a_sparse_tensor_or_a_lying_storage_is_refused(tmp_path):
    ckpt = model_checkpoint(tiny_model(), CharTokenizer("abcde"))
    weights = ckpt["state_dict"]
    weights["model.transformer.ln_f.weight"] = weights["model.transformer.ln_f.weight"].to_sparse()
    save_file(ckpt, tmp_path / "sparse.ckpt")
    with pytest.raises(CheckpointError, match="it holds a sparse tensor"):
        load_model(tmp_path / "sparse.ckpt")
    # a record's size edited in the pickle: 10**9 floats asked of a record holding 64 bytes
    save_file({"state_dict": {"w": torch.zeros(16)}, "minigpt": {}}, tmp_path / "lying.ckpt")
    with zipfile.ZipFile(tmp_path / "lying.ckpt") as archive:
        good = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    assert good.count(b"K\x10t") == 1  # the persistent id's element count, 16, closing its tuple
    _with_data_pkl(tmp_path / "lying.ckpt", good.replace(b"K\x10t", b"J\x00\xca\x9a\x3bt"))
    with pytest.raises(
        CheckpointError, match="asks for 4000000000 bytes of torch.float32 from the record data/0, which holds 64 bytes"
    ):
        load_model(tmp_path / "lying.ckpt")


def test_a_checkpoint_with_flipped_bytes_in_a_tensor_is_refused_by_its_crc(tmp_path):
    """torch.load never checks the CRC-32 of the zip records: a flipped byte in a weight loaded as another weight."""
    path = tmp_path / "flipped.ckpt"
    save_file(model_checkpoint(tiny_model(), CharTokenizer("abcde")), path)
    with zipfile.ZipFile(path) as archive:
        record = max(archive.infolist(), key=lambda r: r.file_size)  # a tensor's
    data = bytearray(path.read_bytes())
    at = record.header_offset + 30 + len(record.filename) + len(record.extra) + record.file_size // 2
    data[at] ^= 0xFF  # inside the record's data (past its local header)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"cannot read {path}: it is truncated or damaged .*Bad CRC-32") as e:
        load_model(path)
    assert "\n" not in str(e.value)
