"""Speed decisions taken by measurement on the machine that runs them, remembered per machine.

A flag meant to make decoding faster (`--quantize int8`, `--compile`) pays on one CPU and costs on another: int8
kernels differ by CPU capability, and compiling costs tens of seconds that a short generation never earns back.
So minigpt measures, once, and keeps what it measured in ~/.cache/minigpt/decode_speed.json ($XDG_CACHE_HOME),
under the machine's key (CPU model, torch version, CPU capability, oneDNN/ATen ISA settings: see
minigpt.core.precision.machine_key), torch's thread count and the model's shape class (its linear layers'
shapes), as the bf16 probe does.  Delete the file to measure again (say, after measuring on a busy machine).
The decisions are minigpt.core.quantize.choose_int8 and minigpt.core.compiled.AutoCompiledStep; here is what they
share: the key, the records, timing a call, and torch.compile's cache artifacts kept beside the records, so that
a second run compiles from them in seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from minigpt.core.fsutil import atomic_write
from minigpt.core.precision import machine_key
from minigpt.core.user_files import loads, read_user_bytes

__all__ = ["cache_dir", "read_record", "shape_class", "speed_key", "typical_time", "update_record"]

RECORDS_BYTES = 4 << 20  # the records file: a few hundred bytes per machine and model shape
Timer = Callable[[str, Callable[[], object]], float]  # (what is timed, the call) -> seconds of one call


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "minigpt"


def shape_class(model: nn.Module) -> str:
    """The model's linear layers as 'out x in * count' (plus the embedding's rows), which is what its decode
    speed depends on; int8 layers count by their weight's shape too."""
    shapes = Counter(
        tuple(m.weight.shape) for m in model.modules() if hasattr(m, "weight") and getattr(m, "in_features", None)
    )
    return ",".join(f"{n}x{k}*{c}" for (n, k), c in sorted(shapes.items()))


def speed_key(model: nn.Module, what: str) -> str:
    """The records' key for `what` (a decision's name and variant) of this model on this machine with torch's
    thread count now (a kernel that wins on one thread can lose on two): a digest."""
    where = f"{machine_key()}|{torch.get_num_threads()} threads|{shape_class(model)}|{what}"
    return hashlib.sha256(where.encode()).hexdigest()[:24]


def _records() -> dict[str, Any]:
    try:
        found = loads(read_user_bytes(cache_dir() / "decode_speed.json", RECORDS_BYTES))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def read_record(key: str) -> dict[str, float]:
    """What was measured under `key` (empty where nothing was, or the file is unreadable)."""
    record = _records().get(key)
    return {k: float(v) for k, v in record.items() if isinstance(v, (int, float))} if isinstance(record, dict) else {}


def update_record(key: str, **values: float) -> None:
    """Add measured values under `key`; a cache is a convenience, so an unwritable home is not an error."""
    records = _records()
    records[key] = {**(records.get(key) if isinstance(records.get(key), dict) else {}), **values}
    data = json.dumps(records, indent=1).encode()
    try:
        atomic_write(cache_dir() / "decode_speed.json", lambda f: f.write(data))
    except OSError:
        pass


def typical_time(what: str, fn: Callable[[], object], repeats: int = 7) -> float:
    """Seconds of the median of `repeats` calls of fn (`what` it is: a name for fake timers), after one untimed
    call.  The median, not the fastest: a kernel that stalls on most calls of a busy machine must count as slow."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


# --------------------------------------------------------------------------------------------------
# torch.compile's artifacts: inductor's FX-graph cache lives in the temporary directory by default
# (/tmp/torchinductor_USER), which a reboot or a fresh container empties; these copies live beside the records.


def artifacts_path(key: str) -> Path:
    return cache_dir() / "compiled" / f"{key}.bin"


def load_artifacts(key: str) -> bool:
    """Put the compiled code saved under `key` back into torch's caches; whether there was any."""
    try:
        data = artifacts_path(key).read_bytes()
    except OSError:
        return False
    try:
        return torch.compiler.load_cache_artifacts(data) is not None
    except Exception:  # noqa: BLE001 - a stale or foreign file only means compiling from scratch
        return False


def save_artifacts(key: str) -> None:
    """Save what this process has compiled so far under `key` (a later run loads it before compiling)."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return
    try:
        atomic_write(artifacts_path(key), lambda f: f.write(saved[0]))
    except OSError:
        pass
