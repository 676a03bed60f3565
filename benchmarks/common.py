"""What the benchmark scripts share: the machine's label, the flags every script has, timing, child processes that
report JSON, markdown tables and the JSON file.  Each script puts the repository root on sys.path itself, so
`python benchmarks/bench_X.py` runs from anywhere.  How they measure and what they found: docs/performance.md.
torch is imported where it is used: bench_gpu's parent process only launches the runs, and on the GPU machine
torch's import took seconds of each of its launches.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DTYPES = ("float32", "bfloat16", "float16")  # torch's names: getattr(torch, name)
Columns = Sequence[tuple[str, str, str]]  # (key, header, format spec: empty for left-aligned text)


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def pick_device(name: str = "auto") -> torch.device:
    import torch

    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def machine_label(device: torch.device | str = "cpu", dtype: str | torch.dtype = "float32") -> dict[str, Any]:
    """Where and how a benchmark ran; the same keys in every script's JSON (`machine`)."""
    import torch

    from minigpt.core.precision import cpu_name, matmul_gflops

    device = torch.device(device)
    label = dict(cpu=cpu_name(), cores=os.cpu_count(), torch_threads=torch.get_num_threads(), torch=torch.__version__)
    dtype = str(dtype).removeprefix("torch.")
    label |= dict(python=platform.python_version(), dtype=dtype, device=str(device), load_avg_1m=load_avg())
    # which kind of CPU a figure belongs to: with native bf16 (AVX512_BF16/AMX) bf16 matmuls beat float32, without
    # (AVX2) they run ~100x slower; on a GPU the host CPU still runs the Python side of every step
    label["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    if device.type == "cpu":
        rates = {name: matmul_gflops(getattr(torch, name), n=512, seconds=0.2) for name in ("float32", "bfloat16")}
        label["matmul_gflops"] = {name: round(rate, 1) for name, rate in rates.items()}
    if device.type == "cuda":
        label |= dict(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return label


def describe_machine(label: dict[str, Any]) -> str:
    """One line for the top of a report."""
    host = f"{label['cpu']}, {label['cores']} cores ({label['torch_threads']} torch threads)"
    where = f"{label['gpu']} (host {host})" if label.get("gpu") else host
    if "cpu_capability" in label:
        where += f", CPU capability {label['cpu_capability']}"
    if "matmul_gflops" in label:
        rates = label["matmul_gflops"]
        where += f", matmul {rates['float32']:g} GFLOP/s float32 / {rates['bfloat16']:g} GFLOP/s bf16 (512^3)"
    where += f", torch {label['torch']}, dtype {label['dtype']}, device {label['device']}"
    return f"Machine: {where}, load average {label['load_avg_1m']} at start"


def summary(doc: str) -> str:
    """A docstring's first paragraph on one line: a --help description that does not stop mid-sentence."""
    return " ".join(doc.split("\n\n")[0].split())


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= low (anything else: one error line naming the flag)."""

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return whole_number


positive_int, non_negative_int = at_least(1), at_least(0)


def positive_float(text: str) -> float:
    """An argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def device_name(name: str) -> str:
    """--device's type: auto, or a device this machine has (minigpt's own check: a typo or a missing GPU is one
    error line)."""
    from minigpt.core.devices import resolve_device
    from minigpt.core.errors import UserError

    try:
        resolve_device(name)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def user_path(value: str) -> str:
    """A path given on the command line, absolute (children run in other folders); anything that is no file or folder
    from here (a URL, a hub name) as it is."""
    path = Path(value).expanduser()
    return str(path.resolve()) if path.exists() else value


def parser(doc: str, name: str, device: bool = True) -> argparse.ArgumentParser:
    """An argparse parser (its help: the script's docstring) with the flags every script has, and --device where the
    script runs on the device it names (device=False: a script that runs on the CPU, or leaves the choice to
    train.py)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny settings that finish in seconds (smoke test)")
    p.add_argument("--json", default=str(RESULTS_DIR / f"{name}.json"), help="where to write the figures")
    if device:
        p.add_argument(
            "--device",
            type=device_name,
            default="auto",
            help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...",
        )
    p.add_argument(
        "--wait_quiet", type=non_negative_int, default=0, metavar="N", help="wait up to N x 45 s for a load under 1.0"
    )
    return p


def start(args: argparse.Namespace, device: torch.device | str = "cpu", dtype: str | torch.dtype = "float32") -> dict:
    """Wait for a quiet machine if --wait_quiet asks, then label it and print the label: every report's first line."""
    readings = [load_avg()]
    while len(readings) <= args.wait_quiet and readings[-1] > 1.0:
        print(f"load average {readings[-1]} > 1.0: waiting 45 s", flush=True)
        time.sleep(45)
        readings.append(load_avg())
    label = machine_label(device, dtype) | dict(load_avg_1m_readings=readings)
    print(describe_machine(label), flush=True)
    return label


def finish(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Write the figures to --json, with the load average at the end beside the machine's label, and say where."""
    result["machine"]["load_avg_1m_after"] = load_avg()
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {path}")
    return result


# a 20-step train.py of the default config, for its start-up: no text samples, no full-split evaluation at the end
TRAIN_20_STEPS = ["--trainer.max_steps", "20", "--trainer.val_check_interval", "20", "--sample_tokens", "0"]
TRAIN_20_STEPS += ["--eval_full", "false"]
# train.py's start-up report: seconds from launch to the first optimizer step, then where they went
FIRST_STEP = r"first optimizer step ([\d.]+)s after launch: ([^\r\n]*)"


def first_step_report(output: str) -> re.Match | None:
    """The last start-up report in a train.py's output (a progress bar's \\r may share its line)."""
    return next(reversed(list(re.finditer(FIRST_STEP, output))), None)


def import_breakdown(importtime: str, top: int = 12) -> dict[str, Any]:
    """Where a launch's imports went, from `python -X importtime`'s lines (its stderr), in seconds: the total, the
    number of modules, each top-level package's own time (its modules' self times: a package's figure holds its
    compiled extensions' loading, not the packages it imports) and the slowest modules by their own time."""
    rows = []  # (self us, cumulative us, name, depth)
    for line in importtime.splitlines():
        fields = line.removeprefix("import time:").split("|")
        if line.startswith("import time:") and len(fields) == 3 and fields[0].strip().isdigit():
            name = fields[2].rstrip()
            rows.append((int(fields[0]), int(fields[1]), name.strip(), (len(name) - len(name.lstrip())) // 2))
    packages: Counter[str] = Counter()
    for own, _, name, _ in rows:
        packages[name.split(".")[0]] += own

    def seconds(pairs: Iterable[tuple[str, int]]) -> list[tuple[str, float]]:
        return [(name, round(us / 1e6, 2)) for name, us in sorted(pairs, key=lambda pair: -pair[1])[:top]]

    return {
        "total_s": round(sum(cumulative for _, cumulative, _, depth in rows if depth == 0) / 1e6, 2),
        "modules": len(rows),
        "by_package": seconds(packages.items()),
        "slowest": seconds((name, own) for own, _, name, _ in rows),
    }


def run_child(argv: list[str], cwd: Path = REPO_ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run argv in a fresh process, its output captured; a failure ends the benchmark with the output's tail."""
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise SystemExit(f"error: {' '.join(argv)[:200]} failed (exit {proc.returncode}):\n{tail}")
    return proc


def child_json(argv: list[str], marker: str = "RESULT ") -> dict[str, Any]:
    """Run argv in a fresh process and return the JSON on the last line of its output that starts with `marker`."""
    lines = [line for line in run_child(argv).stdout.splitlines() if line.startswith(marker)]
    if not lines:
        raise SystemExit(f"error: {' '.join(argv)[:200]} printed no line starting {marker!r}")
    return json.loads(lines[-1].removeprefix(marker))


def peak_rss_bytes(field: str = "VmHWM") -> int:
    """This process's peak resident memory (VmHWM: ru_maxrss would carry the parent's across fork); or VmRSS: now."""
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) * 1024 for line in status if line.startswith(f"{field}:"))


def hf_folder(config: Any, folder: Path) -> Path:
    """A Hugging Face model folder of a transformers config: its own random init, a byte tokenizer (no download)."""
    import torch
    import transformers

    from minigpt.core.tokenizers import ByteTokenizer
    from minigpt.hf.tokenizer_files import save_hf_tokenizer

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    save_hf_tokenizer(ByteTokenizer(), folder)
    return folder


def val_curve(run_dir: Path) -> list[tuple[float, int, float]]:
    """(wall time, step, val_loss) of each validation a train.py run logged to TensorBoard (none: empty)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not Path(run_dir).is_dir():  # a run that failed before it logged (a bad flag): no curve, not an exception
        return []
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    if "val_loss" not in events.Tags().get("scalars", []):
        return []
    return [(e.wall_time, e.step, e.value) for e in events.Scalars("val_loss")]


def synchronize(device: torch.device | str) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], Any], device: torch.device | str, repeats: int = 5, warmup: int = 1) -> list[float]:
    """Seconds per call of fn(), `repeats` times after `warmup` untimed calls (on CUDA, synchronized)."""
    times = []
    synchronize(device)  # what was queued before is not the first call's
    for _ in range(warmup + repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times[warmup:]


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def markdown_table(rows: Iterable[dict[str, Any]], columns: Columns) -> str:
    """Numbers right-aligned; a missing or None value prints '-'."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |"]
    lines.append("|" + "|".join("---:" if fmt else "---" for _, _, fmt in columns) + "|")
    for r in rows:
        cells = ("-" if r.get(k) is None else format(r[k], fmt) if fmt else str(r[k]) for k, _, fmt in columns)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_table(rows: Iterable[dict[str, Any]], columns: Columns, title: str = "") -> None:
    print(f"\n{title}\n" if title else "")
    print(markdown_table(rows, columns), flush=True)


def print_row(row: dict[str, Any], columns: Columns) -> None:
    """A row of the table as soon as it is measured (the whole table comes at the end), and the load average now."""
    print(markdown_table([row], columns).splitlines()[-1], f" load {load_avg()}", flush=True)


def columns(spec: str) -> list[tuple[str, ...]]:
    """'key:header:format, ...' -> print_table's columns (an empty format: text, left-aligned)."""
    return [tuple(c.strip().split(":", 2)) for c in spec.split(", ")]


def mib(nbytes: float) -> float:
    return nbytes / 2**20
