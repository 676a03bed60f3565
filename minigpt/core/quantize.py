"""Weight-only int8: every linear weight stored as int8 with one float scale per output row (per channel).

    w[n, :] ~= q[n, :] * scale[n],  q in [-127, 127],  scale[n] = max |w[n, :]| / 127

Generating a token reads every weight once, so on a CPU it runs at memory speed: a quarter of the bytes is up to
four times the tokens.  Activations stay in float32 (no activation quantization), so the only error is each
weight's rounding, at most scale / 2.

How the int8 weights are multiplied (docs/performance.md#int8-which-kernel-by-measurement has the figures):
- one token (a few rows), eagerly: torch's own weight-only int8 kernel, `aten._weight_int8pack_mm`, given the
  activations in bf16 (its vectorized loops, AVX-512 and AVX2 alike, are for bf16 inputs; in float32 it runs a
  scalar loop, slower than the float32 matmul).  The bf16 rounding of the activations and of the output adds
  ~0.2 % relative error to the weights' own rounding.  It needs rows of a multiple of 16 values (its loop has no
  tail), so a layer whose input size is not falls back to the next way.
- one token inside a compiled decode step (or a layer the kernel cannot take): `int8_matvec`, a multiply-and-sum
  that torch.compile turns into one C++ loop reading the int8 weights and converting them in registers.
- a prompt (many rows): dequantize, then the float matmul, whose cost the rows share.
- no C++ compiler and a layer the aten kernel cannot take: dequantize, then matmul, for every call (a note says so).
Whether int8 pays at all is measured once per machine and model shape (`choose_int8`, cached like the bf16
probe): where the int8 step is not faster than float32, load_model keeps float32 and says so in one line.  The
same measurement decides whether the aten kernel runs on torch's threads or on one: its parallel loop waits for
every thread, so on a busy machine a descheduled one stalls each call (17 ms instead of 0.1 on 2 busy cores).

The token embedding becomes int8 too: a tied one reads the head's int8 rows (one table, as before), an untied one
gets its own.  Learned position embeddings and norms stay as they are (small).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Literal, get_args

import torch
import torch.nn as nn
import torch.nn.functional as F

from minigpt.core.compiled import COMPILE_OPTIONS, compiler_available, note_no_compiler
from minigpt.core.measured import Timer, read_record, speed_key, typical_time, update_record
from minigpt.core.model import GPT

__all__ = [
    "Quantization",
    "QUANTIZATIONS",
    "Int8Linear",
    "Int8Embedding",
    "choose_int8",
    "int8_matvec",
    "int8pack_matmul",
    "quantize_model",
]

Quantization = Literal["int8"]
QUANTIZATIONS = get_args(Quantization)

# The decode kernels: torch's weight-only int8 matmul on bf16 activations, or the (compiled) multiply-and-sum
Int8Kernel = Literal["int8pack", "matvec"]
INT8PACK_K_MULTIPLE = 16  # _weight_int8pack_mm's vector loop steps 16 values (AVX-512) or 8 (AVX2) with no tail

# Up to this many rows (batch x tokens) go through int8_matvec; it reads the int8 weights once per row, so at 4
# rows it reads what one float32 matmul does, and dequantize-then-matmul (int8 read, float32 written and read) wins.
MATVEC_ROWS = 4


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (q (N, K) int8, scale (N,) in w's dtype), symmetric per row."""
    w32 = w.detach().float()
    scale = w32.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127  # an all-zero row stays zero
    q = (w32 / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # in place: one float copy, not three
    return q, scale.to(w.dtype)


def int8_matvec(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ (q * scale[:, None]).T -> (..., N) without forming the float weight: compiled, the product
    and the sum over K are one loop that reads each int8 weight once."""
    return (x.unsqueeze(-2) * q.to(x.dtype)).sum(-1) * scale


def int8pack_matmul(x: torch.Tensor, q: torch.Tensor, ones: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., K) float32 @ (q * scale[:, None]).T -> (..., N) float32 through aten._weight_int8pack_mm, which reads
    the int8 rows once.  `ones` (N,) bf16 is the kernel's own scale: the float32 one is applied after, unrounded."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()  # (M, K): the kernel assumes rows of K
    y = torch.ops.aten._weight_int8pack_mm(x2, q, ones)  # (M, N) bf16, accumulated in float32
    return y.float().reshape(*x.shape[:-1], q.shape[0]) * scale


def compiled_int8pack_pays() -> bool:
    """Does a compiled CPU decode step call the aten kernel for its int8 matmuls rather than fuse int8_matvec?  Only
    on AVX2: there Inductor's loop loads the int8 rows 8 bytes at a time through a copy (torch 2.13's partial load of
    a 32-byte Vectorized<int8_t>), and GPT-2 124M's compiled step decoded 14 tokens/s against 84 with the aten
    kernel and 70 eagerly; with AVX-512 its fused loop is the faster (137 against 78).  Emulated AVX2 on an AVX-512
    EPYC, docs/performance.md#decode."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """torch's intra-op threads set to 1 for the block (setting them costs well under a microsecond)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def compiled_matvec() -> Callable:
    """int8_matvec compiled on first use, shared by every Int8Linear of an eager model (dynamic: every shape)."""
    return torch.compile(int8_matvec, dynamic=True, options=COMPILE_OPTIONS)


class Int8Linear(nn.Module):
    """nn.Linear with int8 weights and a per-row scale; `weight` keeps the name (device, shape) callers read."""

    def __init__(self, linear: nn.Linear, kernel: Int8Kernel = "int8pack", one_thread: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight)
        self.register_buffer("weight", q)  # (N, K) int8
        self.register_buffer("scale", scale)  # (N,)
        self.bias = linear.bias
        # the aten kernel where it can take this layer (eager decode steps; a compiled step: compiled_kernel)
        self.kernel: Int8Kernel = kernel if self.in_features % INT8PACK_K_MULTIPLE == 0 else "matvec"
        self.one_thread = one_thread  # run the aten kernel on one thread (measured faster here: see choose_int8)
        # what a compiled CPU step runs: the fused int8_matvec, or on AVX2 the aten kernel (compiled_int8pack_pays)
        self.compiled_kernel: Int8Kernel = self.kernel if compiled_int8pack_pays() else "matvec"
        ones = torch.ones(self.out_features, dtype=torch.bfloat16, device=q.device)
        self.register_buffer("ones", ones, persistent=False)  # (N,) bf16: the aten kernel's scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compiling = torch.compiler.is_compiling()
        if x.shape[:-1].numel() > MATVEC_ROWS:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale
        elif self.kernel == "int8pack" and x.device.type == "cpu" and not compiling:
            with single_thread() if self.one_thread else contextlib.nullcontext():
                y = int8pack_matmul(x, self.weight, self.ones, self.scale)
        elif compiling and self.compiled_kernel == "int8pack" and x.device.type == "cpu":  # AVX2: the aten kernel
            y = int8pack_matmul(x, self.weight, self.ones, self.scale)
        elif compiling:  # inside the compiled decode step: fused with the rest
            y = int8_matvec(x, self.weight, self.scale)
        elif compiler_available(x.device.type):
            y = compiled_matvec()(x, self.weight, self.scale)
        else:
            note_no_compiler(x.device.type)
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row scales"


class Int8Embedding(nn.Module):
    """Rows of an int8 table times their scale: the token embedding of a quantized model."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)  # (V, C) int8
        self.register_buffer("scale", scale)  # (V,)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight).to(self.scale.dtype) * self.scale[idx, None]  # (..., C)


def quantize_model(
    model: GPT, quantization: Quantization = "int8", kernel: Int8Kernel = "int8pack", one_thread: bool = False
) -> GPT:
    """Replace the model's linear layers (and its token embedding) by int8 ones, in place; returns the model.

    For inference: the int8 tensors are buffers, nothing trains them.  Weights tied between the embedding and the
    head stay one tensor (the head's int8 rows).  `kernel`: what multiplies one token's rows eagerly on a CPU;
    `one_thread`: the aten kernel on one thread."""
    tied = model.config.tie_embeddings
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child, kernel, one_thread))
    head = model.lm_head
    if tied:
        model.transformer.wte = Int8Embedding(head.weight, head.scale)
    else:
        model.transformer.wte = Int8Embedding(*quantize_rows(model.transformer.wte.weight))
    return model


# --------------------------------------------------------------------------------------------------
# Does int8 pay here?  Measured once per machine and model shape.


Int8Choice = Literal["float32", "int8", "int8 one thread"]


def linear_step_times(model: GPT, timer: Timer | None = None) -> dict[str, float]:
    """Seconds one token spends in the model's linear layers (the head included) on this machine: float32, int8,
    and (with more than one torch thread) int8 with the aten kernel on one thread; and "quantize", the seconds
    quantizing them takes.  Each distinct weight shape is timed on the model's own weights (one row of input) and
    counted as often as it occurs.  `timer(what, fn) -> seconds` times one call (default measured.typical_time;
    tests pass a fake one)."""
    timer = timer or typical_time
    counts: dict[tuple[int, int], int] = {}
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for m in layers:
        counts[tuple(m.weight.shape)] = counts.get(tuple(m.weight.shape), 0) + 1
    choices: list[Int8Choice] = ["float32", "int8"] + (["int8 one thread"] if torch.get_num_threads() > 1 else [])
    totals = dict.fromkeys([*choices, "quantize"], 0.0)
    for shape, count in counts.items():
        linear = next(m for m in layers if tuple(m.weight.shape) == shape)
        start = time.perf_counter()
        ways = {"float32": linear, "int8": Int8Linear(linear), "int8 one thread": Int8Linear(linear, one_thread=True)}
        totals["quantize"] += count * (time.perf_counter() - start) / 2
        x = torch.randn(1, shape[1], device=linear.weight.device)
        with torch.inference_mode():
            for choice in choices:
                totals[choice] += count * timer(choice, lambda layer=ways[choice], x=x: layer(x))
    return totals


def choose_int8(
    model: GPT, timer: Timer | None = None, batch: int = 1, tokens: int | None = None
) -> tuple[Int8Choice, str]:
    """(the fastest way to decode this model on this CPU: float32, int8, or int8 with the aten kernel on one
    thread; the measurement in words).  Given the generation to come (`batch` rows, `tokens` new tokens), int8
    must also earn back its quantizing within it, and a batch past MATVEC_ROWS (where int8 dequantizes every
    weight at every step) stays float32.

    Measured once per machine (CPU, torch version, CPU capability and ISA settings), torch thread count and model
    shape, then read from ~/.cache/minigpt/decode_speed.json; only a CPU model is measured (a GPU's int8 path is
    its own)."""
    if model.lm_head.weight.device.type != "cpu":
        return "int8", "int8 on a GPU: not measured"
    if batch > MATVEC_ROWS:
        return "float32", f"int8 decodes faster than float32 only up to {MATVEC_ROWS} sequences at once, not {batch}"
    key = speed_key(model, "int8 vs float32, eager linears")
    times = read_record(key)
    if not {"float32", "int8"} <= times.keys():
        times = linear_step_times(model, timer)
        update_record(key, **times)
    steps = {choice: t for choice, t in times.items() if choice in get_args(Int8Choice)}
    fp32, best = steps["float32"], min(steps, key=steps.get)
    int8 = min(t for choice, t in steps.items() if choice != "float32")
    kind = torch.backends.cpu.get_cpu_capability()
    why = (
        f"one token's matmuls take {1e3 * int8:.2f} ms with int8 weights against {1e3 * fp32:.2f} ms in float32 "
        f"on this CPU ({kind}; measured once, cached)"
    )
    quantize_s = times.get("quantize", 0.0)
    if best != "float32" and tokens is not None and quantize_s >= tokens * (fp32 - int8):
        saved = tokens * (fp32 - int8)  # seconds, as the quantizing: both may be well under 0.1 s
        return "float32", (
            f"{why}, and quantizing takes {quantize_s:.2g} s, more than {tokens} tokens save ({saved:.2g} s)"
        )
    return best, why
