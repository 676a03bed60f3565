"""What the benchmark scripts share: the machine's label, the flags every script has, timing, peak memory, the
matmul peak (MFU's denominator), child processes that report JSON, markdown tables and the JSON file.

Each script puts the repository root on sys.path itself, so `python benchmarks/bench_X.py` runs from anywhere.
On CUDA, timings synchronize before reading the clock; on the CPU, peak memory comes from the profiler.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from minigpt.core.precision import matmul_gflops

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------------------------------
# Machine and settings


def cpuinfo(field: str) -> str | None:
    """The first `field` line of /proc/cpuinfo (None where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(field)), None)


def cpu_features() -> list[str]:
    """The matmul-relevant instruction-set flags of this CPU."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
    flags = set((cpuinfo("flags") or "").split())
    return [f for f in wanted if f in flags]


def load_avg() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def wait_for_quiet(max_load: float = 1.0, tries: int = 0, sleep_s: float = 45.0) -> list[float | None]:
    """Wait up to `tries` times `sleep_s` seconds while the 1-minute load is above `max_load`; return the
    load readings.  tries=0 only reads the load once (the default: the scripts never sleep on their own)."""
    readings = [load_avg()]
    for _ in range(tries):
        if readings[-1] is None or readings[-1] <= max_load:
            break
        print(f"load average {readings[-1]} > {max_load}: waiting {sleep_s:.0f} s", flush=True)
        time.sleep(sleep_s)
        readings.append(load_avg())
    return readings


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def machine_label(device: torch.device | str = "cpu", dtype: str | torch.dtype = "float32") -> dict[str, Any]:
    """Where and how a benchmark ran; the same keys in every script's JSON (`machine`)."""
    device = torch.device(device)
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    cpu = cpuinfo("model name") or platform.processor() or platform.machine()
    label = dict(cpu=cpu, cores=os.cpu_count(), torch_threads=torch.get_num_threads(), torch=torch.__version__)
    label |= dict(python=platform.python_version(), dtype=dtype, device=str(device), load_avg_1m=load_avg())
    if device.type == "cpu":
        # which kind of CPU a figure belongs to: with native bf16 (AVX512_BF16/AMX) bf16 matmuls beat float32,
        # without (AVX2) they run ~100x slower
        label["cpu_features"] = cpu_features()
        label["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        rates = {name: matmul_gflops(DTYPES[name], n=512, seconds=0.2) for name in ("float32", "bfloat16")}
        label["matmul_gflops"] = {name: round(rate, 1) for name, rate in rates.items()}
    if device.type == "cuda":
        label |= dict(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return label


def describe_machine(label: dict[str, Any]) -> str:
    """One line for the top of a report."""
    where = label.get("gpu") or f"{label['cpu']}, {label['cores']} cores ({label['torch_threads']} torch threads)"
    kind = ""
    if "cpu_capability" in label:
        rates = label["matmul_gflops"]
        kind = (
            f", CPU capability {label['cpu_capability']}, matmul {rates['float32']:g} GFLOP/s float32 / "
            f"{rates['bfloat16']:g} GFLOP/s bf16 (512^3)"
        )
    return (
        f"Machine: {where}{kind}, torch {label['torch']}, dtype {label['dtype']}, device {label['device']}, "
        f"load average {label['load_avg_1m']} at start"
    )


def common_parser(description: str, name: str) -> argparse.ArgumentParser:
    """An argparse parser with the flags every script has: --quick, --json, --device, --wait_quiet."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny settings that finish in seconds (smoke test)")
    p.add_argument("--json", default=str(RESULTS_DIR / f"{name}.json"), help="where to write the figures")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--wait_quiet", type=int, default=0, metavar="N", help="wait up to N x 45 s for a 1-minute load under 1.0"
    )
    return p


def start(args: argparse.Namespace, device: torch.device | str = "cpu", dtype: str | torch.dtype = "float32") -> dict:
    """Wait for a quiet machine if --wait_quiet asks, then label it and print the label: every report's first line."""
    readings = wait_for_quiet(tries=args.wait_quiet)
    label = machine_label(device, dtype)
    label["load_avg_1m_readings"] = readings
    print(describe_machine(label), flush=True)
    return label


def finish(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Write the figures to --json, with the load average at the end beside the machine's label, and say where."""
    result["machine"]["load_avg_1m_after"] = load_avg()
    print(f"\nwrote {write_json(result, args.json)}")
    return result


def child_output(argv: list[str], cwd: Path = REPO_ROOT) -> str:
    """Run argv in a fresh process and return its output; a failure ends the benchmark with the output's tail."""
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise SystemExit(f"error: {' '.join(argv)[:200]} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


def child_json(argv: list[str], marker: str = "RESULT ", cwd: Path = REPO_ROOT) -> dict[str, Any]:
    """Run argv in a fresh process and return the JSON on the last line of its output that starts with `marker`."""
    lines = [line for line in child_output(argv, cwd).splitlines() if line.startswith(marker)]
    if not lines:
        raise SystemExit(f"error: {' '.join(argv)[:200]} printed no line starting {marker!r}")
    return json.loads(lines[-1].removeprefix(marker))


def peak_rss_bytes() -> int:
    """This process's peak resident memory since exec (VmHWM: ru_maxrss would carry the parent's peak across fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


# --------------------------------------------------------------------------------------------------
# Timing


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], Any], device: torch.device | str, repeats: int = 5, warmup: int = 1) -> list[float]:
    """Seconds per call of fn(), `repeats` times after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# --------------------------------------------------------------------------------------------------
# Peak memory


def _cpu_peak_from_profiler(prof: torch.profiler.profile) -> int:
    """Peak of the running sum of CPU allocations (+bytes) and frees (-bytes), in time order.  The raw kineto events
    keep every "[memory]" record; prof.events() folds those inside an op into its net cpu_memory_usage."""
    events = prof.profiler.kineto_results.events()
    cpu_types = {torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.MKLDNN, torch.autograd.DeviceType.IDEEP}
    records = sorted(
        (e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() in cpu_types
    )
    running = peak = 0
    for _, nbytes in records:
        running += nbytes
        peak = max(peak, running)
    return peak


def peak_memory(fn: Callable[[], Any], device: torch.device | str) -> int:
    """Bytes allocated by fn() at its peak, above what was allocated when it started.

    CUDA: torch.cuda.max_memory_allocated after a reset.  CPU: torch.profiler(profile_memory=True) and the
    peak of the running sum of its allocation/free events (what fn keeps alive at the end counts too).
    """
    device = torch.device(device)
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return _cpu_peak_from_profiler(prof)


# --------------------------------------------------------------------------------------------------
# Matmul peak FLOP/s, for MFU


def matmul_flops(
    dtype: torch.dtype, device: torch.device | str, n: int = 2048, repeats: int = 10, min_seconds: float = 0.2
) -> dict[str, Any]:
    """Measured FLOP/s of an n x n x n matmul in `dtype`: the best of `repeats` timed batches, each of
    enough matmuls to last about min_seconds.  The best (not the median) is the attainable peak."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    flop = 2 * n**3
    one = median(time_fn(lambda: torch.mm(a, b, out=out), device, repeats=3, warmup=2))
    inner = max(1, int(min_seconds / max(one, 1e-9)))

    def batch() -> None:
        for _ in range(inner):
            torch.mm(a, b, out=out)

    times = time_fn(batch, device, repeats=repeats, warmup=0)
    best = min(times) / inner
    result = dict(dtype=str(dtype).removeprefix("torch."), n=n, seconds_per_matmul=best, flops=flop / best)
    result["tflops"] = round(flop / best / 1e12, 4)
    result["median_tflops"] = round(flop * inner / median(times) / 1e12, 4)
    return result


def peak_matmul_flops(dtype: torch.dtype, device: torch.device | str, n: int = 2048, repeats: int = 10) -> dict:
    """The best matmul_flops over square sizes from 64 doubling up to n: an MFU denominator must be the fastest rate
    seen, and it is not always the largest size (AVX2 CPUs run bfloat16 fastest near 128^3).  Sizes whose one matmul
    would take over a second (from the last size's time) are skipped: on an AVX2 CPU a 2048^3 bf16 matmul takes
    ~13 s."""
    sizes = [n]
    while sizes[0] // 2 >= 64:
        sizes.insert(0, sizes[0] // 2)
    probes: list[dict[str, Any]] = []
    for size in sizes:
        if probes and probes[-1]["seconds_per_matmul"] * (size / probes[-1]["n"]) ** 3 > 1.0:
            break  # matmul time grows as size^3
        probes.append(matmul_flops(dtype, device, n=size, repeats=repeats))
    best = max(probes, key=lambda probe: probe["flops"])
    return dict(best, sizes=sizes[: len(probes)], skipped=sizes[len(probes) :])


# --------------------------------------------------------------------------------------------------
# Output


def markdown_table(rows: Iterable[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec); numbers right-aligned.  A missing or None value prints '-'."""
    rows = list(rows)
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    align = "|" + "|".join("---:" if fmt else "---" for _, _, fmt in columns) + "|"
    lines = [head, align]
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("-" if v is None else (format(v, fmt) if fmt else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path


def print_table(rows: Iterable[dict[str, Any]], columns: Sequence[tuple[str, str, str]], title: str = "") -> None:
    print(f"\n{title}\n" if title else "")
    print(markdown_table(rows, columns), flush=True)


def mib(nbytes: float) -> float:
    return nbytes / 2**20
