"""Weight-only int8 (minigpt.core.quantize): the rounding bound, the int8 layers against the float math they stand
for, a quantized model against its float32 self, load_model(quantize=...), and the run without a C++ compiler."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import minigpt.core.compiled as compiled
import minigpt.core.quantize as quantize
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.generation import generate
from minigpt.core.quantize import Int8Embedding, Int8Linear, int8_matvec, quantize_model, quantize_rows
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.loading import load_model
from support import random_ids, varied_gpt

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rows_round_to_int8_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(24, 40) * torch.logspace(-3, 1, 24)[:, None]  # rows of very different sizes
    w[5] = 0  # an all-zero row
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (24,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert torch.all((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7 * w.abs())
    assert torch.all(q[5] == 0) and torch.isfinite(scale).all()


@pytest.mark.parametrize("rows", [1, 3, 9])  # the matvec path (few rows) and dequantize-then-matmul (more)
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_is_the_dequantized_linear(rows, bias, monkeypatch):
    monkeypatch.setattr(quantize, "compiler_available", lambda device_type="cpu": False)  # eager math, no compile
    monkeypatch.setattr(quantize, "MATVEC_ROWS", 4)
    torch.manual_seed(0)
    linear = nn.Linear(40, 24, bias=bias)
    layer = Int8Linear(linear)
    x = torch.randn(1, rows, 40)
    expected = F.linear(x, layer.weight.float() * layer.scale[:, None], linear.bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        int8_matvec(x, layer.weight, layer.scale) + (linear.bias if bias else 0), expected, rtol=1e-5, atol=1e-5
    )
    assert (layer(x) - linear(x)).abs().max() < 0.02  # and close to the float layer it replaced


@pytest.mark.parametrize("arch,tie", [("gpt", True), ("gpt", False), ("llama", True)])
def test_quantized_model_stays_close_to_float32(arch, tie, monkeypatch):
    monkeypatch.setattr(quantize, "compiler_available", lambda device_type="cpu": False)
    model = varied_gpt(arch, 2, tie_embeddings=tie, vocab_size=60)
    idx = random_ids(batch=8, length=32, seed=3)  # 256 positions
    with torch.no_grad():
        expected = model(idx)[0]
        q = quantize_model(model)
        got = q(idx)[0]
    assert not any(isinstance(m, nn.Linear) for m in q.modules())
    assert isinstance(q.transformer.wte, Int8Embedding)
    if tie:  # one int8 table for the embedding and the head, as the float model had one
        assert q.transformer.wte.weight is q.lm_head.weight
    agreement = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agreement >= 0.9, agreement  # a random model with large weights: a trained one agrees ~99 %
    assert (got - expected).norm() < 0.05 * expected.norm()  # a misplaced scale or row would be ~100 %
    assert q.new_kv_cache(1)[0].k.dtype == torch.float32  # the cache holds activations, not int8


def test_load_model_quantizes_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(quantize, "compiler_available", lambda device_type="cpu": False)
    path = tmp_path / "m.ckpt"
    save_file(model_checkpoint(varied_gpt("gpt", 4, vocab_size=256), ByteTokenizer()), path)
    fp32, _ = load_model(path)
    int8, _ = load_model(path, quantize="int8")
    assert isinstance(int8.lm_head, Int8Linear) and not isinstance(fp32.lm_head, Int8Linear)
    weights = [b for b in int8.buffers() if b.dim() == 2]  # the linear and embedding tables: all int8
    assert weights and all(b.dtype == torch.int8 for b in weights if b is not int8.transformer.wpe.weight)
    idx = random_ids(batch=1, length=8, vocab=256)
    assert torch.equal(generate(int8, idx, 4, temperature=0)[:, :8], idx)


def test_without_a_compiler_int8_runs_eagerly_with_one_note(monkeypatch, capsys):
    monkeypatch.setattr(quantize, "compiler_available", lambda device_type="cpu": False)
    compiled.note_once.cache_clear()
    layer = Int8Linear(nn.Linear(16, 8))
    x = torch.randn(1, 16)
    layer(x), layer(x)
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "C++ compiler" in err and len(err.strip().splitlines()) == 1
