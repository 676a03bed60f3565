"""One torch.compile cache folder per emulated CPU kind.

Inductor keeps the graphs it compiled in a cache folder (TORCHINDUCTOR_CACHE_DIR; by default one per user in the
temporary directory) under a key that, in torch 2.13, leaves out the vector width it generated C++ for, which
ATEN_CPU_CAPABILITY chooses. A graph compiled under one CPU kind and found by a process of another is built again
with the other's vector width but keeps the first's loop tiling: wrong gradients, NaN losses or a corrupted heap
(tests/core/test_inductor_cache.py: SDPA's backward compiled by a native AVX-512 run, then found by an
ATEN_CPU_CAPABILITY=avx2 run in the same folder, gave NaN gradients). Two kinds share a folder where one is
emulated on the other's machine, as docs/performance.md measures the AVX2 kind; so where ATEN_CPU_CAPABILITY is
set and no folder is, each kind gets a folder of its own.
"""

from __future__ import annotations

import getpass
import os
import re
import tempfile

CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR"


def kind_cache_dir(kind: str) -> str:
    """Torch's default folder (torchinductor_USER in the temporary directory) with the CPU kind appended."""
    try:
        user = re.sub(r"[^\w.-]", "_", getpass.getuser())
    except (KeyError, OSError):  # no user name for this uid (some containers)
        user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    kind = re.sub(r"\W", "_", kind.lower())
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}_{kind}")


def separate_cache_per_cpu_kind() -> None:
    """Point Inductor at a folder of this CPU kind's own where ATEN_CPU_CAPABILITY picks the kind and the user
    named no folder (a folder the user chose is theirs to keep apart)."""
    kind = os.environ.get("ATEN_CPU_CAPABILITY", "").strip()
    if kind and not os.environ.get(CACHE_DIR):
        os.environ[CACHE_DIR] = kind_cache_dir(kind)
