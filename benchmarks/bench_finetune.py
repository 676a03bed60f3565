"""Fine-tuning speed: ms per step of GPT-2 124M under configs/finetune_shakespeare.yaml's settings, on this machine.

    python benchmarks/bench_finetune.py                       # 124M, the config's batch and block size, fp32 + bf16
    python benchmarks/bench_finetune.py --steps 10 --precisions 32-true
    python benchmarks/bench_finetune.py --quick               # a tiny GPT-2-shaped model (seconds; smoke test)

Method.  A GPT-2 124M model with random weights is built here (nothing is downloaded: speed does not depend on
the values) and imported the way train.py's init_from imports a source (minigpt.training.init_from.load_init_weights,
which also crops the learned positions to the smaller block_size).  The module is GPTLightningModule with the
config's optimizer settings; batches are random windows (bench_train.make_loader) of the config's batch size and
block size; the Trainer and the timing are bench_train.run_lightning's: the median period between successive
on_train_batch_start stamps after --warmup steps (forward, backward, clipping, AdamW and the loop itself, no
validation, no checkpoint).  A step here is one batch: with accumulate_grad_batches 2 an optimizer step of the
config takes about two of them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks.bench_train import run_lightning
from benchmarks.common import (
    REPO_ROOT,
    common_parser,
    describe_machine,
    machine_label,
    markdown_table,
    pick_device,
    wait_for_quiet,
    write_json,
)
from minigpt.core.config import GPTConfig
from minigpt.core.model import GPT
from minigpt.training.init_from import load_init_weights
from minigpt.training.lightning_module import GPTLightningModule
from minigpt.training.optim import OptimConfig

CONFIG = REPO_ROOT / "configs" / "finetune_shakespeare.yaml"


def recipe() -> dict[str, Any]:
    """The block size, batch size, attention path and optimizer settings of configs/finetune_shakespeare.yaml."""
    import yaml

    cfg = yaml.safe_load(CONFIG.read_text())
    return dict(model=cfg.get("model", {}), optim=cfg.get("optim", {}), batch_size=cfg["data"]["batch_size"])


def finetune_module(source: GPT, model_keys: dict[str, Any], optim: dict[str, Any]) -> GPTLightningModule:
    config = GPTConfig.from_dict({**source.config.to_dict(), **model_keys})
    module = GPTLightningModule(config, OptimConfig(**optim, decay_steps=1000))
    load_init_weights(module.model, source)
    return module


def main(argv: list[str] | None = None) -> None:
    p = common_parser(__doc__, "bench_finetune")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps")
    p.add_argument("--precisions", default="32-true,bf16-mixed", help="comma-separated Lightning precisions")
    p.add_argument("--attention", default=None, help="attention path (default: the config's, else sdpa)")
    p.add_argument("--batch_size", type=int, default=None, help="default: the config's")
    p.add_argument("--block_size", type=int, default=None, help="default: the config's")
    args = p.parse_args(argv)
    device = pick_device(args.device)
    wait_for_quiet(tries=args.wait_quiet)

    r = recipe()
    model_keys = {k: v for k, v in r["model"].items() if k in ("attention", "sdpa_backend", "dropout", "block_size")}
    if args.attention:
        model_keys["attention"] = args.attention
    if args.block_size:
        model_keys["block_size"] = args.block_size
    batch_size = args.batch_size or r["batch_size"]
    if args.quick:  # GPT-2's shape scaled down: the same code path in seconds
        source_config = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=128, vocab_size=50257)
        model_keys["block_size"] = min(model_keys.get("block_size", 64), 64)
        batch_size, args.steps, args.warmup = 2, 3, 1
    else:
        source_config = GPTConfig.from_name("gpt2")
    torch.manual_seed(0)
    source = GPT(source_config)  # random weights: the imported model's speed does not depend on them

    label = machine_label(device)
    print(describe_machine(label))
    rows = []
    for precision in args.precisions.split(","):
        module = finetune_module(source, model_keys, r["optim"])
        shape = dict(name="gpt2-finetune", model=module.config.to_dict(), batch_size=batch_size)
        result = run_lightning(module.to(device), shape, precision, device, warmup=args.warmup, steps=args.steps)
        tokens = batch_size * module.config.block_size
        rows.append(
            dict(
                model=f"{module.model.num_params() / 1e6:.1f}M",
                precision=precision,
                attention=module.config.attention,
                batch=batch_size,
                block_size=module.config.block_size,
                ms_per_step=round(result["step_s"] * 1e3, 1),
                tokens_per_s=round(tokens / result["step_s"], 1),
                steps=result["timed_steps"],
            )
        )
        print(
            f"{rows[-1]['model']} {precision}: {rows[-1]['ms_per_step']} ms/step "
            f"({rows[-1]['tokens_per_s']} tokens/s, batch {batch_size} x {module.config.block_size})",
            flush=True,
        )
        del module
    print()
    print(
        markdown_table(
            rows,
            [
                ("model", "model", ""),
                ("precision", "precision", ""),
                ("attention", "attention", ""),
                ("batch", "batch", "d"),
                ("block_size", "block", "d"),
                ("ms_per_step", "ms/step", ".1f"),
                ("tokens_per_s", "tokens/s", ".1f"),
            ],
        )
    )
    write_json(dict(machine=label, config=str(CONFIG.relative_to(REPO_ROOT)), rows=rows), args.json)


if __name__ == "__main__":
    main()
