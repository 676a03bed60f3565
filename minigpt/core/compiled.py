"""torch.compile for decoding: one compiled forward that every decode step of every model reuses.

A decode step runs one token through every layer: ~20 small ops per layer around the matmuls, each a Python call
and a dispatch (with int8 weights the matmuls shrink fourfold and this is what is left).  Compiled, the step is a
few fused C++ loops plus the float32 matmuls' library calls.  `dynamic=True` makes the KV cache's length and the
position symbols from the first call on, so the step compiles once for every position and length (and once more
for the step that fills a cache to its last position), given a cache allocated for the whole generation
(KVCache.reserve: no growing copies in the graph).  Inductor writes C++ on a CPU, so it needs a compiler (g++ or
clang++); where none is found everything runs eagerly, with a one-line note.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

from minigpt.core.model import GPT

__all__ = ["COMPILE_OPTIONS", "compiler_available", "compiled_forward", "decode_forward", "note_no_compiler"]

# Inductor inlines a cheap producer into the loop that reads it; for one token's int8 matmul (a multiply-and-sum,
# see core/quantize.py) that would recompute the layer norm once per output row.  These two make such inputs
# real buffers (a few KiB per token) instead; float32 matmuls stay library calls either way.
COMPILE_OPTIONS = {"deterministic": True, "realize_reads_threshold": 1}

NO_COMPILER = {
    "cpu": "no C++ compiler found for torch.compile (install g++ or clang++, or set CXX)",
    "cuda": "torch.compile needs Triton on a GPU, and it is not installed",
}
UNCOMPILED = "decoding runs uncompiled, and int8 weights are dequantized for every matmul (slower than float32)"


@functools.cache
def note_once(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


def note_no_compiler(device_type: str) -> None:
    note_once(f"{NO_COMPILER.get(device_type, f'torch.compile does not run on {device_type} here')}: {UNCOMPILED}")


@functools.cache
def compiler_available(device_type: str = "cpu") -> bool:
    """Can torch.compile build kernels for this device type?  CPU kernels are C++ (a compiler on PATH or $CXX);
    CUDA kernels are Triton."""
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return has_triton()
    if device_type != "cpu":
        return False
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:  # torch raises its own InvalidCxxCompiler; any failure means: do not compile
        return False
    return True


@functools.cache
def compiled_forward() -> Callable:
    """GPT.forward compiled (call it as fn(model, idx, kv_cache=..., input_pos=...)), one function for every model:
    each kind of model (its layers' types and shapes) gets its graph on first use."""
    return torch.compile(GPT.forward, dynamic=True, options=COMPILE_OPTIONS)


def decode_forward(model: GPT, device: torch.device) -> Callable:
    """What runs a decode step: the compiled forward where a compiler exists, else the model itself (with a note)."""
    if compiler_available(device.type):
        return functools.partial(compiled_forward(), model)
    note_no_compiler(device.type)
    return model
