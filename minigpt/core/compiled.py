"""torch.compile for decoding: one compiled forward that every decode step of every model reuses.

A decode step runs one token through every layer: ~20 small ops per layer around the matmuls, each a Python call
and a dispatch (with int8 weights the matmuls shrink fourfold and this is what is left).  Compiled, the step is a
few fused C++ loops plus the float32 matmuls' library calls.  `dynamic=True` makes the KV cache's length and the
position symbols from the first call on, so the step compiles once for every position and length (and once more
for the step that fills a cache to its last position), given a cache allocated for the whole generation
(KVCache.reserve: no growing copies in the graph).  Inductor writes C++ on a CPU, so it needs its compiler ($CXX,
else g++; clang++ on macOS); where that is not found everything runs eagerly, with a one-line note.

Compiling costs tens of seconds the first time (a few from the cache) and saves a few milliseconds per token, so
for a short generation it costs more than it saves.  `generate(compile="auto")` (sample.py --compile) therefore
decides on a CPU: it times the first eager decode steps, estimates the compile time and the compiled step from
what earlier runs measured on this machine and model shape (minigpt.core.measured; before any, PRIOR_COMPILE_S
and PRIOR_SAVING), and compiles only if the tokens left would pay for it; otherwise one note line says why.  What
a compile produces is saved with torch.compiler.save_cache_artifacts beside those records and loaded before the
next compile, so a second run compiles from the cache even where the temporary directory was emptied.

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
import time
import weakref
from collections.abc import Callable
from typing import Literal

import torch

from minigpt.core.decode_graphs import DecodeGraphs
from minigpt.core.kv_cache import KVCache
from minigpt.core.measured import artifacts_path, load_artifacts, read_record, save_artifacts, speed_key, update_record
from minigpt.core.model import GPT

__all__ = [
    "AutoCompiledStep",
    "COMPILE_OPTIONS",
    "Compile",
    "compile_pays",
    "compiler_available",
    "cpp_compiler",
    "compiled_forward",
    "decode_forward",
    "decode_step_key",
    "decoding",
    "no_cpp_compiler",
    "note_no_compiler",
    "static_forward",
    "uses_graphs",
]

# Inductor inlines a cheap producer into the loop that reads it; for one token's int8 matmul (a multiply-and-sum,
# see core/quantize.py) that would recompute the layer norm once per output row.  These two make such inputs
# real buffers (a few KiB per token) instead; float32 matmuls stay library calls either way.
COMPILE_OPTIONS = {"deterministic": True, "realize_reads_threshold": 1}

NO_TRITON = "torch.compile needs Triton on a GPU, and it is not installed"
UNCOMPILED = "decoding runs uncompiled, and int8 weights are dequantized for every matmul (slower than float32)"


@functools.cache
def note_once(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


def note_no_compiler(device_type: str) -> None:
    missing = {"cpu": no_cpp_compiler(), "cuda": NO_TRITON}
    note_once(f"{missing.get(device_type, f'torch.compile does not run on {device_type} here')}: {UNCOMPILED}")


def cpp_compiler() -> str:
    """The C++ compiler Inductor runs for CPU kernels, the only one it tries: $CXX (even empty), else g++ (clang++
    on macOS, MSVC's cl on Windows), as torch._inductor's cpp_builder.get_cpp_compiler picks it; a clang++ or c++ on
    a Linux PATH without g++ is not it."""
    default = {"darwin": "clang++", "win32": "cl"}.get(sys.platform, "g++")
    return os.environ.get("CXX", default)


def no_cpp_compiler() -> str:
    """What to say where compiler_available("cpu") is false: which compiler was looked for, and the fix."""
    name = cpp_compiler()
    install = {"g++": "install g++ (e.g. `apt-get install g++`)", "cl": "install Visual Studio's C++ Build Tools"}
    fix = install.get(name, f"install {name or 'one'}")
    return (
        f"torch.compile's C++ compiler {name!r} was not found ($CXX, else g++; clang++ on macOS, cl on Windows): "
        f"{fix}, or set CXX"
    )


@functools.cache
def compiler_available(device_type: str = "cpu") -> bool:
    """Can torch.compile build kernels for this device type?  CPU kernels are C++ (cpp_compiler() on PATH, or the
    path $CXX names); CUDA kernels are Triton."""
    if device_type == "cuda":
        return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
    if device_type != "cpu":
        return False
    return shutil.which(cpp_compiler()) is not None


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
# Compile only where it pays: generate(compile="auto")

Compile = bool | Literal["auto"]
# Before this machine has measured a compile: what one costs (docs/performance.md#decode: 10-18 s on two quiet
# cores the first time, 100-164 s under load; seconds from the cache) and how much of an eager step it saves
# (1 % on GPT-2, 17 % on SmolLM2 in float32).
PRIOR_COMPILE_S = {"cold": 30.0, "warm": 5.0}
PRIOR_SAVING = 0.10
TIMED_EAGER_STEPS = 3  # eager decode steps timed before deciding
TIMED_COMPILED_STEPS = 8  # compiled steps timed (after the compiling one) to record what compiling saved


decode_clock = time.perf_counter  # what AutoCompiledStep times steps with (a test puts a fake one here)


def compile_pays(tokens_left: int, eager_s: float, compiled_s: float, compile_s: float) -> bool:
    """Does compiling (compile_s) pay for itself within `tokens_left` decode steps, each eager_s -> compiled_s?"""
    return compile_s < tokens_left * (eager_s - compiled_s)


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def decode_step_key(model: GPT) -> str:
    """The per-machine record of this model's compiled decode step against its eager one.  Its weights are in the
    key: a float32 model and its int8 copy (and int8's compiled kernel, minigpt.core.quantize) compile to different
    steps with different savings, so one's measurement must not decide for the other."""
    kernel = next((m.compiled_kernel for m in model.modules() if hasattr(m, "compiled_kernel")), None)
    weights = f"int8, {kernel} compiled" if kernel is not None else str(model.lm_head.weight.dtype)
    return speed_key(model, f"decode step compiled vs eager, {weights} weights")


class AutoCompiledStep:
    """A CPU generation's decode step that compiles itself only if that pays: the first TIMED_EAGER_STEPS run
    eagerly and are timed, then compile_pays decides with the steps left, the compile time and saving measured
    earlier on this machine for this model shape (else the priors).  Called as decode(idx, kv_cache=, input_pos=).
    Both ways give the same ids in float32 (int8: within its agreement bound, as the eager aten kernel rounds the
    activations to bf16), so switching mid-generation changes nothing but the time.  `clock` is for tests."""

    def __init__(self, model: GPT, steps: int, clock: Callable[[], float] | None = None) -> None:
        self.model, self.steps_left, self.clock = model, steps, clock or decode_clock
        self.key = decode_step_key(model)
        self.eager: list[float] = []
        self.compiled: list[float] = []
        self.step: Callable | None = None  # the compiled step, once chosen
        self.decision = "undecided"  # then "compile" or "eager"
        self.warm = False

    def __call__(self, idx: torch.Tensor, kv_cache: list[KVCache], input_pos: int) -> tuple[torch.Tensor, None]:
        self.steps_left -= 1
        start = self.clock()
        out = (self.step or self.model)(idx, kv_cache=kv_cache, input_pos=input_pos)
        seconds = self.clock() - start
        (self.compiled if self.step else self.eager).append(seconds)
        if self.decision == "undecided" and len(self.eager) >= TIMED_EAGER_STEPS:
            self.decide()
        elif self.step and len(self.compiled) == 1:  # the call that compiled
            update_record(self.key, **{f"compile_s_{'warm' if self.warm else 'cold'}": seconds - median(self.eager)})
            save_artifacts(self.key)
        elif self.step and len(self.compiled) == 1 + TIMED_COMPILED_STEPS:
            compiled, eager = median(self.compiled[1:]), median(self.eager)
            update_record(self.key, compiled_over_eager=compiled / eager)
            if compiled > 1.05 * eager:  # clearly slower: the rest decodes eagerly (ids as documented above)
                self.step, self.decision = None, "eager"
                note_once(
                    f"--compile: the compiled decode step measured slower than the uncompiled one here "
                    f"({1e3 * compiled:.1f} against {1e3 * eager:.1f} ms per token); decoding uncompiled from here on"
                )
        return out

    def estimate(self) -> tuple[float, float, float]:
        """(eager step s, compiled step s, compile s) for this machine and model, measured or assumed."""
        record = read_record(self.key)
        self.warm = artifacts_path(self.key).is_file()
        kind = "warm" if self.warm else "cold"
        eager = median(self.eager)
        ratio = min(1.0, record.get("compiled_over_eager", 1.0 - PRIOR_SAVING))
        return eager, eager * ratio, record.get(f"compile_s_{kind}", PRIOR_COMPILE_S[kind])

    def decide(self) -> None:
        eager, compiled, compile_s = self.estimate()
        if compile_pays(self.steps_left, eager, compiled, compile_s):
            self.decision = "compile"
            if self.warm:
                load_artifacts(self.key)
            self.step = functools.partial(compiled_forward(), self.model)
            return
        self.decision = "eager"
        note_once(
            f"--compile declined: compiling the decode step takes ~{compile_s:.0f} s here"
            f"{' (from the cache)' if self.warm else ''} and would save ~{self.steps_left * (eager - compiled):.1f} s "
            f"over the {self.steps_left} tokens left ({1e3 * eager:.1f} -> ~{1e3 * compiled:.1f} ms per token); "
            "decoding uncompiled"
        )


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


@functools.cache
def static_forward(device_type: str) -> Callable:
    """GPT.forward compiled for the static step of `device_type` (the serve engine's): graph_forward on a GPU, on a
    CPU with the C++ loops' options (shapes fixed per batch bucket, as the graphs': no dynamic=True)."""
    return graph_forward() if device_type == "cuda" else torch.compile(GPT.forward, options=COMPILE_OPTIONS)


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


def decoding(
    model: GPT, batch_size: int, length: int, compile: Compile, steps: int = 0
) -> tuple[list[KVCache], Callable]:
    """A generation's KV cache, with room for `length` positions, and what runs its `steps` decode steps,
    decode(idx (B, 1), kv_cache=cache, input_pos=int) -> (logits (B, 1, V), None): the model itself; with compile,
    the compiled step (decode_forward), or on a GPU the static step replayed from CUDA graphs; with "auto" on a
    CPU, an AutoCompiledStep (compiled only if it pays)."""
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
    if compile == "auto" and device.type == "cpu" and compiler_available("cpu"):  # elsewhere "auto" is True
        return cache, AutoCompiledStep(model, steps)
    return cache, decode_forward(model, device) if compile else model
