"""Weight-only int8: every linear weight stored as int8 with one float scale per output row (per channel).

    w[n, :] ~= q[n, :] * scale[n],  q in [-127, 127],  scale[n] = max |w[n, :]| / 127

Generating a token reads every weight once, so on a CPU it runs at memory speed: a quarter of the bytes is up to
four times the tokens.  Activations stay in float32 (no activation quantization), so the only error is each
weight's rounding, at most scale / 2.

How the int8 weights are multiplied, by measurement (docs/performance.md#decode has the figures):
- one token (a few rows): `int8_matvec`, a multiply-and-sum that torch.compile turns into one C++ loop reading the
  int8 weights and converting them in registers (inside the compiled decode step, or compiled on its own when the
  model runs eagerly).  The alternatives, for one token on this project's CPU: torch's own
  `aten._weight_int8pack_mm` ran 3-4x slower than a float32 matmul; torchao 0.18's Int8WeightOnlyConfig
  dequantizes the whole weight per call (7x slower on a GPT-2 head), compiled it was still 2.5x slower than
  float32, and its compiled int8-activation config returned wrong values with torch 2.13; fbgemm's
  `quantized.linear_dynamic` is fast but quantizes the activations too, through quantized tensor types that
  torch deprecates for removal.
- a prompt (many rows): dequantize, then the float matmul, whose cost the rows share.
- no C++ compiler: dequantize, then matmul, for every call (correct, slower than float32; a note says so).

The token embedding becomes int8 too: a tied one reads the head's int8 rows (one table, as before), an untied one
gets its own.  Learned position embeddings and norms stay as they are (small).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal, get_args

import torch
import torch.nn as nn
import torch.nn.functional as F

from minigpt.core.compiled import COMPILE_OPTIONS, compiler_available, note_no_compiler
from minigpt.core.model import GPT

__all__ = ["Quantization", "QUANTIZATIONS", "Int8Linear", "Int8Embedding", "int8_matvec", "quantize_model"]

Quantization = Literal["int8"]
QUANTIZATIONS = get_args(Quantization)

# Up to this many rows (batch x tokens) go through int8_matvec; it reads the int8 weights once per row, so at 4
# rows it reads what one float32 matmul does, and dequantize-then-matmul (int8 read, float32 written and read) wins.
MATVEC_ROWS = 4


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (q (N, K) int8, scale (N,) in w's dtype), symmetric per row."""
    w32 = w.detach().float()
    scale = w32.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127  # an all-zero row stays zero
    q = (w32 / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale.to(w.dtype)


def int8_matvec(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ (q * scale[:, None]).T -> (..., N) without forming the float weight: compiled, the product
    and the sum over K are one loop that reads each int8 weight once."""
    return (x.unsqueeze(-2) * q.to(x.dtype)).sum(-1) * scale


@functools.cache
def compiled_matvec() -> Callable:
    """int8_matvec compiled on first use, shared by every Int8Linear of an eager model (dynamic: every shape)."""
    return torch.compile(int8_matvec, dynamic=True, options=COMPILE_OPTIONS)


class Int8Linear(nn.Module):
    """nn.Linear with int8 weights and a per-row scale; `weight` keeps the name (device, shape) callers read."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight)
        self.register_buffer("weight", q)  # (N, K) int8
        self.register_buffer("scale", scale)  # (N,)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() > MATVEC_ROWS:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale
        elif torch.compiler.is_compiling():  # inside the compiled decode step: fused with the rest
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


def quantize_model(model: GPT, quantization: Quantization = "int8") -> GPT:
    """Replace the model's linear layers (and its token embedding) by int8 ones, in place; returns the model.

    For inference: the int8 tensors are buffers, nothing trains them.  Weights tied between the embedding and the
    head stay one tensor (the head's int8 rows)."""
    tied = model.config.tie_embeddings
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child))
    head = model.lm_head
    if tied:
        model.transformer.wte = Int8Embedding(head.weight, head.scale)
    else:
        model.transformer.wte = Int8Embedding(*quantize_rows(model.transformer.wte.weight))
    return model
