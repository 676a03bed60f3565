"""Python's compiled modules kept for the next launch, where the environment keeps none.

Python compiles each module it imports from its source unless a .pyc of it is cached: beside it (`__pycache__`) or
under `sys.pycache_prefix`. pip writes them when it installs; uv does not unless asked (`--compile-bytecode`), and an
environment that is read-only, or runs with PYTHONDONTWRITEBYTECODE=1 (common in container images), writes none
when it imports either. There every launch compiles torch, torch._dynamo, sympy and Lightning again: train.py's
imports took 15.6 s, against 5.1 to 5.7 s with pip's .pyc files, on a 2-core CPU (docs/performance.md, "Imports
compiled from source").

Where the installed torch has no cached bytecode, this points `sys.pycache_prefix` (Python's own switch for trees it
may not write to) at a folder in the user's cache: the first launch writes the .pyc files there, the next ones read
them. The environment's own files are left as they are. A prefix the user set (PYTHONPYCACHEPREFIX) is kept, and
MINIGPT_BYTECODE_CACHE=0 turns this off.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ENV = "MINIGPT_BYTECODE_CACHE"


def cache_folder() -> Path:
    """Where the .pyc files go: minigpt/pycache in the user's cache folder (XDG_CACHE_HOME, else ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "minigpt" / "pycache"


def bytecode_cached(module: str) -> bool:
    """Whether Python finds a compiled copy of `module` (found, not imported; a module that is not there, or is no
    source file, counts as cached: there is nothing to compile)."""
    spec = importlib.util.find_spec(module)
    return spec is None or spec.cached is None or os.path.exists(spec.cached)


def keep_bytecode(sentinel: str = "torch") -> Path | None:
    """Cache compiled modules under cache_folder() where `sentinel` (the largest import) has no cached bytecode;
    returns the folder, or None where nothing changed. The processes this one starts (torch.compile's workers, data
    loader workers, ranks) inherit it through the environment."""
    if sys.pycache_prefix is not None or os.environ.get(ENV, "1") == "0" or bytecode_cached(sentinel):
        return None
    folder = cache_folder()
    sys.pycache_prefix, sys.dont_write_bytecode = str(folder), False
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return folder
