"""precision: auto picks bf16 only where the device computes it natively, on faked devices of every kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]  # the repository root
from minigpt.core import precision
from minigpt.core.errors import ConfigError
from minigpt.core.precision import resolve_precision


@pytest.fixture
def cpu(monkeypatch, tmp_path):
    """A CPU-only machine whose capability and matmul rates the test sets."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)

    def machine(capability: str, fp32: float = 200.0, bf16: float = 800.0) -> None:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.setattr(
            precision, "matmul_gflops", lambda dtype, *a, **k: bf16 if dtype == torch.bfloat16 else fp32
        )

    return machine


def test_avx2_cpu_gets_float32_without_a_probe(cpu, monkeypatch):
    cpu("AVX2")
    monkeypatch.setattr(precision, "probe_cpu_bf16", lambda: pytest.fail("AVX2 needs no probe"))
    chosen, why = resolve_precision("auto", "auto", "manual")
    assert chosen == "32-true" and "AVX2 has no native bf16" in why


def test_avx512_cpu_is_probed_bf16_native_or_not(cpu):
    cpu("AVX512", fp32=200, bf16=800)  # AMX / AVX512_BF16: bf16 matmuls 4x float32
    assert resolve_precision("auto", "cpu", "manual")[0] == "bf16-mixed"
    cpu("AVX512", fp32=200, bf16=60)  # AVX-512 without BF16: emulated
    precision._cache_file().unlink()
    chosen, why = resolve_precision("auto", "cpu", "manual")
    assert chosen == "32-true" and "200 GFLOP/s float32 vs 60 GFLOP/s bf16" in why


def test_sdpa_keeps_float32_on_a_bf16_cpu(cpu):
    cpu("AVX512", fp32=200, bf16=800)
    chosen, why = resolve_precision("auto", "cpu", "sdpa")
    assert chosen == "32-true" and "sdpa" in why


def test_probe_is_cached_per_machine(cpu, monkeypatch):
    cpu("AVX512", fp32=200, bf16=800)
    assert precision.probe_cpu_bf16() == (200, 800)
    monkeypatch.setattr(precision, "matmul_gflops", lambda *a, **k: pytest.fail("measured again"))
    assert precision.probe_cpu_bf16() == (200, 800)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # another ISA setting is another machine
    monkeypatch.setattr(precision, "matmul_gflops", lambda dtype, *a, **k: 1.0 if dtype == torch.bfloat16 else 150.0)
    assert precision.probe_cpu_bf16() == (150.0, 1.0)


def test_probe_cache_is_written_whole_and_an_unwritable_cache_does_not_stop_training(cpu):
    cpu("AVX512", fp32=200, bf16=800)
    assert precision.probe_cpu_bf16() == (200, 800)
    folder = precision._cache_file().parent
    assert [p.name for p in folder.iterdir()] == ["cpu_bf16_probe.json"]  # no temporary file left beside it
    precision._cache_file().write_text('{"key": ')  # a cut-off cache file is measured again, and replaced
    cpu("AVX512", fp32=100, bf16=50)
    assert precision.probe_cpu_bf16() == (100, 50)
    assert json.loads(precision._cache_file().read_text())["bf16_gflops"] == 50
    precision._cache_file().unlink()
    folder.rmdir()
    folder.write_text("a file where the cache folder should be")  # the cache cannot be written
    assert precision.probe_cpu_bf16() == (100, 50)
    assert resolve_precision("auto", "cpu", "manual")[0] == "32-true"  # (bf16 measured slower)


@pytest.mark.parametrize("bf16,expected", [(True, "bf16-mixed"), (False, "32-true")])
def test_cuda_with_and_without_bf16(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    chosen, why = resolve_precision("auto", "auto", "sdpa")
    assert chosen == expected and "Fake GPU" in why
    assert resolve_precision("auto", "cpu", "sdpa")[0] != "bf16-mixed" or bf16  # accelerator cpu: not the GPU


def test_explicit_precision_is_kept(cpu):
    cpu("AVX2")
    assert resolve_precision("bf16-mixed", "cpu", "manual")[0] == "bf16-mixed"


@pytest.mark.parametrize("given", ["bf16-mixed", "bf16-true", "16-mixed"])
def test_explicit_half_precision_on_a_cpu_without_bf16_gets_a_note(cpu, given):
    """Kept as given, but said: on an AVX2 CPU bf16 is emulated, ~100x slower (Lightning runs 16-mixed as bf16)."""
    cpu("AVX2")
    chosen, why = resolve_precision(given, "auto", "manual")
    assert chosen == given
    assert why.startswith(f"note: precision {given} on this CPU is emulated bf16 (CPU capability AVX2")
    assert "--trainer.precision auto" in why
    cpu("AVX512", fp32=200, bf16=800)  # native: nothing to say
    assert not resolve_precision(given, "cpu", "manual")[1].startswith("note:")
    assert not resolve_precision("32-true", "cpu", "manual")[1].startswith("note:")


def test_16_true_is_refused_for_training_that_diverges():
    """Lightning's 16-true keeps AdamW's state in float16, unscaled: its second moment underflows to 0 and eps (1e-8)
    is 0 there, so the updates divide by 0 (a 10-step run ended at val loss 44.7 against 4.16 in bf16-true)."""
    param = torch.nn.Parameter(torch.full((8,), 0.02, dtype=torch.float16))
    param.grad = torch.full((8,), 1e-4, dtype=torch.float16)
    torch.optim.AdamW([param], lr=1e-3).step()
    assert not torch.isfinite(param).any()  # why it is refused: torch's AdamW on float16 state
    with pytest.raises(ConfigError, match="16-true trains float16 weights without loss scaling.*use 16-mixed"):
        resolve_precision("16-true", "auto", "manual")


@pytest.mark.parametrize(
    "capability,fp32,bf16,expected", [("AVX2", 140, 1, "32-true"), ("AVX512", 210, 800, "bf16-mixed")]
)
def test_shipped_cpu_recipe_resolves_by_the_cpu(cpu, corpus, data_root, tmp_path, capability, fp32, bf16, expected):
    from minigpt.cli.train import parse

    cpu(capability, fp32, bf16)
    cli = parse(
        [
            "--config",
            str(REPO / "configs" / "shakespeare_char_cpu.yaml"),
            "--data.source",
            str(corpus),
            "--data.data_root",
            str(data_root),
            "--out_dir",
            str(tmp_path / "run"),
        ]
    )
    assert cli.config["trainer"]["precision"] == "auto"
    assert cli.trainer.precision == expected
