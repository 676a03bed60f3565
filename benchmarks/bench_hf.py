"""Hugging Face interop: what a 124M import and export cost in time and memory on this machine.

    python benchmarks/bench_hf.py            # GPT-2 124M import/export (about a minute)
    python benchmarks/bench_hf.py --quick    # a tiny GPT-2-shaped model instead of 124M (seconds; smoke test)

That imports and exports compute what transformers computes (logits on the three attention paths, KV-cache
decoding, greedy ids) is proven, family by family, by tests/hf/test_load.py and tests/export/test_hf.py.

Cost.  A GPT-2 124M-shaped model (GPT2Config() defaults, random weights; the values do not change the cost) is
saved as model.safetensors (float32, 498 MB) with a byte-level tokenizer.json.  Each measurement runs in a fresh
subprocess (--repeats of them: the median time, the largest memory), after its imports: wall time, the process's
peak resident set size (VmHWM) and the peak RSS above the RSS before the operation (sampled every 2 ms), next to
the weights' size.  Import is load_model(dir); for reference
transformers' AutoModelForCausalLM.from_pretrained(dir) is measured the same way.  transformers maps the file and
reads each page when it is first used, so both are also measured through a first 1-token forward pass.  Export
is export_hf of a model already in memory (built at random, then timed; it includes fsync).
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks.common import (
    common_parser,
    describe_machine,
    machine_label,
    markdown_table,
    median,
    mib,
    wait_for_quiet,
    write_json,
)

# --------------------------------------------------------------------------------------------------
# Cost of a 124M-shaped import and export, each in a fresh process


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    """The process's peak RSS since exec (VmHWM; ru_maxrss would count the parent's memory at fork)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def measure(fn: Any) -> dict[str, Any]:
    """Run fn() and return its wall time, the process's peak RSS and the peak RSS above the RSS before it."""
    before, peak, done = rss_bytes(), [0], threading.Event()

    def poll() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.002)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    done.set()
    poller.join()
    peak[0] = max(peak[0], rss_bytes())
    return dict(
        seconds=round(seconds, 3),
        peak_rss_mib=round(mib(peak_rss_bytes()), 1),
        rss_before_mib=round(mib(before), 1),
        peak_above_before_mib=round(mib(peak[0] - before), 1),
    )


def child(what: str, src: str, out: str) -> None:
    """One measurement in this (fresh) process; prints its figures as JSON on the last line."""
    loaded = []
    if what == "import":
        import safetensors.torch  # noqa: F401

        import minigpt.hf.load  # noqa: F401  (its imports are not the import's cost)
        from minigpt.loading import load_model

        result = measure(lambda: loaded.append(load_model(src)[0]))
    elif what == "transformers":
        import transformers

        result = measure(
            lambda: loaded.append(transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval())
        )
    else:  # export of a model in memory: the GPT-2 config the import gives, random weights
        from minigpt.core.model import GPT
        from minigpt.core.tokenizers import ByteTokenizer
        from minigpt.export.hf import export_hf
        from minigpt.hf.load import config_from_hf, read_hf_config

        model = GPT(config_from_hf(read_hf_config(Path(src)))).eval()
        result = measure(lambda: export_hf(model, ByteTokenizer(), out))
    if loaded:  # transformers maps the file and reads a page when it is first used: count a first forward too
        with torch.no_grad():
            first = measure(lambda: loaded[0](torch.zeros(1, 1, dtype=torch.long)))
        result |= dict(first_forward_s=first["seconds"], peak_rss_with_forward_mib=first["peak_rss_mib"])
    print(json.dumps(result))


def run_child(what: str, src: Path, out: Path, repeats: int) -> dict[str, Any]:
    """The measurement in `repeats` fresh processes: the median time, the largest memory figures."""
    runs = []
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.run(
            [sys.executable, __file__, "--_child", what, str(src), str(out)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{what} measurement failed:\n{proc.stderr[-2000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    result = {k: max(r[k] for r in runs) for k in runs[0]}
    for key in ("seconds", "first_forward_s"):
        if key in result:
            result[key] = median([r[key] for r in runs])
    return result | dict(runs=repeats)


def cost(work: Path, quick: bool, repeats: int) -> list[dict[str, Any]]:
    import transformers

    from minigpt.core.tokenizers import ByteTokenizer
    from minigpt.hf.tokenizer_files import save_hf_tokenizer

    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2) if quick else transformers.GPT2Config()
    torch.manual_seed(0)
    src = work / "gpt2-124m"
    model = transformers.GPT2LMHeadModel(config)
    n_params = model.num_parameters()
    model.save_pretrained(src)
    del model
    save_hf_tokenizer(ByteTokenizer(), src)  # tiktoken's gpt2 files would be a download
    weights_mib = round(mib((src / "model.safetensors").stat().st_size), 1)
    rows = []
    for what in ("import", "transformers", "export"):
        result = run_child(what, src, work / f"export-{what}", repeats)
        label = {
            "import": "minigpt import (load_model)",
            "transformers": "transformers from_pretrained (reference)",
            "export": "minigpt export (export_hf)",
        }[what]
        rows.append(dict(operation=label, params=n_params, weights_mib=weights_mib, **result))
        print(
            f"{label}: {result['seconds']:.2f} s, peak RSS {result['peak_rss_mib']:.0f} MiB "
            f"(+{result['peak_above_before_mib']:.0f} MiB over {result['rss_before_mib']:.0f} MiB before; "
            f"weights {weights_mib:.0f} MiB)",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_child"]:
        child(*argv[1:4])
        return {}
    p = common_parser(__doc__, "bench_hf")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per cost measurement (median time)")
    args = p.parse_args(argv)
    wait_for_quiet(tries=args.wait_quiet)
    label = machine_label("cpu")
    print(describe_machine(label))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        costs = cost(work, args.quick, 1 if args.quick else args.repeats)
        print()
        print(
            markdown_table(
                costs,
                [
                    ("operation", "operation", ""),
                    ("seconds", "seconds", ".2f"),
                    ("peak_rss_mib", "peak RSS MiB", ".0f"),
                    ("peak_above_before_mib", "peak over start MiB", ".0f"),
                    ("first_forward_s", "then 1-token forward s", ".2f"),
                    ("peak_rss_with_forward_mib", "peak RSS MiB with it", ".0f"),
                    ("weights_mib", "weights MiB", ".0f"),
                ],
            )
        )
    result = dict(benchmark="hf", machine=label, cost=costs)
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
