"""LoRA against full fine-tuning: peak memory, seconds per step, trainable parameters and checkpoint size on a
Llama-3.2-1B-shaped and a SmolLM-135M-shaped model.  (The addition chat demo fine-tuned both ways, full and LoRA:
data/sft_addition_demo.py --steps 2000 [--lora], beside its recipe.)

    python benchmarks/bench_lora.py                       # 135M and 1B shapes: full vs LoRA r8 / r16 / r8 + bf16 base
    python benchmarks/bench_lora.py --shapes 135m --variants full,lora8
    python benchmarks/bench_lora.py --quick               # tiny shapes, 4 steps (smoke test)
    python benchmarks/bench_lora.py --shapes 1b --variants lora8,lora8-ckpt --full_layers ""  # recompute

Method (memory and speed).  The source is a checkpoint with random weights built here in the shape's config (nothing
is downloaded: memory and speed do not depend on the values), with the byte tokenizer (the model's vocabulary stays
the shape's: 128,256 rows for the 1B).  Each row is train.py itself (`--init_from SOURCE --finetune full|lora`) in
a child process of its own, on --corpus: batch 4 x 256 tokens, --steps optimizer steps, float32 (32-true),
AdamW, no compile, one validation batch at the end and the final checkpoint written.  Peak RSS is the child's VmHWM
from /proc at the end: loading the source, training, saving.  Seconds per step: the median period between
successive training batches after the first two (the first allocates the optimizer state).  The checkpoint is
the run's last.ckpt.  A row whose full fine-tune would not fit this machine's memory (--full_layers) is measured at
fewer layers of the same width and vocabulary and extrapolated linearly in the number of layers, as is the LoRA row
at the same depths, to show how far that extrapolation is from LoRA's measured value.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
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
    write_json,
)

RESULT = "RESULT "
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPES = {  # the published configs (config.json) of the two models
    "1b": dict(
        arch="llama",
        n_layer=16,
        n_head=32,
        n_kv_head=8,
        n_embd=2048,
        head_dim=64,
        mlp_hidden=8192,
        vocab_size=128256,
        rope_base=500000.0,
        rope_scaling=LLAMA3_ROPE,
        tie_embeddings=True,
    ),  # Llama-3.2-1B
    "135m": dict(
        arch="llama",
        n_layer=30,
        n_head=9,
        n_kv_head=3,
        n_embd=576,
        mlp_hidden=1536,
        vocab_size=49152,
        rope_base=10000.0,
        tie_embeddings=True,
    ),  # SmolLM-135M
    "tiny": dict(arch="llama", n_layer=3, n_head=4, n_kv_head=2, n_embd=64, mlp_hidden=128, vocab_size=512),
}
VARIANTS = {
    "full": dict(finetune="full"),
    "lora8": dict(finetune="lora", rank=8),
    "lora16": dict(finetune="lora", rank=16),
    "lora8-bf16": dict(finetune="lora", rank=8, base_dtype="bfloat16"),
    # -ckpt: --model.activation_checkpointing true (each block's activations recomputed in the backward)
    "full-ckpt": dict(finetune="full", ckpt=True),
    "lora8-ckpt": dict(finetune="lora", rank=8, ckpt=True),
}


# ------------------------------------------------------------------------------------------------- children


def vm_hwm() -> int:
    """This process's peak resident memory (bytes), from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def make_source(shape: str, n_layer: int, block_size: int, path: Path) -> None:
    """A checkpoint of random weights in the shape's config (child process: its memory is not a row's)."""
    from minigpt.core.checkpoint import model_checkpoint, save_file
    from minigpt.core.config import GPTConfig
    from minigpt.core.model import GPT
    from minigpt.core.tokenizers import ByteTokenizer

    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SHAPES[shape], "n_layer": n_layer, "block_size": block_size}))
    save_file(model_checkpoint(model, ByteTokenizer()), path)


def train_row(spec: dict[str, Any]) -> dict[str, Any]:
    """One row: train.py in this process; returns its figures."""
    from minigpt.cli.train import main as train_main
    from minigpt.training.lightning_module import GPTLightningModule

    stamps: list[float] = []
    real = GPTLightningModule.on_train_batch_start

    def stamped(self, batch, batch_idx):
        stamps.append(time.perf_counter())
        return real(self, batch, batch_idx)

    GPTLightningModule.on_train_batch_start = stamped
    variant = VARIANTS[spec["variant"]]
    out = Path(spec["out"])
    argv = [
        "--init_from",
        spec["source"],
        "--finetune",
        variant["finetune"],
        "--data.source",
        spec["corpus"],
        "--data.data_root",
        spec["data_root"],
        "--out_dir",
        str(out),
        "--overwrite",
        "true",
        "--data.batch_size",
        str(spec["batch"]),
        "--data.val_batches",
        "1",
        "--trainer.max_steps",
        str(spec["steps"]),
        "--trainer.val_check_interval",
        str(spec["steps"]),
        "--checkpoint_every",
        str(spec["steps"]),
        "--trainer.precision",
        "32-true",
        "--trainer.enable_progress_bar",
        "false",
        "--sample_tokens",
        "0",
        "--attention_images",
        "false",
        "--eval_full",
        "false",
        "--optim.warmup_steps",
        "2",
    ]
    if variant["finetune"] == "lora":
        argv += ["--lora.rank", str(variant["rank"]), "--lora.alpha", str(2 * variant["rank"])]
        if "base_dtype" in variant:
            argv += ["--lora.base_dtype", variant["base_dtype"]]
    if variant.get("ckpt"):
        argv += ["--model.activation_checkpointing", "true"]
    start = time.perf_counter()
    trainer = train_main(argv)
    wall = time.perf_counter() - start
    model = trainer.lightning_module.model
    periods = [b - a for a, b in zip(stamps[2:], stamps[3:])]  # after the first two steps
    return dict(
        peak_rss=vm_hwm(),
        s_per_step=statistics.median(periods) if periods else None,
        trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
        total=sum(p.numel() for p in model.parameters()),
        steps=trainer.global_step,
        checkpoint_bytes=(out / "checkpoints" / "last.ckpt").stat().st_size,
        wall_s=round(wall, 1),
        load_avg_1m=round(os.getloadavg()[0], 2),
    )  # other work on the machine slows s/step, not peak RSS


def child(args: list[str]) -> dict[str, Any]:
    """Run this script as a child (`--child JSON`) and return the result it printed."""
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith(RESULT)), None)
    if proc.returncode != 0 or line is None:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise SystemExit(f"error: the child {' '.join(args)[:200]} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(line.removeprefix(RESULT))


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# ------------------------------------------------------------------------------------------------- the table


def measure(shapes: list[str], variants: list[str], args: Any) -> list[dict[str, Any]]:
    work = Path(args.work)
    (work / "sources").mkdir(parents=True, exist_ok=True)
    full_layers = dict(item.split("=") for item in args.full_layers.split(",") if item) if args.full_layers else {}
    rows = []
    for shape in shapes:
        depth = SHAPES[shape]["n_layer"]
        scaled = [int(x) for x in full_layers.get(shape, "").split("/") if x]
        for variant in variants:  # LoRA r8 at the reduced depths too: how good is the extrapolation?
            full = VARIANTS[variant]["finetune"] == "full"
            depths = (scaled or [depth]) if full else [depth, *scaled] if variant == "lora8" else [depth]
            for n_layer in depths:
                source = work / "sources" / f"{shape}-L{n_layer}.ckpt"
                if not source.is_file():
                    child(
                        [
                            "--make_source",
                            json.dumps(dict(shape=shape, n_layer=n_layer, block_size=args.block, path=str(source))),
                        ]
                    )
                spec = dict(
                    variant=variant,
                    source=str(source),
                    corpus=args.corpus,
                    data_root=str(work / "data"),
                    out=str(work / "runs" / f"{shape}-L{n_layer}-{variant}"),
                    batch=args.batch,
                    steps=args.steps if n_layer == depth else args.scaled_steps,
                )
                print(f"{shape} n_layer={n_layer} {variant}: {spec['steps']} steps ...", flush=True)
                r = child(["--child", json.dumps(spec)])
                rows.append(dict(shape=shape, n_layer=n_layer, variant=variant, **r))
                speed = f"{r['s_per_step']:.2f} s/step" if r["s_per_step"] else "s/step needs 4 steps or more"
                print(
                    f"  peak RSS {r['peak_rss'] / 2**30:.2f} GiB, {speed}, "
                    f"{r['trainable']:,} trainable, checkpoint {r['checkpoint_bytes'] / 2**20:.1f} MiB",
                    flush=True,
                )
        if scaled:
            rows += extrapolated(shape, rows, scaled)
    return rows


def extrapolated(shape: str, rows: list[dict[str, Any]], depths: list[int]) -> list[dict[str, Any]]:
    """Rows at the shape's depth, from a straight line through the measurements at `depths` (two depths or more)."""
    target, out = SHAPES[shape]["n_layer"], []
    for variant in ("full", "full-ckpt", "lora8"):
        points = [r for r in rows if r["shape"] == shape and r["variant"] == variant and r["n_layer"] in depths]
        if len(points) < 2:
            continue
        line = {}
        for key in ("peak_rss", "s_per_step", "trainable", "checkpoint_bytes"):
            (x0, y0), (x1, y1) = [(p["n_layer"], p[key]) for p in (points[0], points[-1])]
            line[key] = y0 + (y1 - y0) * (target - x0) / (x1 - x0)
        out.append(
            dict(
                shape=shape,
                n_layer=target,
                variant=f"{variant} (extrapolated from n_layer {'/'.join(str(d) for d in depths)})",
                **line,
            )
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common_parser(__doc__.split("\n\n")[0], "bench_lora")
    p.add_argument("--shapes", default="135m,1b", help="comma-separated: 135m, 1b, tiny; none for no table")
    p.add_argument("--variants", default="full,lora8,lora16,lora8-bf16", help=f"comma-separated: {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per row")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--block", type=int, default=256, help="tokens per row (the sources' block_size)")
    p.add_argument(
        "--full_layers",
        default="1b=2/4",
        help="SHAPE=L1/L2: measure full fine-tuning of SHAPE at these "
        "depths and extrapolate (its full depth does not fit 24 GiB); empty: measure at full depth",
    )
    p.add_argument("--scaled_steps", type=int, default=8, help="optimizer steps of the rows at reduced depth")
    p.add_argument("--corpus", default=None, help="training text (default: a generated one)")
    p.add_argument("--work", default="/tmp/bench_lora", help="sources, prepared data and runs")
    p.add_argument("--child", help=argparse_hidden())
    p.add_argument("--make_source", help=argparse_hidden())
    args = p.parse_args(argv)
    if args.child:
        print(RESULT + json.dumps(train_row(json.loads(args.child))), flush=True)
        return {}
    if args.make_source:
        spec = json.loads(args.make_source)
        make_source(spec["shape"], spec["n_layer"], spec["block_size"], Path(spec["path"]))
        print(RESULT + "{}", flush=True)
        return {}
    if args.quick:
        args.shapes, args.steps, args.scaled_steps, args.block, args.full_layers = "tiny", 4, 4, 32, "tiny=1/2"
        args.variants = "full,lora8"
    if args.corpus is None:
        Path(args.work).mkdir(parents=True, exist_ok=True)
        args.corpus = str(Path(args.work) / "corpus.txt")
        words = "the quick brown fox jumps over a lazy dog while cats sit on warm mats and birds sing".split()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(len(words), (200_000,), generator=g).tolist()
        lines = (" ".join(words[i] for i in ids[j : j + 12]) for j in range(0, len(ids), 12))
        Path(args.corpus).write_text("\n".join(lines))
    label = machine_label("cpu")
    print(describe_machine(label))
    print(
        f"torch.backends.cpu.get_cpu_capability(): {torch.backends.cpu.get_cpu_capability()}; "
        f"{torch.get_num_threads()} threads; {mem_available() / 2**30:.1f} GiB available",
        flush=True,
    )
    shapes = [s for s in args.shapes.split(",") if s and s != "none"]
    rows = measure(shapes, args.variants.split(","), args) if shapes else []
    for r in rows:
        r["peak_rss_gib"] = r["peak_rss"] / 2**30
        r["checkpoint_mib"] = r["checkpoint_bytes"] / 2**20
        full = next(
            (
                f
                for f in rows
                if f["shape"] == r["shape"]
                and f["variant"].split(" ")[0] == "full"
                and f["n_layer"] == SHAPES[r["shape"]]["n_layer"]
            ),
            None,
        )
        r["rss_vs_full"] = r["peak_rss"] / full["peak_rss"] if full else None
    if rows:
        print(
            markdown_table(
                rows,
                [
                    ("shape", "shape", ""),
                    ("n_layer", "layers", "d"),
                    ("variant", "run", ""),
                    ("peak_rss_gib", "peak RSS GiB", ".2f"),
                    ("rss_vs_full", "vs full", ".0%"),
                    ("s_per_step", "s/step", ".2f"),
                    ("trainable", "trainable params", ",.0f"),
                    ("checkpoint_mib", "checkpoint MiB", ",.1f"),
                    ("load_avg_1m", "load", ".1f"),
                ],
            )
        )
    result = dict(
        benchmark="bench_lora",
        machine=label,
        settings=dict(
            steps=args.steps,
            batch=args.batch,
            block=args.block,
            full_layers=args.full_layers,
            scaled_steps=args.scaled_steps,
            precision="32-true",
        ),
        results=rows,
    )
    print(f"wrote {write_json(result, args.json)}")
    return result


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
