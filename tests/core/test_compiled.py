"""The compiled decode step (minigpt.core.compiled, generate(compile=True)): the same greedy ids as the plain loop,
compiled once for a whole generation (no recompile as the sequence grows), and a plain run where no compiler is."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import minigpt.core.compiled as compiled
import minigpt.core.measured as measured
import minigpt.core.quantize as quantize
from minigpt.core.generation import generate
from minigpt.core.model import GPT
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


def test_a_cpu_compiler_is_the_one_inductor_runs(monkeypatch, tmp_path):
    """$CXX, else g++ on PATH (clang++ on macOS), the only names Inductor tries: a clang++ or c++ without g++ on
    Linux would fail mid-compile (InvalidCxxCompiler), so the compiled step is not tried."""
    compiled.compiler_available.cache_clear()
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler here
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(sys, "platform", "linux")

    def found(*names: str) -> bool:
        for path in tmp_path.iterdir():
            path.unlink()
        for name in names:
            (tmp_path / name).write_text("#!/bin/sh\n")
            (tmp_path / name).chmod(0o755)
        compiled.compiler_available.cache_clear()
        return compiled.compiler_available("cpu")

    try:
        assert not found()
        assert not found("clang++", "c++")  # on PATH, but not what Inductor runs on Linux
        assert found("g++")
        monkeypatch.setattr(sys, "platform", "darwin")
        assert found("clang++") and not found("g++")
        monkeypatch.setenv("CXX", sys.executable)  # any executable that CXX names, by path
        assert found()
        monkeypatch.setenv("CXX", "clang++")  # or by name on PATH
        assert found("clang++") and not found("g++")
        monkeypatch.setenv("CXX", "")  # set but empty: Inductor runs "" (and fails), so no compiler
        assert not found("g++", "clang++")
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
        int8 = quantize_model(model, kernel="matvec")  # the compiled step's int8 math, eagerly: the same ids
        int8_plain = generate(int8, idx, n, temperature=0)
        assert torch.equal(generate(int8, idx, n, temperature=0, compile=True), int8_plain)


@pytest.mark.slow
@pytest.mark.skipif(not compiled.compiler_available("cpu"), reason="no C++ compiler for torch.compile")
def test_compiled_int8_matvec_is_the_dequantized_matmul():
    torch.manual_seed(0)
    layer = quantize.Int8Linear(torch.nn.Linear(96, 40), kernel="matvec")
    for rows in (1, 2):
        x = torch.randn(rows, 1, 96)
        expected = torch.nn.functional.linear(x, layer.weight.float() * layer.scale[:, None], layer.bias)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)  # eager model: the compiled matvec


# --------------------------------------------------------------------------------------------------
# compile="auto" (sample.py --compile): compile only where the generation's tokens pay for it


def fake_clock(step_s: float):
    """A clock that advances step_s between two readings: every timed decode step takes step_s."""
    ticks = itertools.count()
    return lambda: next(ticks) * step_s


@pytest.fixture
def no_real_compile(monkeypatch, tmp_path):
    """An empty per-machine cache; "compiling" gives the plain forward (so nothing is slow), and saving
    artifacts is counted instead of done."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(compiled, "compiler_available", lambda device_type="cpu": True)
    monkeypatch.setattr(compiled, "compiled_forward", lambda: GPT.forward)
    saved = []
    monkeypatch.setattr(compiled, "save_artifacts", saved.append)
    compiled.note_once.cache_clear()
    return saved


def test_compile_pays_only_when_the_tokens_left_cover_the_compile():
    assert compiled.compile_pays(1000, eager_s=0.05, compiled_s=0.04, compile_s=5.0)  # 10 s saved > 5
    assert not compiled.compile_pays(128, eager_s=0.05, compiled_s=0.04, compile_s=5.0)  # 1.3 s < 5
    assert not compiled.compile_pays(10**6, eager_s=0.05, compiled_s=0.06, compile_s=0.0)  # slower compiled


def test_auto_compile_declines_a_short_generation_with_one_note(no_real_compile, monkeypatch, capsys):
    monkeypatch.setattr(compiled, "decode_clock", fake_clock(0.05))  # 50 ms a step; priors: 30 s, 10 % saved
    monkeypatch.setattr(compiled, "compiled_forward", lambda: pytest.fail("a short generation must not compile"))
    model = varied_gpt("gpt", 4)
    idx = random_ids(batch=1, length=5)
    plain = generate(model, idx, 20, temperature=0)
    assert torch.equal(generate(model, idx, 20, temperature=0, compile="auto"), plain)
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "--compile declined" in err and "~30 s" in err and "16 tokens left" in err
    assert not no_real_compile


def test_auto_compile_compiles_where_the_tokens_pay_and_records_what_it_measured(no_real_compile, monkeypatch, capsys):
    """A compile measured at 0.5 s that halves a 100 ms step pays within 20 tokens: the step compiles after the
    timed eager steps, the same ids come out, the compile's time and saving are recorded, the artifacts saved;
    and a longer measured compile declines the same generation."""
    monkeypatch.setattr(compiled, "decode_clock", fake_clock(0.1))
    model = varied_gpt("llama", 2)
    idx = random_ids(batch=1, length=5)
    plain = generate(model, idx, 20, temperature=0)
    key = compiled.decode_step_key(model)
    measured.update_record(key, compile_s_cold=0.5, compiled_over_eager=0.5)
    steps = []  # the generations' decode steps, to look at their decisions
    auto_step = compiled.AutoCompiledStep
    monkeypatch.setattr(compiled, "AutoCompiledStep", lambda *a: steps.append(auto_step(*a)) or steps[-1])
    assert torch.equal(generate(model, idx, 20, temperature=0, compile="auto"), plain)
    step = steps[-1]
    assert step.decision == "compile" and len(step.eager) == compiled.TIMED_EAGER_STEPS and len(step.compiled) == 16
    assert no_real_compile == [key] and capsys.readouterr().err == ""
    record = measured.read_record(key)
    assert record["compile_s_cold"] == pytest.approx(0.0) and record["compiled_over_eager"] == pytest.approx(1.0)
    measured.update_record(key, compile_s_cold=60.0, compiled_over_eager=0.5)  # 60 s: 16 x 50 ms cannot pay
    assert torch.equal(generate(model, idx, 20, temperature=0, compile="auto"), plain)
    assert steps[-1].decision == "eager" and "~60 s" in capsys.readouterr().err


def test_auto_compile_goes_back_to_eager_when_the_compiled_step_measures_slower(no_real_compile, monkeypatch, capsys):
    """A compiled step slower than the eager one (as Inductor's int8 loop was on AVX2, 70 against 14 ms): after its
    timed steps the rest of the generation decodes eagerly, with the same ids and one note; the record keeps the
    ratio, so the next generation does not compile."""
    now = [0.0]  # the clock: an eager step takes 0.1 s, a compiled one 0.3 s
    monkeypatch.setattr(compiled, "decode_clock", lambda: now[0])

    def slow_forward(model, *args, **kwargs):
        now[0] += 0.3
        return GPT.forward(model, *args, **kwargs)

    monkeypatch.setattr(compiled, "compiled_forward", lambda: slow_forward)
    model = varied_gpt("gpt", 2)
    model.register_forward_pre_hook(lambda *args: now.__setitem__(0, now[0] + 0.1))
    idx = random_ids(batch=1, length=5)
    plain = generate(model, idx, 20, temperature=0)
    key = compiled.decode_step_key(model)
    measured.update_record(key, compile_s_cold=0.0, compiled_over_eager=0.5)  # believed to pay
    steps = []
    auto_step = compiled.AutoCompiledStep
    monkeypatch.setattr(compiled, "AutoCompiledStep", lambda *a: steps.append(auto_step(*a)) or steps[-1])
    assert torch.equal(generate(model, idx, 20, temperature=0, compile="auto"), plain)
    timed = 1 + compiled.TIMED_COMPILED_STEPS
    assert steps[-1].decision == "eager" and steps[-1].step is None and len(steps[-1].compiled) == timed
    assert len(steps[-1].eager) == 19 - timed  # 19 decode steps: the first new token comes from the prompt's pass
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "measured slower than the uncompiled one" in err and "300.0 against 100.0" in err
    assert measured.read_record(key)["compiled_over_eager"] == pytest.approx(3.0)
    assert torch.equal(generate(model, idx, 20, temperature=0, compile="auto"), plain)
    assert steps[-1].decision == "eager" and steps[-1].compiled == []


REUSE = """
import sys, torch
sys.path.insert(0, {tests!r})
from torch._dynamo.utils import counters
import minigpt.core.compiled as compiled
from minigpt.core.generation import generate
from minigpt.core.model import GPT
from support import random_ids, varied_gpt
compiled.compile_pays = lambda *args: True  # a tiny model never pays for a compile: compile anyway
model = varied_gpt("gpt", 4)
generate(model, random_ids(batch=1, length=5), 12, temperature=0, compile="auto")
print(counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
"""


@pytest.mark.slow  # two processes that compile a tiny model's decode step
@pytest.mark.skipif(not compiled.compiler_available("cpu"), reason="no C++ compiler for torch.compile")
def test_a_second_run_compiles_from_the_saved_artifacts_though_inductors_temporary_cache_is_gone(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    script = REUSE.format(tests=str(Path(__file__).resolve().parents[1]))
    runs = []
    for inductor_dir in ("first", "second"):  # a fresh inductor cache each time, as after a reboot
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / inductor_dir)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        runs.append([int(n) for n in out.stdout.split()])
    assert runs[0][1] > 0 and runs[1][0] > 0 and runs[1][1] == 0, runs  # compiled, then every graph from the file
    assert list((tmp_path / "cache" / "minigpt" / "compiled").glob("*.bin"))
    key = json.loads((tmp_path / "cache" / "minigpt" / "decode_speed.json").read_text())
    assert any("compile_s_warm" in record for record in key.values())
