"""Export to Hugging Face: what export_hf writes loads with plain transformers (AutoModelForCausalLM, AutoTokenizer)
and computes what ours does: the same logits, the same greedy tokens, the same token ids. Options HF cannot express
and an --out that holds files are one line, and nothing is written. Offline: every model and vocabulary is built
here, with every weight drawn at std 0.5, so a swapped or untransposed matrix cannot hide."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tiktoken
import torch

REPO = Path(__file__).resolve().parents[2]  # the repository root
from minigpt.cli.export import main as export_main
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.config import GPTConfig
from minigpt.core.errors import UnknownCharactersError, UserError
from minigpt.core.generation import generate
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer, TiktokenTokenizer
from minigpt.export.hf import EXPORT_FILES, export_hf
from minigpt.loading import load_model
from support import script_runs

transformers = pytest.importorskip("transformers")

SAMPLE = "First Citizen:\nBefore we proceed any further, hear me speak.\n  héllo wörld ☃ 'tis 12345\tdone\n"
GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
MERGES = [
    b"th",
    b"the",
    b" t",
    b" the",
    b"in",
    b"ing",
    b"er",
    b"Ci",
    b"Cit",
    b"\xc3\xa9",
    b"h\xc3\xa9",
    b"pe",
    b"spe",
    b" spe",
    b"ea",
    b" w",
    b"12",
    b"123",
    b"\xe2\x98",
    b"\xe2\x98\x83",
]
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
SMALL = dict(n_layer=2, n_head=4, n_embd=64, block_size=48, vocab_size=256)

# each row exercises a different path of the conversion
CASES = {
    "gpt": dict(arch="gpt"),
    "gpt-untied-tanh": dict(arch="gpt", tie_embeddings=False, gelu_approximate="tanh", norm_eps=1e-6, mlp_hidden=160),
    "gpt-no-bias": dict(arch="gpt", bias=False),  # written with zero biases: GPT-2 always has them
    "llama-gqa": dict(arch="llama", n_kv_head=2),
    "llama-untied-mqa-head_dim": dict(arch="llama", n_kv_head=1, head_dim=24, tie_embeddings=False, mlp_hidden=96),
    "llama-rope-scaling": dict(arch="llama", n_kv_head=2, rope_base=5000.0, rope_scaling=LLAMA3, norm_eps=1e-6),
}


def small_bpe() -> tiktoken.Encoding:
    ranks = {bytes([i]): i for i in range(256)} | {m: 256 + i for i, m in enumerate(MERGES)}
    return tiktoken.Encoding(
        name="small_bpe", pat_str=GPT2_PAT, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": len(ranks)}
    )


def random_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**SMALL, **overrides}))
    with torch.no_grad():
        for p in model.parameters():  # every weight at a normal scale, norms and biases included
            torch.nn.init.normal_(p, std=0.5)
    return model.eval()


def load_hf(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (our model, its export folder), written once for the module."""
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for i, (name, overrides) in enumerate(CASES.items()):
        model = random_model(seed=i, **overrides)
        out[name] = model, export_hf(model, ByteTokenizer(), root / name)
    return out


@pytest.mark.parametrize("name", CASES)
def test_transformers_loads_the_export_and_gives_the_same_logits(exported, name):
    model, path = exported[name]
    assert {p.name for p in path.iterdir()} == EXPORT_FILES
    hf = load_hf(path)
    assert type(hf).__name__ == {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[model.config.arch]
    assert hf.dtype == torch.float32
    zero_biases = 2 * (64 + 3 * 64 + 64 + 64 + 4 * 64 + 64) + 64  # per layer ln_1, c_attn, c_proj, ln_2, c_fc, c_proj
    assert hf.num_parameters() == model.num_params() + (zero_biases if name == "gpt-no-bias" else 0)
    idx = torch.randint(0, SMALL["vocab_size"], (2, SMALL["block_size"]), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(idx)[0], hf(idx).logits
    assert ours.abs().max() > 1.0  # not a degenerate model
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["gpt-untied-tanh", "llama-rope-scaling"])
def test_greedy_generation_gives_the_same_tokens(exported, name):
    model, path = exported[name]
    hf = load_hf(path)
    prompt = torch.tensor([[10, 200, 31, 7, 99]])
    ours = generate(model, prompt, max_new_tokens=30, temperature=0)
    with torch.no_grad():
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False)
    assert len(set(ours[0, 5:].tolist())) > 2  # a real continuation, not one token repeated
    assert theirs.tolist() == ours.tolist()


@pytest.mark.parametrize("kind", ["char", "byte", "tiktoken"])
def test_autotokenizer_gives_our_ids(kind, tmp_path):
    tokenizer = {
        "char": lambda: CharTokenizer(SAMPLE + "xyz"),
        "byte": ByteTokenizer,
        "tiktoken": lambda: TiktokenTokenizer(small_bpe()),
    }[kind]()
    model = random_model(arch="llama", vocab_size=tokenizer.vocab_size)
    export_hf(model, tokenizer, tmp_path / "out")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tokenizer.encode(SAMPLE)
    if kind == "tiktoken":
        assert any(i >= 256 for i in ids), "the sample must exercise merges"
    assert hf_tok(SAMPLE)["input_ids"] == ids
    assert hf_tok.decode(ids) == SAMPLE
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    eot = tokenizer.eot_id  # tiktoken: <|endoftext|> is BOS and EOS, as in GPT-2; char and byte have none
    assert config["bos_token_id"] == config["eos_token_id"] == hf_tok.eos_token_id == eot
    # no max_length: transformers would warn at every generate(max_new_tokens=...) that both are set
    assert generation.get("eos_token_id") == eot and "max_length" not in generation


@pytest.mark.parametrize(
    "overrides, option",
    [
        (dict(qk_norm=True), "qk_norm=true"),
        (dict(mlp="relu2"), "mlp=relu2"),
        (dict(arch="llama", mlp="relu2"), "mlp=relu2"),
        (dict(mlp="swiglu"), "mlp=swiglu with arch gpt"),
        (dict(arch="llama", mlp="gelu"), "mlp=gelu with arch llama"),
        (dict(n_kv_head=2), "n_kv_head=2 (grouped-query attention) with arch gpt"),
        (dict(head_dim=8), "head_dim=8 with arch gpt"),
        (dict(arch="llama", n_embd=60, n_head=8, head_dim=8), "n_embd=60 with n_head=8"),
        (dict(arch="llama", bias=True), "bias=true with arch llama"),
    ],
)
def test_an_option_hf_cannot_express_is_one_line_and_writes_nothing(overrides, option, tmp_path):
    model = random_model(**overrides)
    with pytest.raises(UserError) as e:
        export_hf(model, ByteTokenizer(), tmp_path / "out")
    assert str(e.value).startswith(f"cannot export to Hugging Face: {option}") and "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_out_is_kept_unless_overwrite_and_overwrite_replaces_only_an_export(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    model = random_model()
    with pytest.raises(
        UserError,
        match=r"already holds files \(notes.txt\); choose another output folder, or "
        r"pass --overwrite",
    ):
        export_hf(model, ByteTokenizer(), out)
    with pytest.raises(
        UserError,
        match=r"holds no minigpt_export.json .* so its files may be yours and --overwrite "
        r"would delete notes.txt; choose another output folder",
    ):
        export_hf(model, ByteTokenizer(), out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"

    (out / "notes.txt").unlink()  # an empty folder takes an export
    export_hf(model, ByteTokenizer(), out)
    first = (out / "model.safetensors").read_bytes()
    other = random_model(seed=5)
    with pytest.raises(UserError, match="already holds files"):
        export_hf(other, ByteTokenizer(), out)
    assert (out / "model.safetensors").read_bytes() == first
    export_hf(other, ByteTokenizer(), out, overwrite=True)
    assert (out / "model.safetensors").read_bytes() != first
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary or old folder left beside it


def test_a_failed_export_leaves_nothing_and_keeps_the_old_export(tmp_path, monkeypatch):
    out = tmp_path / "out"
    export_hf(random_model(), ByteTokenizer(), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(tensors, path):
        path.write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("minigpt.export.hf.save_safetensors", full_disk)
    with pytest.raises(UserError, match=r"^cannot write .*out \(No space left on device\); free space there"):
        export_hf(random_model(seed=3), ByteTokenizer(), out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(UserError, match="No space left on device"):
        export_hf(random_model(seed=3), ByteTokenizer(), tmp_path / "new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def write_checkpoint(path, **overrides):
    tokenizer = CharTokenizer(SAMPLE)
    model = random_model(**{"vocab_size": tokenizer.vocab_size, **overrides})
    save_file(model_checkpoint(model, tokenizer), path)
    return model, tokenizer


def test_export_command_writes_a_folder_transformers_loads(tmp_path, capsys):
    model, tokenizer = write_checkpoint(tmp_path / "model.ckpt", arch="llama", n_kv_head=2)
    export_main(["--ckpt", str(tmp_path / "model.ckpt"), "--out", str(tmp_path / "hf")])
    line = capsys.readouterr().out
    assert line.startswith(f"wrote LlamaForCausalLM ({model.num_params():,} parameters) to {tmp_path / 'hf'}: ")
    assert line.count("\n") == 1
    hf = load_hf(tmp_path / "hf")
    text = SAMPLE[: SMALL["block_size"]]
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(text, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == tokenizer.encode(text)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids)[0], atol=1e-4, rtol=0)


def test_a_char_export_read_back_names_characters_outside_its_vocabulary(tmp_path):
    """The export's tokenizer.json has no unknown token (transformers' ids stay ours); read back by minigpt, a
    character outside the vocabulary is the same one-line error as with the checkpoint, not the tokenizers
    library's 'Missing [UNK] token' traceback."""
    write_checkpoint(tmp_path / "model.ckpt")
    export_main(["--ckpt", str(tmp_path / "model.ckpt"), "--out", str(tmp_path / "hf")])
    _, tokenizer = load_model(tmp_path / "hf")
    with pytest.raises(UnknownCharactersError) as e:
        tokenizer.encode(SAMPLE[:10] + "\u00a9\u2602")
    assert e.value.chars == ["\u00a9", "\u2602"]
    with pytest.raises(UnknownCharactersError):
        tokenizer.encode_batch([SAMPLE[:10], "\u00a9"])
    assert tokenizer.encode(SAMPLE[:10]) == CharTokenizer(SAMPLE).encode(SAMPLE[:10])
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "sample.py"),
            "--ckpt",
            str(tmp_path / "hf"),
            "--prompt",
            "\u00a9",
            "--max_new_tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        done.returncode == 2 and done.stderr.count("\n") == 1 and "outside the model's char vocabulary" in done.stderr
    ), done.stderr


def test_export_command_mistakes_are_one_line_exit_2(tmp_path):
    write_checkpoint(tmp_path / "qk.ckpt", qk_norm=True)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    missing = ["--ckpt", str(tmp_path / "missing.ckpt")]  # --out is checked before the checkpoint is looked at
    cases = [
        (["--ckpt", str(tmp_path / "qk.ckpt"), "--out", str(tmp_path / "out")], "qk_norm=true"),
        (["--ckpt", str(tmp_path / "qk.ckpt"), "--out", str(tmp_path / "taken")], "already holds files"),
        ([*missing, "--out", str(tmp_path / "taken"), "--overwrite"], "holds no minigpt_export.json"),
        (
            [*missing, "--out", str(tmp_path / "notes.txt" / "sub" / "hf")],
            f"{tmp_path / 'notes.txt'} is a file, not a folder, so {tmp_path / 'notes.txt' / 'sub' / 'hf'} cannot "
            "be created in it; choose another output folder",
        ),
        ([*missing, "--out", str(tmp_path / "notes.txt")], "notes.txt exists and is not a folder"),
        ([*missing, "--out", ""], "--out is empty"),
        ([*missing, "--out", str(tmp_path / "out")], "checkpoint not found"),
    ]
    # one interpreter runs export.py for each case, as `python export.py ARGS` would (its exit code and stderr)
    for (code, err), (_, expected) in zip(script_runs("export.py", [argv for argv, _ in cases], 120), cases):
        assert code == 2 and err.startswith("error: ") and expected in err, err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists() and [p.name for p in (tmp_path / "taken").iterdir()] == ["config.json"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("name", ["gpt-untied-tanh", "llama-untied-mqa-head_dim", "llama-rope-scaling"])
def test_importing_an_export_gives_back_the_same_logits(exported, name, tmp_path):
    pytest.importorskip("minigpt.hf.load", reason="minigpt.hf.load (the Hugging Face import) is not in this tree yet")
    model, path = exported[name]
    back, tokenizer = load_model(path)
    assert back.config == model.config and tokenizer.encode(SAMPLE) == list(SAMPLE.encode("utf-8"))
    idx = torch.randint(0, SMALL["vocab_size"], (2, SMALL["block_size"]), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(idx)[0], model(idx)[0], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_a_gpt2_sized_export_loads_and_agrees(arch, tmp_path):
    model = GPT(GPTConfig.from_name("gpt2", **({"arch": "llama", "n_kv_head": 4} if arch == "llama" else {}))).eval()
    export_hf(model, TiktokenTokenizer(small_bpe()), tmp_path / "out")
    hf = load_hf(tmp_path / "out")
    assert hf.num_parameters() == model.num_params()
    idx = torch.randint(0, 50257, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0], atol=1e-4, rtol=0)
