"""An emulated CPU kind compiles into an Inductor cache folder of its own (minigpt.core.inductor_cache): torch 2.13
keys its cached graphs without the vector width, so a native run's graph replayed under ATEN_CPU_CAPABILITY=avx2
computes garbage (NaN gradients on an AVX-512 machine)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from minigpt.core import inductor_cache
from minigpt.core.compiled import compiler_available


def test_an_emulated_kind_gets_its_own_folder_and_a_chosen_folder_is_kept(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    inductor_cache.separate_cache_per_cpu_kind()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # the machine's own kind: torch's default folder
    for kind in ("avx2", "AVX512"):
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", kind)
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        inductor_cache.separate_cache_per_cpu_kind()
        folder = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert folder.startswith(str(tmp_path) + os.sep) and folder.endswith("_" + kind.lower())
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    inductor_cache.separate_cache_per_cpu_kind()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


CHILD = """
import torch
import torch.nn.functional as F

import minigpt.core  # as every minigpt command, before compiling

torch.manual_seed(0)
q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
attention = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()
eager = torch.autograd.grad(attention(q, k, v), (q, k, v))
compiled = torch.autograd.grad(torch.compile(attention)(q, k, v), (q, k, v))
print(max((a - b).abs().max().item() for a, b in zip(eager, compiled)))
"""


@pytest.mark.skipif(not compiler_available("cpu"), reason="no C++ compiler for torch.compile")
def test_a_native_compile_then_an_emulated_avx2_one_both_equal_eager(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY")}
    env |= {"TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "2", "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    for kind in ({}, {"ATEN_CPU_CAPABILITY": "avx2"}):  # the second finds the first's graph where they share a folder
        out = subprocess.run([sys.executable, "-c", CHILD], env=env | kind, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert float(out.stdout) < 1e-4, (kind, out.stdout)  # the gradients of SDPA's backward, compiled and eager
