"""Hugging Face interop: what a 124M import and export cost in time and memory on this machine.

    python benchmarks/bench_hf.py            # GPT-2 124M import/export (about a minute)

Method and results: docs/performance.md#hugging-face-import-and-export.
"""

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks import common

OPERATIONS = {"import": "minigpt import (load_model)", "transformers": "transformers from_pretrained (reference)"}
OPERATIONS["export"] = "minigpt export (export_hf)"
COLUMNS = common.columns(
    "operation:operation:, seconds:seconds:.2f, peak_rss_mib:peak RSS MiB:.0f, "
    "peak_above_before_mib:peak over start MiB:.0f, first_forward_s:then 1-token forward s:.2f, "
    "peak_rss_with_forward_mib:peak RSS MiB with it:.0f, weights_mib:weights MiB:.0f"
)


def measure(fn: Any) -> dict[str, Any]:
    """Run fn() and return its wall time, the process's peak RSS (VmHWM) and that peak above the RSS before fn (the
    imports before it only ever grew the RSS, so the peak is fn's)."""
    before, t0 = common.peak_rss_bytes("VmRSS"), time.perf_counter()
    fn()
    seconds, peak = time.perf_counter() - t0, common.peak_rss_bytes()
    result = dict(seconds=round(seconds, 3), peak_rss_mib=round(common.mib(peak), 1))
    return result | dict(
        rss_before_mib=round(common.mib(before), 1), peak_above_before_mib=round(common.mib(peak - before), 1)
    )


def child(what: str, src: str, out: str) -> None:
    """One measurement in this (fresh) process; prints its figures as JSON."""
    loaded = []
    if what == "import":
        import safetensors.torch  # noqa: F401

        import minigpt.hf.load  # noqa: F401  (its imports are not the import's cost)
        from minigpt.loading import load_model

        result = measure(lambda: loaded.append(load_model(src)[0]))
    elif what == "transformers":
        from transformers import AutoConfig, AutoModelForCausalLM

        # its model code is imported on first use: imported here, as minigpt's imports are above
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src, n_layer=1, n_embd=8, n_head=1, vocab_size=8))
        result = measure(lambda: loaded.append(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()))
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
    print("RESULT", json.dumps(result))


def run_child(what: str, src: Path, out: Path, repeats: int) -> dict[str, Any]:
    """The measurement in `repeats` fresh processes: the median time, the largest memory figures."""
    runs = []
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        runs.append(common.child_json([sys.executable, __file__, "--_child", what, str(src), str(out)]))
    result = {k: max(r[k] for r in runs) for k in runs[0]}
    for key in ("seconds", "first_forward_s"):
        if key in result:
            result[key] = common.median([r[key] for r in runs])
    return result | dict(runs=repeats)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_child"]:
        child(*argv[1:4])
        return {}
    p = common.parser(__doc__, "bench_hf", device=False)  # on the CPU
    p.add_argument(
        "--repeats", type=common.positive_int, default=3, help="fresh processes per cost measurement (median time)"
    )
    args = p.parse_args(argv)
    label = common.start(args)

    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2) if args.quick else transformers.GPT2Config()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src = common.hf_folder(config, Path(tmp) / "gpt2-124m")
        weights_mib = round(common.mib((src / "model.safetensors").stat().st_size), 1)
        for what, name in OPERATIONS.items():
            ran = run_child(what, src, Path(tmp) / f"export-{what}", 1 if args.quick else args.repeats)
            rows.append(dict(operation=name, weights_mib=weights_mib, **ran))
            print(f"{name}: {ran['seconds']:.2f} s, peak RSS {ran['peak_rss_mib']:.0f} MiB", flush=True)
    common.print_table(rows, COLUMNS)
    return common.finish(dict(benchmark="hf", machine=label, cost=rows), args)


if __name__ == "__main__":
    main()
