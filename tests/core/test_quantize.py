"""Weight-only int8 (minigpt.core.quantize): the rounding bound, the int8 layers (the aten kernel, the multiply-and-sum,
dequantize-then-matmul) against the float math they stand for, a quantized model against its float32 self,
load_model(quantize=...) and its measured decision (a fake timer decides; cached per machine), and the run without a
C++ compiler."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import minigpt.core.compiled as compiled
import minigpt.core.measured as measured
import minigpt.core.quantize as quantize
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.errors import UserError
from minigpt.core.generation import generate
from minigpt.core.quantize import Int8Embedding, Int8Linear, int8_matvec, quantize_model, quantize_rows
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.loading import load_model
from support import random_ids, varied_gpt

pytestmark = pytest.mark.usefixtures("one_thread", "int8_pays")


def fake_timer(float32: float, int8: float, calls: list | None = None, one_thread: float | None = None):
    """A timer that says how long one call of each kind takes, whatever the machine (and counts its calls); int8
    on one thread takes what int8 does unless told."""

    def timer(what, fn):
        if calls is not None:
            calls.append(what)
        return {"float32": float32, "int8": int8, "int8 one thread": int8 if one_thread is None else one_thread}[what]

    return timer


@pytest.fixture
def int8_pays(monkeypatch, tmp_path):
    """An empty per-machine cache, and a machine where int8 is measured twice as fast as float32."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(quantize, "typical_time", fake_timer(float32=2e-3, int8=1e-3))


def test_rows_round_to_int8_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(24, 40) * torch.logspace(-3, 1, 24)[:, None]  # rows of very different sizes
    w[5] = 0  # an all-zero row
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (24,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert torch.all((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7 * w.abs())
    assert torch.all(q[5] == 0) and torch.isfinite(scale).all()


@pytest.mark.parametrize("rows", [1, 3, 9])  # the decode kernels (few rows) and dequantize-then-matmul (more)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_features", [40, 48])  # 48: the aten kernel takes it; 40 (not a multiple of 16): not
def test_int8_linear_is_the_dequantized_linear(rows, bias, in_features, monkeypatch):
    monkeypatch.setattr(quantize, "compiler_available", lambda device_type="cpu": False)  # eager math, no compile
    monkeypatch.setattr(quantize, "MATVEC_ROWS", 4)
    torch.manual_seed(0)
    linear = nn.Linear(in_features, 24, bias=bias)
    layer = Int8Linear(linear)
    assert layer.kernel == ("int8pack" if in_features == 48 else "matvec")
    x = torch.randn(1, rows, in_features)
    expected = F.linear(x, layer.weight.float() * layer.scale[:, None], linear.bias)
    # the aten kernel reads the activations and writes its sums in bf16: ~0.2 % of the output's size
    tolerance = 1e-2 if layer.kernel == "int8pack" and rows <= 4 else 1e-5
    torch.testing.assert_close(layer(x), expected, rtol=tolerance, atol=tolerance)
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


def test_load_model_refuses_an_unknown_quantization_or_attention_and_a_missing_device(tmp_path):
    """The API's edge, as the commands' flags are: one UserError each, not a silent int8 or torch's own error."""
    path = tmp_path / "m.ckpt"
    save_file(model_checkpoint(varied_gpt("gpt", 4, vocab_size=256), ByteTokenizer()), path)
    with pytest.raises(UserError, match=r"^quantize: unknown value 'int4'; choose one of int8"):
        load_model(path, quantize="int4")
    # the caller's argument, not a fault of the checkpoint (it was a CheckpointError naming the file)
    with pytest.raises(UserError, match=r"^attention: unknown value 'flash'; choose one of sdpa, manual, einops"):
        load_model(path, attention="flash")
    missing = [("gpu", "'gpu' is not a device minigpt runs on")]
    missing += [] if torch.backends.mps.is_available() else [("mps", "mps: MPS is not available here")]
    for device, words in missing:
        with pytest.raises(UserError, match=f"^device {words}"):
            load_model(path, device=device)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="^device cuda: CUDA is not available here; use cpu"):
            load_model(path, device="cuda")
    assert next(load_model(path, device="auto")[0].parameters()).device.type in ("cpu", "cuda")


def test_without_a_compiler_int8_runs_eagerly_with_one_note(monkeypatch, capsys):
    """The aten kernel needs no compiler: silent.  A layer it cannot take (rows of 40) dequantizes: one note."""
    monkeypatch.setattr(quantize, "compiler_available", lambda device_type="cpu": False)
    compiled.note_once.cache_clear()
    layer = Int8Linear(nn.Linear(16, 8))
    x = torch.randn(1, 16)
    layer(x), layer(x)
    assert capsys.readouterr().err == ""
    layer = Int8Linear(nn.Linear(40, 8))
    x = torch.randn(1, 40)
    layer(x), layer(x)
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "C++ compiler" in err and len(err.strip().splitlines()) == 1


def test_int8_that_is_slower_here_is_declined_with_one_note_and_the_decision_is_cached(tmp_path, monkeypatch, capsys):
    """--quantize is a speed flag: where the measured int8 matmuls are slower, load_model keeps float32 and says
    so once; the measurement is made once per machine (a second load reads it), and another CPU kind measures
    again."""
    path = tmp_path / "m.ckpt"
    save_file(model_checkpoint(varied_gpt("gpt", 4, vocab_size=256), ByteTokenizer()), path)
    calls = []
    monkeypatch.setattr(quantize, "typical_time", fake_timer(float32=1e-3, int8=3e-3, calls=calls))
    compiled.note_once.cache_clear()
    model, _ = load_model(path, quantize="int8")
    assert not any(isinstance(m, Int8Linear) for m in model.modules())
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "--quantize int8 declined" in err and "running float32" in err
    assert "AVX" in err or "capability" in err or torch.backends.cpu.get_cpu_capability() in err
    measured_calls = len(calls)
    assert measured_calls > 0
    monkeypatch.setattr(quantize, "typical_time", fake_timer(float32=3e-3, int8=1e-3, calls=calls))
    model, _ = load_model(path, quantize="int8")  # the cached decision, not a new measurement
    assert len(calls) == measured_calls and not isinstance(model.lm_head, Int8Linear)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # another CPU kind: measured anew, and int8 pays there
    model, _ = load_model(path, quantize="int8")
    assert len(calls) > measured_calls and isinstance(model.lm_head, Int8Linear)


def test_the_measurement_counts_every_linear_layer_of_the_model():
    model = varied_gpt("gpt", 4, vocab_size=256)
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    times = quantize.linear_step_times(model, fake_timer(float32=1.0, int8=0.25))
    assert times.pop("quantize") > 0  # the real seconds quantizing took: no fake for those
    assert times == {"float32": n_linear * 1.0, "int8": n_linear * 0.25}
    choice, why = quantize.choose_int8(model, fake_timer(float32=1.0, int8=0.25))
    assert choice == "int8" and f"{1e3 * 0.25 * n_linear:.2f} ms with int8" in why


@torch.inference_mode()
def decoded_argmax(model, seq):
    """The most likely next token at every position of seq (B, T), fed one token per step through the KV cache:
    the decode path, few rows per matmul (the int8 decode kernels), teacher-forced so one early difference does
    not change every later position."""
    cache = model.new_kv_cache(seq.size(0))
    steps = [model(seq[:, t : t + 1], kv_cache=cache, input_pos=t)[0][:, -1].argmax(-1) for t in range(seq.size(1))]
    return torch.stack(steps, 1)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_every_int8_path_gives_float32s_greedy_ids_within_the_agreement_bound(arch, monkeypatch):
    """The aten kernel (bf16 activations) and the multiply-and-sum, decoding: the next-token choices of float32 at
    >= 90 % of the positions of float32's own greedy text (a random model with large weights; a trained one ~99 %),
    and of each other."""
    monkeypatch.setattr(quantize, "compiler_available", lambda device_type="cpu": False)
    model = varied_gpt(arch, 2, vocab_size=64)  # width 32: the aten kernel takes every layer
    seq = generate(model, random_ids(batch=4, length=5, vocab=64), 27, temperature=0)  # (4, 32)
    fp32 = decoded_argmax(model, seq)
    assert torch.equal(fp32[:, 4:-1], seq[:, 5:])  # the decode path is the greedy generation
    ways = {}
    for kernel in ("int8pack", "matvec"):
        int8 = quantize_model(copy.deepcopy(model), kernel=kernel)
        assert {m.kernel for m in int8.modules() if isinstance(m, Int8Linear)} == {kernel}
        ways[kernel] = decoded_argmax(int8, seq)
        agreement = (ways[kernel] == fp32).float().mean().item()
        assert agreement >= 0.9, (kernel, agreement)
    assert (ways["int8pack"] == ways["matvec"]).float().mean().item() >= 0.9


def test_where_one_thread_runs_the_int8_kernel_faster_it_runs_on_one(tmp_path, monkeypatch):
    """On a busy machine the aten kernel's parallel loop stalls on a descheduled thread: measured so (a fake timer),
    the layers run it on one thread, give the same values, and leave torch's thread count as it was."""
    path = tmp_path / "m.ckpt"
    save_file(model_checkpoint(varied_gpt("gpt", 4, vocab_size=256), ByteTokenizer()), path)
    monkeypatch.setattr(quantize, "typical_time", fake_timer(float32=2e-3, int8=9e-3, one_thread=1e-3))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model, _ = load_model(path, quantize="int8")
        layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
        assert layers and all(m.one_thread for m in layers)
        x = torch.randn(1, 1, layers[0].in_features)
        with torch.no_grad():
            on_one = layers[0](x)
            assert torch.get_num_threads() == 2  # set back after the call
            layers[0].one_thread = False
            assert torch.equal(layers[0](x), on_one)  # each output is one thread's sum either way
    finally:
        torch.set_num_threads(threads)


def test_int8_must_earn_back_its_quantizing_within_the_generation_asked_for():
    """Measured (a record standing for it): 1 ms saved per token, 5 s to quantize.  Unknown length: int8; 100
    tokens: float32 (0.1 s saved); 10,000 tokens: int8; a batch past MATVEC_ROWS: float32 whatever the length."""
    model = varied_gpt("gpt", 4, vocab_size=256)
    key = measured.speed_key(model, "int8 vs float32, eager linears")
    measured.update_record(key, float32=2e-3, int8=1e-3, quantize=5.0)
    assert quantize.choose_int8(model)[0] == "int8"
    choice, why = quantize.choose_int8(model, tokens=100)
    assert choice == "float32" and "quantizing takes 5 s, more than 100 tokens save (0.1 s)" in why
    measured.update_record(key, float32=1.2e-3, int8=1e-3, quantize=0.017)  # well under 0.1 s: not "0.0 s"
    assert "quantizing takes 0.017 s, more than 60 tokens save (0.012 s)" in quantize.choose_int8(model, tokens=60)[1]
    assert quantize.choose_int8(model, tokens=10_000)[0] == "int8"
    choice, why = quantize.choose_int8(model, batch=quantize.MATVEC_ROWS + 1, tokens=10_000)
    assert choice == "float32" and f"up to {quantize.MATVEC_ROWS} sequences" in why


@pytest.mark.parametrize(("capability", "kernel"), [("AVX2", "_weight_int8pack_mm"), ("AVX512", "sum")])
def test_a_compiled_step_multiplies_int8_with_the_aten_kernel_on_avx2_only(capability, kernel, monkeypatch):
    """On AVX2 Inductor's fused int8 loop decoded 5x slower than the aten kernel, on AVX-512 about 1.8x faster
    (compiled_int8pack_pays): what the traced step holds follows the CPU kind, and computes the same product."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    layer = Int8Linear(nn.Linear(64, 48, bias=False))
    traced: set[str] = set()

    def record(gm, inputs):  # the graph's ops, then the graph run as it is (no Inductor: no C++ compile here)
        traced.update(str(node.target) for node in gm.graph.nodes if node.op in ("call_function", "call_method"))
        return gm.forward

    x = torch.randn(1, 1, 64)
    torch._dynamo.reset()
    y = torch.compile(layer, backend=record, fullgraph=True)(x)
    other = {"sum": "_weight_int8pack_mm", "_weight_int8pack_mm": "sum"}[kernel]
    assert any(kernel in op for op in traced) and not any(other in op for op in traced), traced
    assert torch.allclose(y, F.linear(x, layer.weight.float()) * layer.scale, rtol=2e-2, atol=2e-2)


def test_a_float32_model_and_its_int8_copy_keep_separate_compile_records():
    """compile="auto" decides from what compiling saved before on this machine: a float32 model's record (its
    compiled step barely faster) must not decide for its int8 copy (1.2 to 1.8x faster compiled), or the other way."""
    model = varied_gpt("gpt", 2)
    key = compiled.decode_step_key(model)
    assert compiled.decode_step_key(quantize_model(copy.deepcopy(model))) != key
    assert compiled.decode_step_key(copy.deepcopy(model)) == key  # the same shape and weights kind: one record
