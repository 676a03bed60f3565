"""train.py, --resume, sample.py and a LoRA fine-tune on the GPU, each as a user runs it (a child process from the
repository root): precision auto picks bf16-mixed, torch.compile compiles, the loss falls, a resume reaches its new
max_steps, compiled sampling equals eager, LoRA trains the adapters only."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("jsonargparse", reason="the scripts' command line needs jsonargparse (pip install -e .)")

from minigpt.core.checkpoint import model_state_dict, read_checkpoint
from minigpt.core.generation import generate
from minigpt.core.lora import fingerprint
from minigpt.loading import load_lora_run, load_model

REPO = Path(__file__).resolve().parents[2]
STEPS = 50
PROMPT = "the quick "


def run_script(script: str, argv: list[str]) -> tuple[str, str]:
    """`python SCRIPT ARGV` from the repository root -> (stdout, stderr); a non-zero exit fails with its tail."""
    proc = subprocess.run(
        [sys.executable, script, *map(str, argv)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{tail}"
    return proc.stdout, proc.stderr


def run_output(script: str, argv: list[str]) -> str:
    return "\n".join(run_script(script, argv))


def gpu_run_args(tiny_run_args, corpus, data_root, out_dir: Path, steps: int, **overrides) -> list[str]:
    """tests/conftest.py's tiny run, made GPU-sized: a 2-layer llama with GQA, batch 32, precision auto."""
    return tiny_run_args(
        corpus,
        data_root,
        out_dir,
        steps=steps,
        model__arch="llama",
        model__n_layer=2,
        model__n_head=4,
        model__n_kv_head=2,
        model__n_embd=128,
        model__block_size=64,
        data__batch_size=32,
        optim__decay_steps=2 * STEPS,
        trainer__val_check_interval=25,
        checkpoint_every=25,
        trainer__accelerator="gpu",
        trainer__devices=1,
        trainer__precision="auto",
        **overrides,
    )


def full_val_loss(output: str) -> float:
    return float(re.findall(r"full val loss ([0-9.]+)", output)[-1])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, make_corpus, tiny_run_args):
    """One compiled run of STEPS steps: (run directory, its output, the flag builder for more runs on its data)."""
    work = tmp_path_factory.mktemp("gpu")
    corpus, data_root = make_corpus(work / "words.txt", 4000), work / "data"

    def args(out_dir: Path, steps: int, **overrides) -> list[str]:
        return gpu_run_args(tiny_run_args, corpus, data_root, out_dir, steps, **overrides)

    out = run_output("train.py", args(work / "run", STEPS) + ["--compile", "true"])
    return work / "run", out, args


def test_train_py_picks_bf16_compiles_and_the_loss_falls(trained):
    run, out, _ = trained
    assert "precision auto -> bf16-mixed" in out
    assert "bfloat16 Automatic Mixed Precision" in out  # Lightning's own line: it took the setting
    assert re.search(r"torch\.compile: compiled in [0-9.]+s", out)
    assert full_val_loss(out) < math.log(20) - 0.3  # below chance over the corpus's ~20 characters
    assert read_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == STEPS


def test_resume_restores_and_reaches_the_new_max_steps(trained, tmp_path):
    run, out, args = trained
    copy = shutil.copytree(run, tmp_path / "run")  # the other tests keep the run of STEPS steps
    more = STEPS + 30
    resumed = run_output("train.py", args(copy, more) + ["--compile", "true", "--resume", "true"])
    assert f"after {more} steps" in resumed and "estor" in resumed  # Lightning: "Restoring states ..."
    assert read_checkpoint(copy / "checkpoints" / "last.ckpt")["global_step"] == more
    assert full_val_loss(resumed) <= full_val_loss(out) + 0.05


def test_sample_py_compiled_equals_eager_and_int8_generates(trained):
    run, _, _ = trained
    base = ["--ckpt", run, "--device", "cuda", "--prompt", PROMPT, "--temperature", "0", "--max_new_tokens", 150]
    texts = {}
    for way, extra in {"eager": [], "compile": ["--compile"], "int8": ["--quantize", "int8"]}.items():
        texts[way], err = run_script("sample.py", base + extra)
        notes = [line for line in err.splitlines() if line.startswith("note:")]
        assert notes == [], way  # no fallback taken (e.g. "compile failed, eager instead")
    eager = texts["eager"]
    assert eager.startswith(PROMPT) and len(eager) >= len(PROMPT) + 75  # a char model: a character per token
    assert texts["compile"] == eager  # float32 either way: the same greedy tokens
    assert texts["int8"].startswith(PROMPT)


@pytest.mark.parametrize("extra", [[], ["--lora.base_dtype", "bfloat16"]], ids=["fp32-base", "bf16-base"])
def test_lora_trains_the_adapters_only_and_the_merged_run_generates(trained, tmp_path, extra):
    run, _, args = trained
    out_dir = tmp_path / "lora"
    argv = args(out_dir, 20) + ["--init_from", run, "--finetune", "lora", "--lora.rank", "4", "--eval_full", "false"]
    out = run_output("train.py", argv + extra)
    assert "precision auto -> bf16-mixed" in out
    ckpt = read_checkpoint(out_dir / "checkpoints" / "last.ckpt")
    saved = model_state_dict(ckpt)
    assert saved and all("lora_" in k for k in saved)  # the adapters only
    assert len(ckpt["optimizer_states"][0]["state"]) == len(saved)
    assert any(t.abs().max().item() > 0 for k, t in saved.items() if "lora_B" in k)  # B starts at 0: it trained
    source, _ = load_model(run)
    assert ckpt["minigpt"]["lora"]["base"]["fingerprint"] == fingerprint(source)
    adapted, _, _ = load_lora_run(out_dir)
    state = adapted.state_dict()
    for k, t in source.state_dict().items():  # the base untouched (to its stored dtype)
        assert torch.equal(state[k].float(), t.to(state[k].dtype).float()), k
    merged, tok = load_model(out_dir, device="cuda")  # merged on load, as sample.py, eval.py and serve do
    ids = generate(merged, torch.tensor([tok.encode("the ")], device="cuda"), 20, temperature=0)
    assert ids.shape == (1, 24) and tok.decode(ids[0].tolist()).startswith("the ")


@pytest.mark.parametrize("early, made", [("1", True), ("0", False)])
def test_train_makes_the_cuda_context_while_lightning_imports(early, made):
    """One GPU visible: train's launch makes the context in a thread while train's modules (Lightning) import, so
    it exists once they are loaded; MINIGPT_EARLY_CUDA=0 leaves it to Lightning's setup."""
    code = (
        "from minigpt.cli.cuda_start import start_cuda_early; thread = start_cuda_early(); import minigpt.cli.train; "
        "thread and thread.join(); import torch; print(torch.cuda.is_initialized(), torch.cuda.memory_reserved() > 0)"
    )
    env = dict(os.environ, MINIGPT_EARLY_CUDA=early)
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(made), str(made)]
