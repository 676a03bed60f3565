"""A config is refused from the memory it implies, before anything is allocated: fields that each pass their
plausible bound can still multiply to terabytes.  MINIGPT_MAX_MODEL_GB raises the bound for users who mean it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minigpt.core.config import GPTConfig
from minigpt.core.errors import CheckpointError, ConfigError, UserError
from minigpt.core.limits import MAX_MODEL_GB_ENV, check_config_size, check_sampling_size, implied_bytes, sampling_bytes
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.export.hf import export_hf
from minigpt.loading import load_model

REPO = Path(__file__).resolve().parents[2]
# each field within CONFIG_LIMITS; together 1.1 TB of RoPE tables (cos and sin: 2 x 2^21 positions x 65536 x 4 bytes)
HUGE_LLAMA = dict(
    arch="llama", n_layer=2, n_head=4, n_kv_head=4, n_embd=64, head_dim=65536, block_size=1 << 21, vocab_size=256
)


@pytest.mark.parametrize(
    "config",
    [
        GPTConfig(arch="gpt", n_layer=2, n_head=2, n_embd=16, block_size=32, vocab_size=100),
        GPTConfig(
            arch="llama",
            n_layer=2,
            n_head=4,
            n_kv_head=2,
            n_embd=32,
            block_size=24,
            vocab_size=90,
            tie_embeddings=False,
        ),
    ],
)
def test_the_implied_memory_is_what_the_built_model_holds(config):
    model = GPT(config)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert implied_bytes(config) == {"weights": weights, **({"RoPE tables": buffers} if buffers else {})}


def test_fields_that_each_pass_are_refused_by_their_product(monkeypatch):
    monkeypatch.delenv(MAX_MODEL_GB_ENV, raising=False)
    started = time.perf_counter()
    with pytest.raises(
        CheckpointError,
        match=r"^its config.json implies a model of 1100\.0 GB \(weights 0\.5 GB, "
        r"RoPE tables 1099\.5 GB\), more than this machine's memory",
    ) as e:
        check_config_size(GPTConfig(**HUGE_LLAMA), "its config.json", CheckpointError)
    assert f"set {MAX_MODEL_GB_ENV}=GB to build it anyway" in str(e.value) and "\n" not in str(e.value)
    assert time.perf_counter() - started < 5  # decided on the meta device, not in the allocator


def test_the_override_raises_and_lowers_the_bound(monkeypatch):
    tiny = GPTConfig(arch="gpt", n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=64)
    check_config_size(tiny, "x")
    monkeypatch.setenv(MAX_MODEL_GB_ENV, "0.00001")  # 10 kB: the tiny model's 22 kB is over it
    with pytest.raises(UserError, match=rf"more than {MAX_MODEL_GB_ENV}=0.00001 \(0.0 GB\)"):
        check_config_size(tiny, "x")
    monkeypatch.setenv(MAX_MODEL_GB_ENV, "1000")
    check_config_size(GPTConfig(**{**HUGE_LLAMA, "block_size": 1 << 14}), "x")  # 4.3 GB: allowed when asked for
    monkeypatch.setenv(MAX_MODEL_GB_ENV, "lots")
    with pytest.raises(UserError, match=f"{MAX_MODEL_GB_ENV}='lots' is not a number of gigabytes"):
        check_config_size(tiny, "x")


def test_a_hugging_face_config_implying_terabytes_is_one_line_without_allocating(tmp_path):
    """The issue's case: head_dim 65536 with a 2^21 context passed every per-field bound and died in the
    allocator.  Loaded under a 2 GB address-space limit: refused from the config, nothing allocated."""
    torch.manual_seed(0)
    folder = tmp_path / "model"
    export_hf(
        GPT(GPTConfig(arch="llama", n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=256)),
        ByteTokenizer(),
        folder,
    )
    config = json.loads((folder / "config.json").read_text())
    config.update(head_dim=65536, max_position_embeddings=1 << 21)
    (folder / "config.json").write_text(json.dumps(config))
    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
        f"from minigpt.cli.sample import main; main(['--ckpt', {str(folder)!r}, '--max_new_tokens', '2'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(f"error: {folder}: its config.json implies a model of"), done.stderr
    assert "RoPE tables" in done.stderr and done.stderr.count("\n") == 1


def test_a_checkpoint_config_is_checked_the_same_way(tmp_path, monkeypatch):
    from minigpt.core.checkpoint import model_checkpoint, save_file

    torch.manual_seed(0)
    config = GPTConfig(arch="llama", n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=256)
    path = tmp_path / "m.ckpt"
    save_file(model_checkpoint(GPT(config), ByteTokenizer()), path)
    monkeypatch.setenv(MAX_MODEL_GB_ENV, "0.00001")
    with pytest.raises(CheckpointError, match="its config implies a model of"):
        load_model(path)
    monkeypatch.delenv(MAX_MODEL_GB_ENV)
    load_model(path)


def test_training_refuses_a_model_over_the_bound_before_building_it(monkeypatch):
    from minigpt.training.lightning_module import GPTLightningModule

    monkeypatch.setenv(MAX_MODEL_GB_ENV, "0.00001")
    with pytest.raises(ConfigError, match=r"^the model config implies a model of .*; choose smaller sizes, or set"):
        GPTLightningModule(GPTConfig(arch="gpt", n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=64))


def test_sampling_memory_is_bounded_from_the_sizes_before_anything_is_allocated(monkeypatch):
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=100)
    parts = sampling_bytes(config, batch=1000, prompt_tokens=10, new_tokens=100)
    assert parts["logits"] == 4 * 1000 * 10 * 100 and parts["tokens"] == 8 * 1000 * 110
    assert parts["KV cache"] == 4 * 2 * 2 * 1000 * 2 * 64 * 16  # 2 x 110 positions, capped at block_size
    sliding = GPTConfig(
        **{**config.to_dict(), "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    )
    assert sampling_bytes(sliding, 1000, 10, 100)["KV cache"] == 4 * 2 * 1000 * 2 * (8 + 64) * 16  # a ring of 8
    monkeypatch.setenv("MINIGPT_MAX_MODEL_GB", "1")
    check_sampling_size(config, 1000, 10, 100)  # about 0.1 GB
    with pytest.raises(
        UserError,
        match=r"generating 100,000 sequence\(s\) of 10 \+ 100 tokens .* more than "
        r"MINIGPT_MAX_MODEL_GB=1 \(1.0 GB\); draw fewer samples",
    ):
        check_sampling_size(config, 100_000, 10, 100)


def test_sample_py_builds_the_model_once_its_load_and_its_memory_check_included(tmp_path, monkeypatch):
    """The sampling check measures the model the load built (on the meta device, then filled), not a second one."""
    import io

    from minigpt.cli import sample as sample_cli
    from minigpt.core.checkpoint import model_checkpoint, save_file
    from minigpt.core.tokenizers import CharTokenizer
    from support import count_model_builds

    torch.manual_seed(0)
    config = GPTConfig(arch="llama", n_layer=1, n_head=2, n_kv_head=1, n_embd=16, block_size=8, vocab_size=5)
    save_file(model_checkpoint(GPT(config), CharTokenizer("abcde")), tmp_path / "m.ckpt")
    builds = count_model_builds(monkeypatch)
    out = io.StringIO()
    sample_cli.main(["--ckpt", str(tmp_path / "m.ckpt"), "--prompt", "ab", "--max_new_tokens", "3"], stdout=out)
    assert builds == ["meta"] and out.getvalue().startswith("ab")
    model = GPT(config)  # given the model, the check builds nothing and counts what the config implies
    builds.clear()
    monkeypatch.setenv(MAX_MODEL_GB_ENV, "1")
    check_sampling_size(config, 1000, 10, 100, model=model)
    with pytest.raises(UserError, match=r"generating 100,000 sequence\(s\)"):
        check_sampling_size(config, 100_000, 10, 100, model=model)
    assert builds == []
