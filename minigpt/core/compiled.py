"""torch.compile for decoding: one compiled forward that every decode step of every model reuses.

A decode step runs one token through every layer: ~20 small ops per layer around the matmuls, each a Python call
and a dispatch (with int8 weights the matmuls shrink fourfold and this is what is left).  Compiled, the step is a
few fused C++ loops plus the float32 matmuls' library calls.  `dynamic=True` makes the KV cache's length and the
position symbols from the first call on, so the step compiles once for every position and length (and once more
for the step that fills a cache to its last position), given a cache allocated for the whole generation
(KVCache.reserve: no growing copies in the graph).  Inductor writes C++ on a CPU, so it needs a compiler (g++ or
clang++); where none is found everything runs eagerly, with a one-line note.

On a GPU the step is replayed from CUDA graphs instead (minigpt.core.decode_graphs): the static step over a cache
allocated for the whole generation, compiled (fused kernels) where Triton is installed, captured once per model,
batch size and cache size, and kept for the model's next generation of that size.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
import shutil
import sys
import weakref
from collections.abc import Callable

import torch

from minigpt.core.decode_graphs import DecodeGraphs
from minigpt.core.kv_cache import KVCache
from minigpt.core.model import GPT

__all__ = [
    "COMPILE_OPTIONS",
    "compiler_available",
    "compiled_forward",
    "decode_forward",
    "decoding",
    "note_no_compiler",
    "uses_graphs",
]

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


CXX_NAMES = ("g++", "clang++", "c++")


@functools.cache
def compiler_available(device_type: str = "cpu") -> bool:
    """Can torch.compile build kernels for this device type?  CPU kernels are C++ (a compiler in $CXX or on PATH);
    CUDA kernels are Triton."""
    if device_type == "cuda":
        return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
    if device_type != "cpu":
        return False
    return any(shutil.which(name) for name in (os.environ.get("CXX"), *CXX_NAMES) if name)


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


# --------------------------------------------------------------------------------------------------
# The KV cache and decode step of one generation


def uses_graphs(model: GPT) -> bool:
    """Does a compiled generation of this model decode from CUDA graphs?  On a GPU, unless its attention is held to
    a kernel that may take no mask (flash; cuDNN's in some torch versions): that one keeps the dynamic step."""
    return model.lm_head.weight.device.type == "cuda" and model.config.sdpa_backend not in ("flash", "cudnn")


@functools.cache
def graph_forward() -> Callable:
    """GPT.forward compiled for the static step that CUDA graphs capture (the graphs replay its kernels; no
    options: the CPU's are for C++ loops)."""
    return torch.compile(GPT.forward)


# model -> (what its graphs were captured for, the graphs): one generation's set per model, freed with the model
_graphs_of: weakref.WeakKeyDictionary[GPT, tuple[tuple, DecodeGraphs]] = weakref.WeakKeyDictionary()


def decode_graphs(model: GPT, batch_size: int, capacity: int) -> DecodeGraphs:
    """The model's graphs for `batch_size` rows and `capacity` positions: those of its last generation when they
    fit (the same weights at the same addresses, mode and attention path), else new ones.  Their cache is shared:
    one compiled generation at a time per model."""
    device = model.lm_head.weight.device
    compile = device.type == "cuda" and compiler_available("cuda")
    weights = tuple(t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers()))
    key = (batch_size, capacity, model.training, model.config.attention, compile, weights)
    held = _graphs_of.get(model)
    if held is None or held[0] != key:
        _graphs_of.pop(model, None)  # the old set's memory goes before the new one is allocated
        graphs = DecodeGraphs(model, batch_size, capacity, graph_forward() if compile else None)
        held = _graphs_of[model] = (key, graphs)
    return held[1]


def decoding(model: GPT, batch_size: int, length: int, compile: bool) -> tuple[list[KVCache], Callable]:
    """A generation's KV cache, with room for `length` positions, and what runs its decode steps,
    decode(idx (B, 1), kv_cache=cache, input_pos=int) -> (logits (B, 1, V), None): the model itself; with compile,
    the compiled step (decode_forward), or on a GPU the static step replayed from CUDA graphs."""
    device = model.lm_head.weight.device
    if compile and uses_graphs(model):
        # a power-of-two capacity: generations of similar lengths share one cache and its graphs
        graphs = decode_graphs(model, batch_size, min(model.config.block_size, 1 << (length - 1).bit_length()))

        def replay(idx: torch.Tensor, kv_cache: list[KVCache], input_pos: int) -> tuple[torch.Tensor, None]:
            return graphs(idx, input_pos)[:, None], None

        return graphs.cache, replay
    cache = model.new_kv_cache(batch_size)
    for layer in cache:  # the whole generation's room at once: no growing copies, one buffer to compile for
        layer.reserve(length)
    return cache, decode_forward(model, device) if compile else model
