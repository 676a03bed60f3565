"""`export.py --format gguf`: the command exports a checkpoint or an imported Hugging Face folder (its tokenizer, BOS
and chat template included) to one file llama.cpp runs, and every mistake is one `error:` line with exit code 2,
before anything is written: an --out that exists, an option llama.cpp cannot express, a bad --gguf_type.  Ctrl-C
is one line and exit 130 (the file's own guards, --overwrite and a failed write: test_gguf_file.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minigpt.cli.export import main as export_main
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.generation import generate
from minigpt.core.tokenizers import CharTokenizer
from minigpt.export.gguf import export_gguf
from minigpt.export.gguf_file import check_previous_gguf
from minigpt.loading import load_model
from support import script_runs

sys.path.insert(0, str(Path(__file__).parent))
from gguf_models import TEXTS, hf_tokenizer, random_model
from llamacpp_server import LlamaCpp

gguf = pytest.importorskip("gguf")
pytest.importorskip("xllamacpp")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is as fast
REPO = Path(__file__).resolve().parents[2]
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n  héllo wörld ☃\n"


def write_checkpoint(path: Path, **overrides):
    tokenizer = CharTokenizer(TEXT)
    model = random_model(**{"vocab_size": tokenizer.vocab_size, **overrides})
    save_file(model_checkpoint(model, tokenizer), path)
    return model, tokenizer


def metadata(path: Path, key: str):
    field = gguf.GGUFReader(path).fields[key]
    return field.contents()


def test_export_command_writes_one_file_llama_cpp_runs(tmp_path, capsys):
    model, tokenizer = write_checkpoint(tmp_path / "model.ckpt", arch="llama", n_kv_head=2)
    out = tmp_path / "models" / "tiny.gguf"  # its folder is created
    export_main(["--ckpt", str(tmp_path / "model.ckpt"), "--format", "gguf", "--out", str(out), "--gguf_type", "q8_0"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(
        f"wrote llama GGUF ({model.num_params():,} parameters, q8_0, char vocabulary (llama.cpp pre-tokenizer gpt-2)) "
        f"to {out}"
    )
    assert lines[1].startswith("note: a char vocabulary has no end-of-text token") and len(lines) == 2
    assert metadata(out, "general.name") == "model" and metadata(out, "general.file_type") == 7
    assert [p.name for p in out.parent.iterdir()] == ["tiny.gguf"]  # no temporary file beside it
    check_previous_gguf(out)  # it carries its own SHA-256
    ids = tokenizer.encode(TEXT[:40])
    with LlamaCpp(out) as llama:
        assert llama.tokenize(TEXT[:40]) == ids
        with torch.no_grad():
            ours = generate(model, torch.tensor([ids]), max_new_tokens=16, temperature=0)[0, 40:].tolist()
        assert sum(a == b for a, b in zip(llama.argmax_along(ids, ours), ours)) >= 15  # q8_0


def test_the_files_name_is_the_models_the_run_for_its_checkpoints():
    """general.name is what Ollama and LM Studio show: a run's folder for one of its checkpoints, not last.ckpt."""
    from minigpt.cli.export import model_name

    assert model_name("out/shakespeare/checkpoints/last.ckpt") == "shakespeare"
    assert model_name("out/shakespeare") == "shakespeare" and model_name("hf:Org/SmolLM2-135M") == "SmolLM2-135M"
    assert model_name("weights/model.ckpt") == model_name("checkpoints/model.ckpt") == "model"
    assert model_name(None) == "minigpt"


def test_the_python_snippet_of_docs_gguf_md_runs_as_written(tmp_path):
    """docs/gguf.md's Python block, run as a user would (its own process, beside my-model.gguf): it prints the
    greedy text minigpt writes from the prompt."""
    snippet = re.search(r"```python\n(.*?)```", (REPO / "docs" / "gguf.md").read_text(), re.S).group(1)
    tokenizer = CharTokenizer("ROMEO: JULIET, what light through yonder window breaks?\n")
    model = random_model(vocab_size=tokenizer.vocab_size, block_size=128)
    export_gguf(model, tokenizer, tmp_path / "my-model.gguf")
    proc = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    prompt = tokenizer.encode("ROMEO:")
    with torch.no_grad():
        ours = generate(model, torch.tensor([prompt]), max_new_tokens=32, temperature=0)[0, len(prompt) :].tolist()
    assert proc.stdout.rstrip("\n") == tokenizer.decode(ours).rstrip("\n")


# the Llama 3 way: a ChatML template in tokenizer_config.json, and <|begin_of_text|> before every text
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def hf_folder(folder: Path, family: str) -> None:
    """Saved by transformers: a LlamaForCausalLM (GQA, untied, RoPE theta 500000) with a Llama-3-style tokenizer that
    puts BOS first, or a GPT2LMHeadModel with a GPT-2-style byte-level tokenizer; both with a ChatML template."""
    import tokenizers

    transformers = pytest.importorskip("transformers")

    backend = tokenizers.Tokenizer.from_str(hf_tokenizer("llama3" if family == "llama" else "bytelevel").tokenizer_json)
    backend.add_special_tokens(
        [
            tokenizers.AddedToken(t, special=True, normalized=False)
            for t in ("<|begin_of_text|>", "<|im_start|>", "<|im_end|>")
        ]
    )
    if family == "llama":
        bos = ("<|begin_of_text|>", backend.token_to_id("<|begin_of_text|>"))
        backend.post_processor = tokenizers.processors.TemplateProcessing(single=f"{bos[0]} $A", special_tokens=[bos])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|im_end|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    ids = dict(vocab_size=len(fast), bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=96,
                rope_theta=500000.0,
                tie_word_embeddings=False,
                **ids,
            )
        )
    else:
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=96, **ids)
        )
    with torch.no_grad():  # drawn as gguf_models.random_model draws them (GPT-2's Conv1D is (in, out): 64 in)
        for name, p in model.named_parameters():
            p.normal_(0, 0.25) if p.dim() >= 2 else p.normal_(0 if name.endswith("bias") else 1, 0.2)
    model.save_pretrained(folder)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_imported_hugging_face_folder_exports_with_its_tokenizer_and_template(family, tmp_path, capsys):
    hf_folder(tmp_path / "hf", family)
    export_main(["--ckpt", str(tmp_path / "hf"), "--format", "gguf", "--out", str(tmp_path / "m.gguf")])
    pre = {"llama": "llama-bpe", "gpt2": "gpt-2"}[family]
    assert f"wrote {family} GGUF" in (out := capsys.readouterr().out) and f"tokenizer {pre} + chat template" in out
    model, tokenizer = load_model(tmp_path / "hf")
    assert metadata(tmp_path / "m.gguf", "tokenizer.chat_template") == CHATML
    assert metadata(tmp_path / "m.gguf", "tokenizer.ggml.add_bos_token") is (family == "llama")
    with LlamaCpp(tmp_path / "m.gguf") as llama:
        for text in TEXTS:
            assert llama.tokenize(text, add_special=True) == tokenizer.encode(text), text  # BOS first, as minigpt
        prompt = tokenizer.encode(TEXTS[0])
        with torch.no_grad():
            ours = generate(model, torch.tensor([prompt]), max_new_tokens=32, temperature=0)[0, len(prompt) :].tolist()
            reference = torch.log_softmax(model(torch.tensor([prompt]))[0][0, -1].double(), -1)
        assert len(set(ours)) > 8 and llama.argmax_along(prompt, ours) == ours
        theirs = llama.next_logprobs(prompt, 8)
        assert max(abs(reference[i].item() - lp) for i, lp in theirs.items()) < (1e-4 if family == "llama" else 3e-3)


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    write_checkpoint(tmp_path / "model.ckpt")
    monkeypatch.setattr(
        gguf.GGUFWriter, "write_tensors_to_file", lambda self, **kw: (_ for _ in ()).throw(KeyboardInterrupt())
    )
    with pytest.raises(SystemExit) as e:
        export_main(["--ckpt", str(tmp_path / "model.ckpt"), "--format", "gguf", "--out", str(tmp_path / "m.gguf")])
    assert e.value.code == 130
    assert (
        capsys.readouterr().err
        == f"error: interrupted before the export was complete; {tmp_path / 'm.gguf'} as it was\n"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["model.ckpt"]


def test_export_command_mistakes_are_one_line_exit_2_and_write_nothing(tmp_path):
    write_checkpoint(tmp_path / "qk.ckpt", arch="llama", qk_norm=True)
    write_checkpoint(tmp_path / "relu2.ckpt", mlp="relu2")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "folder").mkdir()
    missing = ["--ckpt", str(tmp_path / "missing.ckpt"), "--format", "gguf"]  # --out is checked before loading
    cases = [
        (
            ["--ckpt", str(tmp_path / "qk.ckpt"), "--format", "gguf", "--out", str(tmp_path / "a.gguf")],
            "cannot export to GGUF: qk_norm=true: llama.cpp's llama architecture has no query/key normalisation",
        ),
        (
            ["--ckpt", str(tmp_path / "relu2.ckpt"), "--format", "gguf", "--out", str(tmp_path / "a.gguf")],
            "mlp=relu2 with arch gpt: llama.cpp's gpt2 MLP is GELU only",
        ),
        ([*missing, "--out", str(tmp_path / "notes.txt")], "notes.txt already exists; choose another output file"),
        ([*missing, "--out", str(tmp_path / "notes.txt"), "--overwrite"], "is not a GGUF file export.py wrote"),
        ([*missing, "--out", str(tmp_path / "folder")], "folder is a folder; give the path of the .gguf file"),
        ([*missing, "--out", str(tmp_path / "notes.txt" / "m.gguf")], "notes.txt exists and is not a folder"),
        ([*missing, "--out", str(tmp_path / "a.gguf")], "checkpoint not found"),
        ([*missing, "--out", str(tmp_path / "a.gguf"), "--gguf_type", "q3_k"], "gguf_type"),
        (
            ["--ckpt", str(tmp_path / "qk.ckpt"), "--out", str(tmp_path / "hf"), "--gguf_type", "q8_0"],
            "--gguf_type is a setting of --format gguf",
        ),
        (
            ["--ckpt", str(tmp_path / "qk.ckpt"), "--out", str(tmp_path / "hf"), "--base_out", str(tmp_path / "b")],
            "--base_out is a setting of --format peft; add --format peft, or drop --base_out",
        ),
        (
            ["--ckpt", str(tmp_path / "qk.ckpt"), "--out", str(tmp_path / "m.gguf")],
            "names a .gguf file but --format is hf; add --format gguf",
        ),
    ]
    for (code, err), (_, expected) in zip(script_runs("export.py", [argv for argv, _ in cases], 300), cases):
        assert code == 2 and err.startswith("error: ") and expected in err, err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "notes.txt", "qk.ckpt", "relu2.ckpt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_the_benchmark_runs_end_to_end(tmp_path, capsys):
    """benchmarks/bench_gguf.py --quick: every row of its two tables, and the JSON it promises."""
    sys.path.insert(0, str(REPO))
    from benchmarks import bench_gguf

    result = bench_gguf.main(["--quick", "--threads", "1", "--json", str(tmp_path / "gguf.json")])
    assert json.loads((tmp_path / "gguf.json").read_text())["results"] == json.loads(json.dumps(result["results"]))
    rows = result["results"]
    assert [(r["runtime"].split()[0], r["weights"]) for r in rows[:5]] == [("minigpt", "float32")] + [
        ("llama.cpp", q) for q in ("f32", "f16", "q8_0", "q4_0")
    ]
    assert len(rows) == 10 and all(r["decode_tok_s"] > 0 for r in rows)
    sizes = [r["file_mib"] for r in rows[1:5]]
    assert sizes == sorted(sizes, reverse=True)
    assert {(r["model"], r["weights"]) for r in result["agreement"]} == {
        (m, q) for m in ("char-llama", "byte-gpt") for q in ("f32", "f16", "bf16", "q8_0", "q4_0")
    }
    assert all(r["positions"] == 95 and r["ppl_ratio"] > 0 for r in result["agreement"])
    assert "| shape | runtime | weights |" in capsys.readouterr().out
