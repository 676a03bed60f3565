"""A LoRA run in the ecosystem's formats: export.py --format peft writes PEFT's adapter files that
peft.PeftModel.from_pretrained loads onto the base export beside them, computing minigpt's logits; export.py's
Hugging Face export of a LoRA run is the merged model, which plain transformers loads.  Offline: every model is
built here, adapters drawn at random (std 0.2) so a wrong layout, order or scale cannot hide."""

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from minigpt.cli.export import main as export_main
from minigpt.cli.train import main as train_main
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.config import GPTConfig
from minigpt.core.errors import UserError
from minigpt.core.lora import LoRAConfig, lora_model
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.export.peft import export_peft
from minigpt.loading import load_lora_run, load_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SMALL = dict(n_layer=2, n_head=4, n_embd=32, block_size=24, vocab_size=50)
CASES = {  # each row exercises another layout: GPT-2's fused c_attn (rank_pattern), Llama's separate q/k/v
    "gpt-all": (dict(arch="gpt"), dict()),
    "gpt-q-k-untied": (dict(arch="gpt", tie_embeddings=False), dict(targets=["q", "k", "up"])),
    "llama-gqa-all-bf16": (dict(arch="llama", n_kv_head=2), dict(base_dtype="bfloat16")),
    "llama-untied-q-v": (dict(arch="llama", n_kv_head=1, tie_embeddings=False), dict(targets=["q", "v"], alpha=4)),
    # train_embeddings: every token row (trainable_token_indices) and GPT-2's positions (modules_to_save)
    "gpt-embeddings": (dict(arch="gpt"), dict(train_embeddings=True)),
    "llama-untied-embeddings": (dict(arch="llama", n_kv_head=2, tie_embeddings=False), dict(train_embeddings=True)),
}


def trained_lora(model_kw: dict, lora_kw: dict, grow: int = 3) -> tuple[GPT, LoRAConfig]:
    torch.manual_seed(0)
    base = GPT(GPTConfig(**{**SMALL, **model_kw}))
    with torch.no_grad():
        for p in base.parameters():
            torch.nn.init.normal_(p, std=0.3)
    cfg = LoRAConfig(rank=4, **lora_kw)
    run = GPTConfig.from_dict({**base.config.to_dict(), "vocab_size": SMALL["vocab_size"] + grow})
    model = lora_model(base, run, cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.2)
    return model, cfg


def peft_logits(adapter, base_dir, idx: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    with torch.no_grad():
        return peft.PeftModel.from_pretrained(hf, adapter).eval()(idx).logits


@pytest.mark.parametrize("case", CASES)
def test_peft_loads_the_adapter_onto_the_base_export_with_our_logits(case, tmp_path):
    model, cfg = trained_lora(*CASES[case])
    idx = torch.randint(0, 53, (2, 20))  # new tokens (50..52) included: PEFT's trainable_token_indices
    with torch.no_grad():
        expected, _ = model(idx)
    export_peft(model, None, cfg, tmp_path / "adapter", tmp_path / "base")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    torch.testing.assert_close(peft_logits(tmp_path / "adapter", tmp_path / "base", idx), expected, atol=1e-4, rtol=0)


def test_the_base_export_alone_is_the_run_before_training(tmp_path):
    model, cfg = trained_lora(dict(arch="llama", n_kv_head=2), dict())
    start = copy.deepcopy(model)
    with torch.no_grad():  # what the run started from: B zero, new rows at the mean
        for name, p in start.named_parameters():
            if ".lora_B." in name:
                p.zero_()
        start.lm_head.new_rows.copy_(start.lm_head.weight.mean(dim=0).expand_as(start.lm_head.new_rows))
    export_peft(model, None, cfg, tmp_path / "adapter", tmp_path / "base")
    idx = torch.randint(0, 53, (2, 20))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, start(idx)[0], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, corpus):
    """A byte-level llama base (a checkpoint file) and a LoRA run of a few steps on it."""
    root = tmp_path_factory.mktemp("lora_run")
    torch.manual_seed(0)
    base = GPT(GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=32, vocab_size=256))
    save_file(model_checkpoint(base, ByteTokenizer()), root / "base.ckpt")
    train_main(
        [
            "--init_from",
            str(root / "base.ckpt"),
            "--finetune",
            "lora",
            "--lora.rank",
            "4",
            "--data.source",
            str(corpus),
            "--data.data_root",
            str(root / "data"),
            "--out_dir",
            str(root / "run"),
            "--data.batch_size",
            "4",
            "--data.val_batches",
            "1",
            "--trainer.max_steps",
            "6",
            "--trainer.val_check_interval",
            "6",
            "--trainer.enable_progress_bar",
            "false",
            "--sample_tokens",
            "0",
            "--optim.learning_rate",
            "0.05",
            "--optim.warmup_steps",
            "0",
            "--eval_full",
            "false",
        ]
    )
    return root / "run"


def test_export_py_writes_peft_files_and_the_merged_model_from_a_lora_run(lora_run, tmp_path, capsys):
    model, tokenizer = load_model(lora_run)  # merged on load
    idx = torch.tensor([tokenizer.encode("the quick brown fox jumps")])
    with torch.no_grad():
        expected, _ = model(idx)

    export_main(["--ckpt", str(lora_run), "--format", "peft", "--out", str(tmp_path / "adapter")])
    assert (
        "wrote PEFT LoRA adapters (" in (out := capsys.readouterr().out) and ", rank 4) to " in out
    )  # llama: none fused
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "minigpt_export.json",
    ]
    torch.testing.assert_close(
        peft_logits(tmp_path / "adapter", tmp_path / "adapter-base", idx), expected, atol=1e-4, rtol=0
    )

    export_main(["--ckpt", str(lora_run), "--out", str(tmp_path / "merged")])  # --format hf: the merged model
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, expected, atol=1e-4, rtol=0)

    export_main(["--ckpt", str(lora_run), "--format", "peft", "--out", str(tmp_path / "adapter"), "--overwrite"])
    with pytest.raises(SystemExit):  # the adapters' folder is no model: said as such, not "no checkpoint in run"
        export_main(["--ckpt", str(tmp_path / "adapter"), "--out", str(tmp_path / "again")])
    assert "holds PEFT adapters (adapter_config.json), not a whole model" in capsys.readouterr().err


def test_peft_export_of_a_run_without_adapters_is_one_line(lora_run, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        export_main(["--ckpt", str(lora_run.parent / "base.ckpt"), "--format", "peft", "--out", str(tmp_path / "a")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "is not a LoRA run" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "a").exists() and not (tmp_path / "a-base").exists()


def test_peft_export_into_one_folder_or_nested_folders_is_refused_before_writing(lora_run, tmp_path, capsys):
    d = tmp_path / "d"
    for out, base in [(d, d), (d, d / "base"), (d / "adapter", d), (d, tmp_path / "." / "d" / "..")]:
        with pytest.raises(SystemExit) as e:
            export_main(["--ckpt", str(lora_run), "--format", "peft", "--out", str(out), "--base_out", str(base)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert (
            "(the adapters) and --base_out" in err
            and "; give two separate folders" in err
            and ("the same folder" in err or "one inside the other" in err)
        ), err
        assert list(tmp_path.iterdir()) == []  # nothing written, not even the folders
    # a previous export there with --overwrite: refused all the same, and kept
    export_main(["--ckpt", str(lora_run), "--format", "peft", "--out", str(d)])
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    with pytest.raises(SystemExit) as e:
        export_main(["--ckpt", str(lora_run), "--format", "peft", "--out", str(d), "--base_out", str(d), "--overwrite"])
    assert e.value.code == 2 and "are the same folder" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    with pytest.raises(UserError, match="one inside the other"):  # the library refuses it too
        export_peft(*load_lora_run(lora_run), d / "x", d / "x" / "y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "d-base"]


def test_ctrl_c_says_which_of_the_two_folders_is_complete(lora_run, tmp_path):
    """A SIGINT the export sends itself (tests/export/ctrl_c.py): after the base's final rename (written first) the
    base is complete and the adapters' folder is as it was; after both, the export is complete; during the exit,
    nothing happens."""
    sys.path.insert(0, str(Path(__file__).parent))
    from ctrl_c import export_with_ctrl_c

    out, base = tmp_path / "adapter", tmp_path / "adapter-base"
    argv = ["--ckpt", str(lora_run), "--format", "peft", "--out", str(out)]
    proc = export_with_ctrl_c("after the final rename", out, *argv)
    assert (proc.returncode, proc.stderr) == (
        130,
        f"error: interrupted before the export was complete: {base} holds the new base, {out} is as it was; run "
        "the export again (with --overwrite)\n",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter-base"]
    proc = export_with_ctrl_c("while the result line is printed", out, *argv, "--overwrite")
    *before, last = proc.stderr.splitlines()  # before: the line naming the checkpoint the export took
    assert (proc.returncode, last) == (130, f"interrupted after the export was complete: it is in {base} and {out}")
    assert [line.split(" ")[0] for line in before] == ["using"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "adapter-base"]
    proc = export_with_ctrl_c("during the exit", out, *argv, "--overwrite")
    assert proc.returncode == 0 and proc.stdout.startswith("wrote PEFT LoRA adapters")
    assert [line.split(" ")[0] for line in proc.stderr.splitlines()] == ["using"]  # the checkpoint's line alone


def test_the_merged_gguf_of_a_lora_run_runs_in_llama_cpp_with_our_log_probs(lora_run, tmp_path):
    pytest.importorskip("xllamacpp")
    sys.path.insert(0, str(Path(__file__).parent))
    from llamacpp_server import LlamaCpp  # tests/export/: llama.cpp's server on 127.0.0.1, in this process

    export_main(["--ckpt", str(lora_run), "--format", "gguf", "--out", str(tmp_path / "merged.gguf")])
    model, tokenizer = load_model(lora_run)
    ids = tokenizer.encode("the quick brown fox jumps over")
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids]))[0][0].double(), -1)  # (T, vocab)
    with LlamaCpp(tmp_path / "merged.gguf") as llama:
        for t in (4, len(ids)):
            theirs = llama.next_logprobs(ids[:t], 8)
            assert max(abs(reference[t - 1, i].item() - lp) for i, lp in theirs.items()) < 1e-4
