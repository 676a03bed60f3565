"""Training throughput: tokens/s and MFU of real GPTLightningModule steps under a real lightning.Trainer, and what
train.py's own callbacks, logger and progress bar cost on top of a minimal Trainer.

    python benchmarks/bench_train.py                          # both shapes x {fp32, bf16} x {eager, compiled}
    python benchmarks/bench_train.py --quick                  # tiny smoke run (seconds)
    python benchmarks/bench_train.py --shapes nanogpt --precisions 32-true --compile off --steps 50

Shapes: `nanogpt` is nanoGPT's CPU recipe (4 layers, 4 heads, 128 wide, context 64, batch 12, vocab 65);
`default` is configs/default.yaml's model and batch size, with the vocabulary of the prepared stdlib char
data if present (data/stdlib-char-*/meta.json), else 100.

Method.  Synthetic data: random windows (minigpt.training.datamodule.RandomWindows) of a random uint16 array of 1M
tokens, so data preparation is not measured.  The Trainer runs like train.py's (gradient_clip_val 1.0,
log_every_n_steps 10, the module's fused AdamW and warmup/cosine LambdaLR stepped every step) but with no
logger, no checkpointing, no progress bar, no validation.  A callback stamps time.perf_counter at every
on_train_batch_start (after a device synchronize on CUDA); a step's time is the period from one batch start
to the next, so it holds everything the loop does per batch: fetching the batch, forward, backward, clipping,
optimizer and scheduler, hooks and logging.  The first --warmup steps are skipped (their total, which holds
torch.compile's compilation when compile is on, is reported as `warmup_s`); the median of the next --steps
is the step time; tokens/s = B*T / step time.  MFU = flops_per_token * tokens/s / peak, where
flops_per_token is GPT.flops_per_token(T) (6N + 12*L*H*T, fwd+bwd) and peak is the best FLOP/s of square
matmuls of 2048^3, 1024^3, ... down to 64^3 measured here in the step's matmul dtype (float32, or bfloat16
under bf16-mixed): the largest size is not always the fastest (bfloat16 on an AVX2 CPU).

train.py's extras: the same Trainer with minigpt.training.trainer.run_callbacks (train.py's callbacks), its
TensorBoard logger and progress bar, against the minimal one, nanogpt shape (or the first), float32, eager: the
median of the ratios of --overhead_rounds pairs of runs taken back to back (order alternated), since this
machine's speed drifts by up to ±20% over minutes and a ratio of adjacent runs is far steadier than one of
best-of times.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from benchmarks.common import (
    REPO_ROOT,
    common_parser,
    describe_machine,
    load_avg,
    machine_label,
    markdown_table,
    peak_matmul_flops,
    pick_device,
    synchronize,
    wait_for_quiet,
    write_json,
)
from minigpt.core.config import GPTConfig
from minigpt.training.datamodule import RandomWindows
from minigpt.training.lightning_module import GPTLightningModule
from minigpt.training.optim import OptimConfig
from minigpt.training.trainer import run_callbacks

NANOGPT_TOKENS_PER_S = 15_000  # nanoGPT's own trainer on this recipe, fp32, on the reference 2-core machine
NANOGPT_MS_PER_ITER = 50


def nanogpt_shape() -> dict[str, Any]:
    model = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65, dropout=0.0)
    return dict(name="nanogpt", model=model, batch_size=12)


def default_shape() -> dict[str, Any]:
    import yaml

    cfg = yaml.safe_load((REPO_ROOT / "configs" / "default.yaml").read_text())
    model = dict(cfg.get("model", {}))  # the model section is GPTConfig's fields, nothing else
    model["vocab_size"], source = 100, "fallback (no prepared stdlib char data found)"
    for meta in sorted((REPO_ROOT / "data").glob("stdlib-char-*/meta.json")):
        with contextlib.suppress(OSError, KeyError, ValueError):
            model["vocab_size"], source = int(json.loads(meta.read_text())["vocab_size"]), str(meta)
            break
    return dict(name="default", model=model, batch_size=cfg.get("data", {}).get("batch_size", 32), vocab_source=source)


def quick_shape() -> dict[str, Any]:
    return dict(name="quick", model=dict(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=50), batch_size=4)


def make_loader(vocab_size: int, block_size: int, batch_size: int, length: int) -> torch.utils.data.DataLoader:
    tokens = np.random.default_rng(0).integers(0, vocab_size, size=1 << 20, dtype=np.uint16)
    windows = RandomWindows(tokens, block_size, batch_size, seed=0, stream=0, length=length)
    return torch.utils.data.DataLoader(windows, batch_size=None, sampler=range(length), num_workers=0)


def make_module(shape: dict[str, Any], compile: bool, total_steps: int, device: torch.device | str = "cpu"):
    """The module as train.py builds it (default optimizer settings), compiled in place as train.py's CompileModel
    callback does."""
    torch.manual_seed(0)
    module = GPTLightningModule(GPTConfig(**shape["model"]), OptimConfig(decay_steps=total_steps)).to(device)
    if compile:
        module.model.compile()
    return module


class StepTimer(Callback):
    """perf_counter at each on_train_batch_start and at the end of training (after a device synchronize)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.stamps = device, []

    def _stamp(self) -> None:
        synchronize(self.device)
        self.stamps.append(time.perf_counter())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._stamp()

    def on_train_end(self, trainer, pl_module) -> None:
        self._stamp()


def alternating_pairs(run_a: Callable[[], dict], run_b: Callable[[], dict], rounds: int) -> tuple[list, list]:
    """`rounds` back-to-back pairs of runs, a then b in even rounds and b then a in odd ones, so a drift of the
    machine's speed within a pair hits both alike; returns (a's runs, b's runs)."""
    a_runs, b_runs = [], []
    for i in range(rounds):
        if i % 2:
            b_runs.append(run_b())
        a_runs.append(run_a())
        if not i % 2:
            b_runs.append(run_b())
    return a_runs, b_runs


def paired_ratio(runs: list[dict[str, Any]], base_runs: list[dict[str, Any]]) -> float:
    """Median over rounds of (this run's median step) / (the other's median step in the same round)."""
    return float(np.median([r["step_s"] / b["step_s"] for r, b in zip(runs, base_runs)]))


@contextlib.contextmanager
def quiet():
    """Silence Lightning's banner lines, warnings about our deliberately simple setup, and the progress bar."""
    loggers = [logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def run_lightning(
    module: GPTLightningModule,
    shape: dict[str, Any],
    precision: str,
    device: torch.device,
    warmup: int,
    steps: int,
    train_py: bool = False,
) -> dict[str, Any]:
    """trainer.fit for warmup + steps batches (+1, to close the last period): the step times' median and spread.
    train_py: with train.py's callbacks (minigpt.training.trainer.run_callbacks), TensorBoard logger, progress
    bar."""
    n = warmup + steps + 1
    timer = StepTimer(device)
    tmp = tempfile.TemporaryDirectory(prefix="bench_train_")
    callbacks: list[Callback] = [timer]
    if train_py:
        run_config = dict(
            out_dir=tmp.name,
            checkpoint_every=1000,
            sample_tokens=200,
            attention_images="auto",
            compile=False,
            early_stopping={"patience": None},
            trainer={},
        )
        # train.py's callbacks, its checkpoint every 1,000 steps (none in a run this short) in the scratch folder
        callbacks += [c for c in run_callbacks(run_config, shape["batch_size"]) if not isinstance(c, ModelCheckpoint)]
        callbacks.append(ModelCheckpoint(dirpath=tmp.name, filename="last", every_n_train_steps=1000))
    trainer_kwargs = dict(
        accelerator=device.type,
        devices=[device.index or 0] if device.type == "cuda" else 1,
        precision=precision,
        max_steps=n,
        max_epochs=-1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=None,
        val_check_interval=None,
        gradient_clip_val=1.0,
        log_every_n_steps=10,
        use_distributed_sampler=False,
        enable_model_summary=False,
        enable_checkpointing=train_py,
        enable_progress_bar=train_py,
        logger=TensorBoardLogger(tmp.name, name="", version="") if train_py else False,
        default_root_dir=tmp.name,
        callbacks=callbacks,
    )
    loader = make_loader(shape["model"]["vocab_size"], shape["model"]["block_size"], shape["batch_size"], n)
    with quiet(), tmp:
        t0 = time.perf_counter()
        L.Trainer(**trainer_kwargs).fit(module, train_dataloaders=loader)
    periods = np.diff(timer.stamps)
    timed = periods[warmup:]
    return dict(
        step_s=float(np.median(timed)),
        step_s_iqr=[float(np.percentile(timed, 25)), float(np.percentile(timed, 75))],
        first_step_s=float(periods[0]),
        warmup_s=float(periods[:warmup].sum()),
        timed_steps=len(timed),
        fit_setup_s=timer.stamps[0] - t0,  # Trainer.fit up to the first batch (compilation is in step 1)
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common_parser(__doc__.splitlines()[0], "train")
    p.add_argument("--shapes", nargs="+", default=["nanogpt", "default"], choices=["nanogpt", "default"])
    p.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"], choices=["32-true", "bf16-mixed"])
    p.add_argument("--compile", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (median reported)")
    p.add_argument("--warmup", type=int, default=5, help="steps skipped before timing (compilation happens here)")
    p.add_argument("--rounds", type=int, default=1, help="runs per setting: ms/step from the best")
    p.add_argument("--overhead_rounds", type=int, default=8, help="(minimal, train.py's) pairs; 0: none")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "manual", "einops"], help="of every shape")
    p.add_argument("--matmul_n", type=int, default=2048, help="largest matmul of the peak FLOP/s (halved to 64)")
    args = p.parse_args(argv)

    device = pick_device(args.device)
    shape_list = [{"nanogpt": nanogpt_shape, "default": default_shape}[s]() for s in args.shapes]
    for s in shape_list:
        s["model"]["attention"] = args.attention
    if args.quick:
        shape_list = [quick_shape()]
        args.steps, args.warmup, args.rounds, args.matmul_n, args.overhead_rounds = 3, 1, 1, 256, 2
        args.compile = ["off"]
    if "bf16-mixed" in args.precisions and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        args.precisions = [x for x in args.precisions if x != "bf16-mixed"]
    load_readings = wait_for_quiet(tries=args.wait_quiet)
    label = machine_label(device, "/".join(args.precisions))
    print(describe_machine(label), flush=True)
    for s in shape_list:
        print(f"Shape {s['name']}: {s['model']}, batch {s['batch_size']} (vocab from {s.get('vocab_source', 'it')})")

    peaks: dict[str, dict[str, Any]] = {}  # the MFU denominators, in each matmul dtype
    for key in {"bfloat16" if prec.startswith("bf16") else "float32" for prec in args.precisions}:
        peaks[key] = peak_matmul_flops(getattr(torch, key), device, n=args.matmul_n, repeats=3 if args.quick else 10)

    rows: list[dict[str, Any]] = []
    for shape in shape_list:
        B, T = shape["batch_size"], shape["model"]["block_size"]
        for prec in args.precisions:
            for comp in args.compile:
                module = make_module(shape, comp == "on", args.warmup + args.steps + 1, device)
                runs = [run_lightning(module, shape, prec, device, args.warmup, args.steps) for _ in range(args.rounds)]
                best, fpt = min(runs, key=lambda r: r["step_s"]), module.model.flops_per_token(T)
                peak = peaks["bfloat16" if prec.startswith("bf16") else "float32"]["flops"]
                rows.append(
                    dict(
                        shape=shape["name"],
                        precision=prec,
                        compile=comp == "on",
                        batch_size=B,
                        block_size=T,
                        params=module.model.num_params(),
                        flops_per_token=fpt,
                        step_ms=round(best["step_s"] * 1e3, 3),
                        tokens_per_s=round(B * T / best["step_s"], 1),
                        mfu=round(fpt * B * T / best["step_s"] / peak, 4),
                        step_ms_iqr=[round(x * 1e3, 3) for x in best["step_s_iqr"]],
                        warmup_s=round(runs[0]["warmup_s"], 3),
                        first_step_s=round(runs[0]["first_step_s"], 3),
                        fit_setup_s=round(runs[0]["fit_setup_s"], 3),
                        step_ms_per_round=[round(r["step_s"] * 1e3, 3) for r in runs],
                    )
                )
                r = rows[-1]
                print(
                    f"  {shape['name']:8s} {prec:10s} compile={comp:3s}: {r['step_ms']:8.2f} ms/step, "
                    f"{r['tokens_per_s']:9.0f} tok/s, MFU {100 * r['mfu']:.1f}%, warm-up {r['warmup_s']:.1f} s"
                    f"  load {load_avg()}",
                    flush=True,
                )

    extras: dict[str, Any] = {}  # train.py's callbacks, logger and progress bar over the minimal Trainer
    if args.overhead_rounds:
        shape = next((s for s in shape_list if s["name"] == "nanogpt"), shape_list[0])
        n = args.warmup + args.steps + 1

        def run(train_py: bool) -> dict[str, Any]:
            module = make_module(shape, False, n, device)
            return run_lightning(module, shape, "32-true", device, args.warmup, args.steps, train_py=train_py)

        minimal, train_py = alternating_pairs(lambda: run(False), lambda: run(True), args.overhead_rounds)
        extras = dict(
            shape=shape["name"],
            rounds=args.overhead_rounds,
            steps=args.steps,
            ratio=paired_ratio(train_py, minimal),
            minimal_ms=[round(r["step_s"] * 1e3, 3) for r in minimal],
            train_py_ms=[round(r["step_s"] * 1e3, 3) for r in train_py],
        )

    print(
        "\nPeak matmul FLOP/s (MFU denominators): "
        + ", ".join(f"{k}: {v['tflops'] * 1e3:.1f} GFLOP/s (at {v['n']}^3)" for k, v in peaks.items())
    )
    print(f"Per run: median of {args.steps} steps after {args.warmup} warm-up steps; best of {args.rounds} run(s)\n")
    cols = [("shape", "shape", ""), ("precision", "precision", ""), ("compile", "compile", "")]
    cols += [("step_ms", "ms/step", ".2f"), ("tokens_per_s", "tokens/s", ",.0f"), ("mfu", "MFU", ".1%")]
    print(markdown_table(rows, cols + [("warmup_s", "warm-up s", ".2f")]))
    if extras:
        print(
            f"\ntrain.py's callbacks, TensorBoard logger and progress bar over a minimal Trainer ({extras['shape']}, "
            f"32-true, eager), median of {extras['rounds']} adjacent pairs of {extras['steps']} steps: "
            f"{extras['ratio']:.3f} ({100 * (extras['ratio'] - 1):+.1f}%); pairs (train.py/minimal): "
            + ", ".join(f"{o:.2f}/{b:.2f} ms" for b, o in zip(extras["minimal_ms"], extras["train_py_ms"]))
        )
    checks: dict[str, Any] = {"mfu_below_measured_peak_all_rows": all(r["mfu"] < 1 for r in rows)}
    if nano := [r for r in rows if r["shape"] == "nanogpt"]:
        best = max(nano, key=lambda r: r["tokens_per_s"])
        checks["nanogpt_best"] = f"{best['precision']} compile={best['compile']} {best['tokens_per_s']:.0f} tok/s"
        checks["nanogpt_best_ge_2x_reference"] = best["tokens_per_s"] >= 2 * NANOGPT_TOKENS_PER_S
    if extras:
        checks["train_py_extras_lt_5pct"] = extras["ratio"] < 1.05
    print(
        f"\nChecks (reference: nanoGPT ~{NANOGPT_MS_PER_ITER} ms/iter = ~{NANOGPT_TOKENS_PER_S} tokens/s fp32, "
        "nanogpt shape): " + ", ".join(f"{k}={v}" for k, v in checks.items())
    )
    settings = dict(
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        shapes={s["name"]: s for s in shape_list},
        precisions=args.precisions,
        compile=args.compile,
        data="RandomWindows over 1M random uint16 tokens",
        quick=args.quick,
        reference=dict(nanogpt_tokens_per_s=NANOGPT_TOKENS_PER_S, nanogpt_ms_per_iter=NANOGPT_MS_PER_ITER),
    )
    result = dict(
        benchmark="train",
        machine=label,
        load_avg_1m_before=load_readings,
        load_avg_1m_after=load_avg(),
        settings=settings,
        peak_matmul=peaks,
        results=rows,
        train_py_extras=extras,
        checks=checks,
    )
    print(f"\nwrote {write_json(result, args.json)}")
    return result


if __name__ == "__main__":
    main()
