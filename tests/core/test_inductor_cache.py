"""torch.compile's cached graphs are keyed by the CPU kind (minigpt.core.inductor_cache): torch 2.13 keys them
without the vector width ATEN_CPU_CAPABILITY picks, so a graph compiled natively on an AVX-512 machine and found by
an emulated AVX2 run computes garbage there (NaN), and the other way round."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.compiler.config

from minigpt.core import inductor_cache
from minigpt.core.compiled import compiler_available


def test_the_cpu_kind_joins_the_cache_key_tag_and_a_users_tag_stays(monkeypatch):
    monkeypatch.setattr(torch.compiler.config, "cache_key_tag", "")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    inductor_cache.key_compiled_graphs_by_cpu_kind()
    native = torch.compiler.config.cache_key_tag
    assert native == f"minigpt-cpu-kind={torch.backends.cpu.get_cpu_capability()}/native"
    inductor_cache.key_compiled_graphs_by_cpu_kind()
    assert torch.compiler.config.cache_key_tag == native  # once: every import of minigpt.core.model calls it
    monkeypatch.setattr(torch.compiler.config, "cache_key_tag", "mine")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    inductor_cache.key_compiled_graphs_by_cpu_kind()
    assert torch.compiler.config.cache_key_tag.startswith("mine,") and "/avx2" in torch.compiler.config.cache_key_tag


CHILD = """
import torch

import minigpt.core.model  # as every minigpt model, before compiling

x = torch.randn(12, 64, 4).transpose(1, 2)  # a transposed copy: Inductor tiles it by its vector width
print((torch.compile(lambda t: t.contiguous())(x) - x).abs().max().item())
"""


@pytest.mark.skipif(not compiler_available("cpu"), reason="no C++ compiler for torch.compile")
@pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith("AVX512"), reason="needs two kinds: AVX-512 and AVX2"
)
def test_a_native_compile_then_an_emulated_avx2_one_over_the_same_cache_both_copy_exactly(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "TORCH_COMPILE_CACHE_KEY_TAG")}
    env |= {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    for kind in ({}, {"ATEN_CPU_CAPABILITY": "avx2"}):  # the second finds the first's graph unless the keys differ
        out = subprocess.run([sys.executable, "-c", CHILD], env=env | kind, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == "0.0", (kind, out.stdout)  # NaN or garbage where the width was not the graph's
