"""`precision: auto`: bf16 where the hardware computes it natively, float32 everywhere else.

On a CPU without native bf16 (AVX2 only: most laptops and many cloud machines) a bf16 matmul is emulated and
runs ~100x slower than float32, so a bf16 recipe would be a broken recipe there.  The CPU's kind is read from
torch's CPU capability; where that cannot tell (AVX-512 with or without BF16, ARM), a short matmul probe of
both dtypes decides, cached per machine, torch version and oneDNN/ATen ISA settings.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from minigpt.core.errors import ConfigError
from minigpt.core.fsutil import atomic_write
from minigpt.core.user_files import TEMPLATE_BYTES, loads, read_user_bytes

# CPU capabilities with no native bf16 arithmetic: never worth a probe
NO_NATIVE_BF16 = {"DEFAULT", "NO AVX", "AVX2", "VSX", "Z VECTOR"}
PROBE_SIZE = 256


def matmul_gflops(dtype: torch.dtype, n: int = PROBE_SIZE, seconds: float = 0.05) -> float:
    """Measured GFLOP/s of an n x n x n matmul in `dtype` on the CPU (best of repeated runs)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b  # warm-up: oneDNN picks and builds its kernel
    best, deadline = float("inf"), time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            return 2 * n**3 / best / 1e9


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "minigpt" / "cpu_bf16_probe.json"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo's; where there is none, what platform knows)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine_key() -> str:
    cpu = cpu_name()
    isa = ",".join(os.environ.get(k, "") for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"))
    return f"{cpu}|torch {torch.__version__}|{torch.backends.cpu.get_cpu_capability()}|{isa}"


def probe_cpu_bf16() -> tuple[float, float]:
    """(float32, bfloat16) matmul GFLOP/s on this CPU, measured once per machine and cached."""
    path, key = _cache_file(), machine_key()
    try:
        cached = loads(read_user_bytes(path, TEMPLATE_BYTES))
        if cached.get("key") == key:
            return float(cached["fp32_gflops"]), float(cached["bf16_gflops"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    rates = matmul_gflops(torch.float32), matmul_gflops(torch.bfloat16)
    cached = json.dumps({"key": key, "fp32_gflops": rates[0], "bf16_gflops": rates[1]}).encode()
    try:  # a cache is a convenience: an unwritable home must not stop training
        atomic_write(path, lambda f: f.write(cached))
    except OSError:
        pass
    return rates


def cpu_has_native_bf16() -> tuple[bool, str]:
    """(whether bf16 matmuls are at least as fast as float32 here, why)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in NO_NATIVE_BF16:
        return False, f"CPU capability {capability} has no native bf16"
    fp32, bf16 = probe_cpu_bf16()
    verdict = "native" if bf16 >= fp32 else "not native"
    return bf16 >= fp32, (
        f"CPU capability {capability}, matmul probe {fp32:.0f} GFLOP/s float32 vs "
        f"{bf16:.0f} GFLOP/s bf16: bf16 {verdict}"
    )


def has_native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 natively: a GPU with bf16 units, a CPU whose bf16 matmuls keep up with
    float32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and cpu_has_native_bf16()[0]


def runs_on_cpu(accelerator: str | None) -> bool:
    """Whether Lightning's `accelerator` setting lands on the CPU on this machine."""
    gpu = torch.cuda.is_available() or torch.backends.mps.is_available()
    return accelerator == "cpu" or (accelerator in (None, "auto") and not gpu)


def resolve_precision(
    precision: str | int | None, accelerator: str | None = "auto", attention: str | None = None
) -> tuple[str | int | None, str]:
    """(the precision to give Lightning, a one-line reason).  Anything but "auto" is returned as given; its reason
    starts with "note:" where it is a half precision on a CPU that emulates bf16 (Lightning runs 16-mixed as
    bf16-mixed on a CPU).

    On a CPU, bf16 autocast pays only where bf16 matmuls are native, and not with the sdpa attention path:
    torch's CPU flash-attention backward is slower in bf16 than in float32 (the manual and einops paths are not).
    """
    if str(precision) == "16-true":  # float16 weights and optimizer state, and no loss scaling
        raise ConfigError(
            "trainer.precision: 16-true trains float16 weights without loss scaling, where AdamW's state underflows "
            "(its eps, 1e-8, is 0 in float16) and the run diverges; use 16-mixed or bf16-true"
        )
    if precision != "auto":
        half = str(precision).startswith(("bf16", "16"))
        if half and runs_on_cpu(accelerator) and not (native := cpu_has_native_bf16())[0]:
            return precision, (  # (Lightning runs 16-mixed as bf16 autocast on a CPU)
                f"note: precision {precision} on this CPU is emulated bf16 ({native[1]}), many times slower than "
                "float32; --trainer.precision auto picks the faster one"
            )
        return precision, f"precision {precision} (as configured)"
    if accelerator in (None, "auto", "gpu", "cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        if has_native_bf16(torch.device("cuda")):
            return "bf16-mixed", f"precision auto -> bf16-mixed ({name} computes bf16 natively)"
        return "32-true", f"precision auto -> 32-true ({name} has no native bf16)"
    if accelerator in (None, "auto", "gpu", "mps") and torch.backends.mps.is_available():
        return "32-true", "precision auto -> 32-true (Apple MPS)"
    native, why = cpu_has_native_bf16()
    if native and attention == "sdpa":
        return "32-true", (
            f"precision auto -> 32-true ({why}, but the sdpa path's CPU backward is slower in bf16; "
            "the manual path would use bf16)"
        )
    return ("bf16-mixed" if native else "32-true"), f"precision auto -> {'bf16-mixed' if native else '32-true'} ({why})"
