"""torch.compile's cached graphs keyed by the CPU kind they were compiled for.

Inductor keeps the graphs it compiled in a cache (TORCHINDUCTOR_CACHE_DIR, by default one folder per user in the
temporary directory) under a key that, in torch 2.13, leaves out the vector width its C++ was generated for, which
ATEN_CPU_CAPABILITY chooses. A graph compiled under one CPU kind and found by a process of another is built again
with the other's vector width but keeps the first's loop tiling: wrong gradients, NaN losses or a corrupted heap
(tests/core/test_inductor_cache.py: a transposed copy compiled natively on an AVX-512 machine, then found by an
ATEN_CPU_CAPABILITY=avx2 run, gave NaN). Two kinds meet in one cache where one is emulated on the other's machine,
as docs/performance.md measures the AVX2 kind. torch.compiler.config.cache_key_tag ("a tag to be included in the
cache key generation for all torch compile caching") is where the kind goes: every graph cached since is keyed by
it, in any folder, and no graph cached before it (keyed without it) is found again.
"""

from __future__ import annotations

import os


def cpu_kind_tag() -> str:
    """This process's CPU kind as Inductor sees it: ATen's capability and the ATEN_CPU_CAPABILITY that picks
    Inductor's vector width (read again at every compile, so both are named)."""
    import torch

    chosen = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() or "native"
    return f"minigpt-cpu-kind={torch.backends.cpu.get_cpu_capability()}/{chosen}"


def key_compiled_graphs_by_cpu_kind() -> None:
    """Add the CPU kind to torch.compile's cache key tag, keeping any tag the user set."""
    import torch.compiler.config

    tag, kind = torch.compiler.config.cache_key_tag, cpu_kind_tag()
    if kind not in tag.split(","):
        torch.compiler.config.cache_key_tag = f"{tag},{kind}" if tag else kind
