"""LoRA against full fine-tuning: peak memory, seconds per step, trainable parameters and checkpoint size on a
Llama-3.2-1B-shaped and a SmolLM-135M-shaped model.

    python benchmarks/bench_lora.py                       # 135M and 1B shapes: full vs LoRA r8 / r16 / r8 + bf16 base

Method and results: docs/lora.md#measured.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks import common
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.config import GPTConfig
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer

LLAMA3_ROPE = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)
LLAMA3_ROPE["original_max_position_embeddings"] = 8192
SHAPES = {  # Llama blocks: the published configs (config.json) of the two models
    "1b": dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, head_dim=64, mlp_hidden=8192, vocab_size=128256),
    "135m": dict(n_layer=30, n_head=9, n_kv_head=3, n_embd=576, mlp_hidden=1536, vocab_size=49152),
    "tiny": dict(n_layer=3, n_head=4, n_kv_head=2, n_embd=64, mlp_hidden=128, vocab_size=512),
}
SHAPES["1b"] |= dict(rope_base=500000.0, rope_scaling=LLAMA3_ROPE, tie_embeddings=True)  # Llama-3.2-1B
SHAPES["135m"] |= dict(rope_base=10000.0, tie_embeddings=True)  # SmolLM-135M
VARIANTS = {  # -ckpt: --model.activation_checkpointing true (each block recomputed in the backward)
    "full": dict(finetune="full"),
    "lora8": dict(finetune="lora", rank=8),
    "lora16": dict(finetune="lora", rank=16),
    "lora8-bf16": dict(finetune="lora", rank=8, base_dtype="bfloat16"),
    "full-ckpt": dict(finetune="full", ckpt=True),
    "lora8-ckpt": dict(finetune="lora", rank=8, ckpt=True),
}
COLUMNS = [("shape", "shape", ""), ("n_layer", "layers", "d"), ("variant", "run", "")]
COLUMNS += [("peak_rss_gib", "peak RSS GiB", ".2f"), ("rss_vs_full", "vs full", ".0%"), ("s_per_step", "s/step", ".2f")]
COLUMNS += [("trainable", "trainable params", ",.0f"), ("checkpoint_mib", "checkpoint MiB", ",.1f")]
COLUMNS += [("load_avg_1m", "load", ".1f")]


def make_source(shape: str, n_layer: int, block_size: int, path: str) -> dict:
    """A checkpoint of random weights in the shape's config."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(arch="llama", **{**SHAPES[shape], "n_layer": n_layer, "block_size": block_size}))
    save_file(model_checkpoint(model, ByteTokenizer()), Path(path))
    return {}


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
    variant, out, steps = VARIANTS[spec["variant"]], Path(spec["out"]), str(spec["steps"])
    argv = ["--init_from", spec["source"], "--finetune", variant["finetune"], "--data.source", spec["corpus"]]
    argv += ["--data.data_root", spec["data_root"], "--out_dir", str(out), "--data.batch_size", str(spec["batch"])]
    argv += ["--trainer.max_steps", steps, "--trainer.val_check_interval", steps, "--checkpoint_every", steps]
    argv += "--overwrite true --data.val_batches 1 --trainer.precision 32-true --optim.warmup_steps 2".split()
    argv += ["--trainer.accelerator", "cpu"]  # a CPU's peak RSS, as the machine's label says
    argv += "--trainer.enable_progress_bar false --sample_tokens 0 --attention_images false --eval_full false".split()
    if variant["finetune"] == "lora":
        argv += ["--lora.rank", str(variant["rank"]), "--lora.alpha", str(2 * variant["rank"])]
        argv += ["--lora.base_dtype", variant["base_dtype"]] if "base_dtype" in variant else []
    argv += ["--model.activation_checkpointing", "true"] if variant.get("ckpt") else []
    start_s = time.perf_counter()
    trainer = train_main(argv)
    wall = time.perf_counter() - start_s
    params = list(trainer.lightning_module.model.parameters())
    periods = [b - a for a, b in zip(stamps[2:], stamps[3:])]  # after the first two steps
    row = dict(peak_rss=common.peak_rss_bytes(), s_per_step=statistics.median(periods) if periods else None)
    row |= dict(trainable=sum(p.numel() for p in params if p.requires_grad), total=sum(p.numel() for p in params))
    row |= dict(steps=trainer.global_step, checkpoint_bytes=(out / "checkpoints" / "last.ckpt").stat().st_size)
    # other work on the machine slows s/step, not peak RSS
    return row | dict(wall_s=round(wall, 1), load_avg_1m=common.load_avg())


def measure(shapes: list[str], variants: list[str], args: Any) -> list[dict[str, Any]]:
    work = Path(args.work)
    (work / "sources").mkdir(parents=True, exist_ok=True)
    full_layers = dict(item.split("=") for item in args.full_layers.split(",") if item)
    rows = []
    for shape in shapes:
        depth = SHAPES[shape]["n_layer"]
        scaled = [int(x) for x in full_layers.get(shape, "").split("/") if x]
        for variant in variants:  # LoRA r8 at the reduced depths too: how good is the extrapolation?
            depths = [depth, *scaled] if variant == "lora8" else [depth]
            if VARIANTS[variant]["finetune"] == "full":
                depths = scaled or [depth]
            for n_layer in depths:
                source = work / "sources" / f"{shape}-L{n_layer}-T{args.block}.ckpt"  # all that shapes it
                if not source.is_file():  # in a child: its memory is no row's
                    make = dict(shape=shape, n_layer=n_layer, block_size=args.block, path=str(source))
                    common.child_json([sys.executable, __file__, "--child", json.dumps(make)])
                spec = dict(variant=variant, source=str(source), corpus=args.corpus, data_root=str(work / "data"))
                spec |= dict(out=str(work / "runs" / f"{shape}-L{n_layer}-{variant}"), batch=4)
                spec["steps"] = args.steps if n_layer == depth else args.scaled_steps
                print(f"{shape} n_layer={n_layer} {variant}: {spec['steps']} steps ...", flush=True)
                r = common.child_json([sys.executable, __file__, "--child", json.dumps(spec)])
                rows.append(dict(shape=shape, n_layer=n_layer, variant=variant, **r))
                print(f"  peak RSS {r['peak_rss'] / 2**30:.2f} GiB, s/step {r['s_per_step']}", flush=True)
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
        name = f"{variant} (extrapolated from n_layer {'/'.join(str(d) for d in depths)})"
        row = dict(shape=shape, n_layer=target, variant=name)
        for key in ("peak_rss", "s_per_step", "trainable", "checkpoint_bytes"):
            (x0, y0), (x1, y1) = [(p["n_layer"], p[key]) for p in (points[0], points[-1])]
            row[key] = y0 + (y1 - y0) * (target - x0) / (x1 - x0)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__, "bench_lora", device=False)  # the CPU's
    p.add_argument("--shapes", default="135m,1b", help="comma-separated: 135m, 1b, tiny")
    p.add_argument("--variants", default="full,lora8,lora16,lora8-bf16", help=f"comma-separated: {', '.join(VARIANTS)}")
    p.add_argument(
        "--steps",
        type=common.at_least(4),
        default=20,
        help="optimizer steps per row (at least 4: s/step is the median period after the first two steps)",
    )
    p.add_argument("--block", type=common.positive_int, default=256, help="tokens per row (the sources' block_size)")
    p.add_argument("--full_layers", default="1b=2/4", help="SHAPE=L1/L2: full fine-tuning there, extrapolated")
    p.add_argument(
        "--scaled_steps",
        type=common.at_least(4),
        default=8,
        help="optimizer steps of the rows at reduced depth (at least 4)",
    )
    p.add_argument("--corpus", default=None, help="training text (default: a generated one)")
    p.add_argument("--work", default="/tmp/bench_lora", help="sources, prepared data and runs")
    p.add_argument("--child", help=argparse.SUPPRESS)  # a row (a variant), or a source to make (a path)
    args = p.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        print("RESULT", json.dumps(train_row(spec) if "variant" in spec else make_source(**spec)), flush=True)
        return {}
    if args.quick:
        args.shapes, args.steps, args.scaled_steps, args.block, args.full_layers = "tiny", 4, 4, 32, "tiny=1/2"
        args.variants = "full,lora8"
    if args.corpus is None:
        Path(args.work).mkdir(parents=True, exist_ok=True)
        args.corpus = str(Path(args.work) / "corpus.txt")
        words = "the quick brown fox jumps over a lazy dog while cats sit on warm mats and birds sing".split()
        ids = torch.randint(len(words), (200_000,), generator=torch.Generator().manual_seed(0)).tolist()
        lines = (" ".join(words[i] for i in ids[j : j + 12]) for j in range(0, len(ids), 12))
        Path(args.corpus).write_text("\n".join(lines))
    label = common.start(args)
    available = next(line for line in Path("/proc/meminfo").read_text().splitlines() if "MemAvailable" in line)
    print(f"{torch.get_num_threads()} threads; {int(available.split()[1]) / 2**20:.1f} GiB available", flush=True)
    rows = measure(args.shapes.split(","), args.variants.split(","), args)
    full_rss: dict[str, int] = {}  # each shape's full fine-tuning at its full depth, measured or extrapolated
    for r in rows:
        if r["variant"].split(" ")[0] == "full" and r["n_layer"] == SHAPES[r["shape"]]["n_layer"]:
            full_rss.setdefault(r["shape"], r["peak_rss"])
    for r in rows:
        r["peak_rss_gib"] = r["peak_rss"] / 2**30
        r["checkpoint_mib"] = r["checkpoint_bytes"] / 2**20
        r["rss_vs_full"] = r["peak_rss"] / full_rss[r["shape"]] if r["shape"] in full_rss else None
    common.print_table(rows, COLUMNS)
    settings = dict(steps=args.steps, batch=4, block=args.block, full_layers=args.full_layers)
    settings |= dict(scaled_steps=args.scaled_steps, precision="32-true")
    return common.finish(dict(benchmark="bench_lora", machine=label, settings=settings, results=rows), args)


if __name__ == "__main__":
    main()
