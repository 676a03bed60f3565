"""The compiled decode step (minigpt.core.compiled, generate(compile=True)): the same greedy ids as the plain loop,
compiled once for a whole generation (no recompile as the sequence grows), and a plain run where no compiler is."""

from __future__ import annotations

import sys

import pytest
import torch

import minigpt.core.compiled as compiled
import minigpt.core.quantize as quantize
from minigpt.core.generation import generate
from minigpt.core.quantize import quantize_model
from support import random_ids, varied_gpt

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = 32  # varied_gpt's block_size


def test_without_a_compiler_compile_runs_the_plain_loop_with_one_note(monkeypatch, capsys):
    monkeypatch.setattr(compiled, "compiler_available", lambda device_type="cpu": False)
    compiled.note_once.cache_clear()
    model = varied_gpt("llama", 2)
    idx = random_ids()
    plain = generate(model, idx, 12, temperature=0)
    assert torch.equal(generate(model, idx, 12, temperature=0, compile=True), plain)
    assert torch.equal(generate(model, idx, 12, temperature=0, compile=True), plain)
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "C++ compiler" in err


def test_a_cpu_compiler_is_found_in_cxx_or_on_path(monkeypatch, tmp_path):
    """Public means only: $CXX or g++ / clang++ / c++ on PATH; without any, the compiled step is not tried."""
    compiled.compiler_available.cache_clear()
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler here
    monkeypatch.delenv("CXX", raising=False)
    try:
        assert not compiled.compiler_available("cpu")
        compiled.compiler_available.cache_clear()
        clang = tmp_path / "clang++"
        clang.write_text("#!/bin/sh\n")
        clang.chmod(0o755)
        assert compiled.compiler_available("cpu")
        compiled.compiler_available.cache_clear()
        clang.unlink()
        monkeypatch.setenv("CXX", sys.executable)  # any executable that CXX names
        assert compiled.compiler_available("cpu")
        assert not compiled.compiler_available("mps")  # no compiled decoding there
    finally:
        compiled.compiler_available.cache_clear()


@pytest.mark.slow  # torch.compile: tens of seconds on 2 cores
@pytest.mark.skipif(not compiled.compiler_available("cpu"), reason="no C++ compiler for torch.compile")
def test_compiled_decode_gives_the_plain_loops_greedy_ids_and_compiles_once():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    for arch, n_kv_head in (("gpt", 4), ("llama", 2)):
        model = varied_gpt(arch, n_kv_head)
        idx = random_ids(batch=1, length=5)
        n = 2 * BLOCK  # past block_size: the cache is refilled, and the compiled step runs on after it
        plain = generate(model, idx, n, temperature=0)
        assert len(set(plain[0, 5:].tolist())) > 4  # varied output, so the comparison means something
        counters.clear()
        assert torch.equal(generate(model, idx, n, temperature=0, compile=True), plain)
        # one graph for every position and cache length, and one more for the step that fills the cache exactly
        assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
        for length in (9, 20):  # other lengths: other cache sizes, the same graphs
            assert torch.equal(generate(model, idx, length, temperature=0, compile=True), plain[:, : 5 + length])
        assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
        int8 = quantize_model(model)
        int8_plain = generate(int8, idx, n, temperature=0)
        assert torch.equal(generate(int8, idx, n, temperature=0, compile=True), int8_plain)


@pytest.mark.slow
@pytest.mark.skipif(not compiled.compiler_available("cpu"), reason="no C++ compiler for torch.compile")
def test_compiled_int8_matvec_is_the_dequantized_matmul():
    torch.manual_seed(0)
    layer = quantize.Int8Linear(torch.nn.Linear(96, 40))
    for rows in (1, 2):
        x = torch.randn(rows, 1, 96)
        expected = torch.nn.functional.linear(x, layer.weight.float() * layer.scale[:, None], layer.bias)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)  # eager model: the compiled matvec
