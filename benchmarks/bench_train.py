"""Training throughput: tokens/s and MFU of real GPTLightningModule steps under a real lightning.Trainer, and what
train.py's own callbacks, logger and progress bar cost on top of a minimal Trainer.

    python benchmarks/bench_train.py                          # both shapes x {fp32, bf16} x {eager, compiled}

Method and results: docs/performance.md#training-throughput-and-mfu.
"""

import contextlib
import dataclasses
import io
import logging
import sys
import tempfile
import time
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

import lightning as L
from lightning.pytorch.callbacks import Callback, LambdaCallback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from benchmarks import common
from minigpt.core.config import GPTConfig
from minigpt.training.callbacks import compile_regions
from minigpt.training.datamodule import RandomWindows
from minigpt.training.lightning_module import GPTLightningModule
from minigpt.training.optim import OptimConfig
from minigpt.training.trainer import run_callbacks

COLUMNS = [("shape", "shape", ""), ("precision", "precision", ""), ("compile", "compile", "")]
COLUMNS += [("step_ms", "ms/step", ".2f"), ("tokens_per_s", "tokens/s", ",.0f"), ("mfu", "MFU", ".1%")]
COLUMNS += [("warmup_s", "warm-up s", ".2f")]


def make_shape(name: str, quick: bool) -> dict[str, Any]:
    """name, model (GPTConfig's fields), batch_size and optim (OptimConfig's fields) of a shape."""
    if name == "nanogpt":
        model = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65, dropout=0.0)
        shape = dict(model=model, batch_size=12, optim={})
    elif name == "default":
        config = yaml.safe_load((common.REPO_ROOT / "configs" / "default.yaml").read_text())
        shape = dict(model=dict(config["model"], vocab_size=100), batch_size=config["data"]["batch_size"], optim={})
    else:  # finetune: GPT-2 124M as configs/finetune_shakespeare.yaml fine-tunes it
        config = yaml.safe_load((common.REPO_ROOT / "configs" / "finetune_shakespeare.yaml").read_text())
        model = GPTConfig.from_name("gpt2", **config["model"]).to_dict()
        shape = dict(model=model, batch_size=config["data"]["batch_size"], optim=config["optim"])
    if quick:  # the same code path in seconds
        shape["model"] |= dict(n_layer=1, n_head=2, n_kv_head=2, n_embd=32, block_size=16)
        shape["batch_size"] = 4
    return dict(shape, name=name)


def optim_config(shape: dict[str, Any], total_steps: int) -> OptimConfig:
    """The shape's optimizer, its schedule decaying over the run's steps after its own warmup (the shapes without an
    optim section keep OptimConfig's 100 warmup steps, more than a run of this benchmark takes)."""
    optim = OptimConfig(**shape["optim"])
    return dataclasses.replace(optim, decay_steps=optim.warmup_steps + total_steps)


def make_module(shape: dict[str, Any], compile: bool, total_steps: int, device: torch.device) -> GPTLightningModule:
    """The module as train.py builds it, compiled in place as train.py's CompileModel callback does by default
    (--compile_regions true: each block and the head, not the whole model as one graph)."""
    torch.manual_seed(0)
    config = GPTConfig.from_dict(shape["model"])
    module = GPTLightningModule(config, optim_config(shape, total_steps)).to(device)
    if compile:
        compile_regions(module.model)
    return module


@contextlib.contextmanager
def quiet():
    """Silence Lightning's banner lines, warnings about our deliberately simple setup, and the progress bar."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)


def matmul_seconds(dtype: torch.dtype, device: torch.device, n: int, repeats: int) -> float:
    """Seconds of one n x n x n matmul: the best of `repeats` batches of enough matmuls to last ~0.2 s."""
    a, b, out = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(3))
    one = common.median(common.time_fn(lambda: torch.mm(a, b, out=out), device, 3, warmup=2))
    inner = max(1, int(0.2 / max(one, 1e-9)))  # matmuls per timed batch
    batches = common.time_fn(lambda: [torch.mm(a, b, out=out) for _ in range(inner)], device, repeats, warmup=0)
    return min(batches) / inner


def peak_matmul_flops(dtype: torch.dtype, device: torch.device, n_max: int, repeats: int) -> dict[str, Any]:
    """MFU's denominator: the fastest FLOP/s of square matmuls from 64^3 doubling up to n_max^3 (see the docs)."""
    seconds, n = {}, 64
    while n <= n_max and not (seconds and seconds[n // 2] * 8 > 1.0):  # a matmul's time grows as n^3
        seconds[n] = matmul_seconds(dtype, device, n, repeats)
        n *= 2
    best = max(seconds, key=lambda size: size**3 / seconds[size])
    flops = 2 * best**3 / seconds[best]
    return dict(dtype=str(dtype), n=best, flops=flops, tflops=round(flops / 1e12, 4), sizes=list(seconds))


def run_lightning(module, shape, precision: str, device: torch.device, warmup: int, steps: int, train_py=False):
    """trainer.fit for warmup + steps (+1) batches: the step times' median; train_py: with train.py's callbacks."""
    n, stamps = warmup + steps + 1, []

    def stamp(*_) -> None:  # at each step's start and at the end of training
        common.synchronize(device)
        stamps.append(time.perf_counter())

    tmp = tempfile.TemporaryDirectory(prefix="bench_train_")
    callbacks: list[Callback] = [LambdaCallback(on_train_batch_start=stamp, on_train_end=stamp)]
    if train_py:  # train.py's callbacks, its checkpoint every 1,000 steps (none in a run this short)
        run_config = dict(out_dir=tmp.name, checkpoint_every=1000, sample_tokens=200, attention_images="auto", seed=0)
        run_config |= dict(compile=False, early_stopping={"patience": None}, trainer={})
        callbacks += [c for c in run_callbacks(run_config, shape["batch_size"]) if not isinstance(c, ModelCheckpoint)]
        callbacks.append(ModelCheckpoint(dirpath=tmp.name, filename="last", every_n_train_steps=1000))
    devices = [device.index or 0] if device.type == "cuda" else 1
    trainer = L.Trainer(
        accelerator=device.type, devices=devices, precision=precision, max_steps=n, limit_val_batches=0,
        num_sanity_val_steps=0, gradient_clip_val=1.0, log_every_n_steps=10, use_distributed_sampler=False,
        enable_model_summary=False, enable_checkpointing=train_py, enable_progress_bar=train_py,
        logger=TensorBoardLogger(tmp.name, name="", version="") if train_py else False, default_root_dir=tmp.name,
        callbacks=callbacks,
    )  # fmt: skip
    vocab_size, block_size = shape["model"]["vocab_size"], shape["model"]["block_size"]
    tokens = np.random.default_rng(0).integers(0, vocab_size, size=1 << 20, dtype=np.uint16)
    windows = RandomWindows(tokens, block_size, shape["batch_size"], seed=0, stream=0, length=n)
    loader = torch.utils.data.DataLoader(windows, batch_size=None, sampler=range(n), num_workers=0)
    with quiet(), tmp:
        trainer.fit(module, train_dataloaders=loader)
    periods = np.diff(stamps)
    return dict(step_s=float(np.median(periods[warmup:])), warmup_s=float(periods[:warmup].sum()))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__, "train")
    p.add_argument("--shapes", nargs="+", default=["nanogpt", "default"], choices=["nanogpt", "default", "finetune"])
    p.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"], choices=["32-true", "bf16-mixed"])
    p.add_argument("--compile", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--steps", type=common.positive_int, default=20, help="timed steps per run (median reported)")
    p.add_argument(
        "--warmup",
        type=common.non_negative_int,
        default=5,
        help="steps skipped before timing (compilation happens here)",
    )
    p.add_argument("--rounds", type=common.positive_int, default=1, help="runs per setting: ms/step from the best")
    p.add_argument(
        "--overhead_rounds", type=common.non_negative_int, default=8, help="(minimal, train.py's) pairs; 0: none"
    )
    p.add_argument("--attention", default=None, choices=["sdpa", "manual", "einops"], help="of every shape")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds, args.overhead_rounds, args.compile = 3, 1, 1, 2, ["off"]
    device = common.pick_device(args.device)
    shapes = [make_shape(name, args.quick) for name in args.shapes]
    for shape in shapes:
        shape["model"]["attention"] = args.attention or shape["model"].get("attention", "sdpa")
        print(f"Shape {shape['name']}: {shape['model']}, batch {shape['batch_size']}")
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        args.precisions = [x for x in args.precisions if x != "bf16-mixed"]
    label = common.start(args, device, "/".join(args.precisions))

    dtypes = {prec: "bfloat16" if prec.startswith("bf16") else "float32" for prec in args.precisions}  # matmuls'
    n_max, repeats = (256, 3) if args.quick else (2048, 10)
    peaks = {key: peak_matmul_flops(getattr(torch, key), device, n_max, repeats) for key in set(dtypes.values())}

    rows: list[dict[str, Any]] = []
    for shape in shapes:
        B, T = shape["batch_size"], shape["model"]["block_size"]
        for prec in args.precisions:
            for comp in args.compile:
                module = make_module(shape, comp == "on", args.warmup + args.steps + 1, device)
                runs = [run_lightning(module, shape, prec, device, args.warmup, args.steps) for _ in range(args.rounds)]
                step_s = min(r["step_s"] for r in runs)
                flops = module.model.flops_per_token(T) * B * T / step_s
                peak = peaks[dtypes[prec]]["flops"]  # the MFU denominator, in the step's matmul dtype
                row = dict(shape=shape["name"], precision=prec, compile=comp == "on", batch_size=B, block_size=T)
                row |= dict(params=module.model.num_params(), step_ms=round(step_s * 1e3, 3))
                row |= dict(tokens_per_s=round(B * T / step_s, 1), mfu=round(flops / peak, 4))
                row |= dict(warmup_s=round(runs[0]["warmup_s"], 3), step_ms_per_round=[r["step_s"] * 1e3 for r in runs])
                rows.append(row)
                common.print_row(row, COLUMNS)

    extras: dict[str, Any] = {}  # train.py's callbacks, logger and progress bar over the minimal Trainer
    if args.overhead_rounds:
        shape = next((s for s in shapes if s["name"] == "nanogpt"), shapes[0])
        minimal, train_py = [], []
        for i in range(args.overhead_rounds):  # a then b, then b then a: a drift within a pair hits both alike
            for extra in (False, True) if i % 2 == 0 else (True, False):
                module = make_module(shape, False, args.warmup + args.steps + 1, device)
                run = run_lightning(module, shape, "32-true", device, args.warmup, args.steps, train_py=extra)
                (train_py if extra else minimal).append(round(run["step_s"] * 1e3, 3))
        ratio = float(np.median([t / m for t, m in zip(train_py, minimal)]))
        extras = dict(shape=shape["name"], rounds=args.overhead_rounds, steps=args.steps, ratio=ratio)
        extras |= dict(minimal_ms=minimal, train_py_ms=train_py)

    peak_text = ", ".join(f"{k}: {v['tflops'] * 1e3:.1f} GFLOP/s (at {v['n']}^3)" for k, v in peaks.items())
    print(f"\nPeak matmul FLOP/s (MFU denominators): {peak_text}")
    print(f"Per run: median of {args.steps} steps after {args.warmup} warm-up steps; best of {args.rounds} run(s)")
    common.print_table(rows, COLUMNS)
    if extras:
        print(
            f"\ntrain.py's callbacks, TensorBoard logger and progress bar over a minimal Trainer ({extras['shape']}, "
            f"32-true, eager), median of {extras['rounds']} adjacent pairs of {extras['steps']} steps: "
            f"{extras['ratio']:.3f} ({100 * (extras['ratio'] - 1):+.1f}%); pairs (train.py/minimal): "
            + ", ".join(f"{t:.2f}/{m:.2f} ms" for m, t in zip(extras["minimal_ms"], extras["train_py_ms"]))
        )
    settings = dict(steps=args.steps, warmup=args.warmup, rounds=args.rounds, shapes=shapes, quick=args.quick)
    result = dict(benchmark="train", machine=label, settings=settings, peak_matmul=peaks, results=rows)
    return common.finish(result | dict(train_py_extras=extras), args)


if __name__ == "__main__":
    main()
