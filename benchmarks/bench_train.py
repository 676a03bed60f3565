"""Training throughput: tokens/s and MFU of real GPTLightningModule steps under a real lightning.Trainer,
and the Lightning loop's overhead over a bare PyTorch loop doing the same work.

    python benchmarks/bench_train.py                          # both shapes x {fp32, bf16} x {eager, compiled}
    python benchmarks/bench_train.py --quick                  # tiny smoke run (seconds)
    python benchmarks/bench_train.py --shapes nanogpt --precisions 32-true --compile off --steps 50
    python benchmarks/bench_train.py --profile                # + cProfile of the Lightning loop (nanogpt fp32)

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

Bare loop: the same module (so the same weights and, when compiled, the same compiled graph), the same
batches, module.configure_optimizers()'s optimizer and scheduler, autocast under bf16-mixed, loss.backward(),
clip_grad_norm_(1.0), optimizer.step(), scheduler.step(), zero_grad(set_to_none=True), timed the same way.
Lightning overhead = t_lightning / t_bare - 1 of the median step times of a pair of runs taken one after the
other (order alternated between rounds), the median over --rounds pairs: this machine's speed drifts by up
to ±20% over minutes, and a ratio of adjacent runs is far steadier than a ratio of best-of times.  The
headline figure, train.py's loop (its own callbacks, TensorBoard logger and progress bar) over the bare loop
on the nanogpt shape in float32, is measured the same way over --overhead_rounds pairs.

Also measured: AdamW step alone with fused=True vs foreach=True vs the single-tensor loop, and (on by
default for the nanogpt shape in float32) a breakdown of what train.py's extras cost (TensorBoard logger,
LearningRateMonitor, ThroughputMonitor, progress bar).
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import io
import json
import logging
import pstats
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

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from benchmarks.common import (
    REPO_ROOT,
    common_parser,
    describe_machine,
    load_avg,
    machine_label,  # noqa: E402
    markdown_table,
    median,
    peak_matmul_flops,
    pick_device,
    synchronize,
    time_fn,
    wait_for_quiet,
    write_json,
)
from minigpt.core.config import GPTConfig  # noqa: E402
from minigpt.training.datamodule import RandomWindows  # noqa: E402
from minigpt.training.lightning_module import GPTLightningModule  # noqa: E402
from minigpt.training.optim import OptimConfig  # noqa: E402

NANOGPT_TOKENS_PER_S = 15_000  # nanoGPT's own trainer on this recipe, fp32, on the reference 2-core machine
NANOGPT_MS_PER_ITER = 50


# --------------------------------------------------------------------------------------------------
# Shapes


def nanogpt_shape() -> dict[str, Any]:
    return dict(
        name="nanogpt",
        model=dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65, dropout=0.0),
        batch_size=12,
    )


def stdlib_vocab_size(default: int = 100) -> tuple[int, str]:
    for meta in sorted((REPO_ROOT / "data").glob("stdlib-char-*/meta.json")):
        try:
            return int(json.loads(meta.read_text())["vocab_size"]), str(meta.relative_to(REPO_ROOT))
        except (OSError, KeyError, ValueError):
            continue
    return default, "fallback (no prepared stdlib char data found)"


def default_shape() -> dict[str, Any]:
    import yaml

    cfg = yaml.safe_load((REPO_ROOT / "configs" / "default.yaml").read_text())
    model = dict(cfg.get("model", {}))  # the model section is GPTConfig's fields, nothing else
    vocab, source = stdlib_vocab_size()
    model["vocab_size"] = vocab
    return dict(name="default", model=model, batch_size=cfg.get("data", {}).get("batch_size", 32), vocab_source=source)


def quick_shape() -> dict[str, Any]:
    return dict(name="quick", model=dict(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=50), batch_size=4)


# --------------------------------------------------------------------------------------------------
# Data, module, timing callback


def make_loader(
    vocab_size: int, block_size: int, batch_size: int, length: int, seed: int = 0, n_tokens: int = 1 << 20
) -> torch.utils.data.DataLoader:
    tokens = np.random.default_rng(seed).integers(0, vocab_size, size=n_tokens, dtype=np.uint16)
    windows = RandomWindows(tokens, block_size, batch_size, seed=seed, stream=0, length=length)
    return torch.utils.data.DataLoader(windows, batch_size=None, sampler=range(length), num_workers=0)


def make_module(
    shape: dict[str, Any], compile: bool, total_steps: int, device: torch.device | str = "cpu", seed: int = 0
) -> GPTLightningModule:
    """The module as train.py builds it (default optimizer settings).  decay_steps is fixed so that
    configure_optimizers needs no trainer (the bare loop calls it too).  compile: in place, as train.py's
    CompileModel callback does, so both loops run the same compiled graph."""
    torch.manual_seed(seed)
    module = GPTLightningModule(GPTConfig(**shape["model"]), OptimConfig(decay_steps=total_steps)).to(device)
    if compile:
        module.model.compile()
    return module


PHASES = (
    ("fwd", "s", "z"),
    ("zero_grad", "z", "bb"),
    ("bwd", "bb", "ab"),
    ("glue", "ab", "bo"),
    ("opt", "bo", "e"),
    ("between", "e", "next"),
)
PHASE_HELP = {
    "fwd": "training_step: forward (+ the module's isfinite check and self.log under Lightning)",
    "zero_grad": "zero_grad(set_to_none=True)",
    "bwd": "backward",
    "glue": "Lightning between backward and on_before_optimizer_step",
    "opt": "clip_grad_norm_ (which measures grad_norm) + optimizer.step",
    "between": "after the step: LR scheduler, logger connector / callbacks, fetching the next batch",
}


class StepTimer(Callback):
    """perf_counter at each on_train_batch_start (and at the end of training); with phases=True also at
    on_before_zero_grad, on_before_backward, on_after_backward, on_before_optimizer_step, on_train_batch_end."""

    def __init__(self, device: torch.device, phases: bool = False) -> None:
        self.device, self.phases = device, phases
        self.stamps: dict[str, list[float]] = {k: [] for k in ("s", "z", "bb", "ab", "bo", "e")}

    def _stamp(self, key: str) -> None:
        synchronize(self.device)
        self.stamps[key].append(time.perf_counter())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._stamp("s")

    def on_train_end(self, trainer, pl_module) -> None:
        self._stamp("s")

    def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
        if self.phases:
            self._stamp("z")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.phases:
            self._stamp("bb")

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.phases:
            self._stamp("ab")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.phases:
            self._stamp("bo")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.phases:
            self._stamp("e")


def summarize(stamps: dict[str, list[float]], warmup: int) -> dict[str, Any]:
    """Median step time (batch start to next batch start) over the steps after `warmup`; per-phase medians
    where the phase stamps were taken."""
    s = np.asarray(stamps["s"])
    periods = np.diff(s)
    timed = periods[warmup:]
    out = dict(
        step_s=float(np.median(timed)),
        step_s_mean=float(np.mean(timed)),
        step_s_iqr=[float(np.percentile(timed, 25)), float(np.percentile(timed, 75))],
        first_step_s=float(periods[0]),
        warmup_s=float(periods[:warmup].sum()),
        timed_steps=len(timed),
        step_s_all=[float(x) for x in timed],
    )
    n = len(periods)
    if all(len(stamps[k]) >= n for k in ("z", "bb", "ab", "bo", "e")):
        cols = {k: np.asarray(stamps[k][:n]) for k in ("z", "bb", "ab", "bo", "e")}
        cols["s"], cols["next"] = s[:-1], s[1:]
        out["phases_ms"] = {
            name: round(float(np.median((cols[b] - cols[a])[warmup:])) * 1e3, 3) for name, a, b in PHASES
        }
    return out


def alternating_pairs(
    run_a: Callable[[], dict[str, Any]], run_b: Callable[[], dict[str, Any]], rounds: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
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


def paired_ratio(runs: list[dict[str, Any]], bare_runs: list[dict[str, Any]]) -> float:
    """Median over rounds of (this run's median step) / (the bare loop's median step in the same round).

    The machine's speed drifts by up to ±20% over minutes; runs taken seconds apart in the same round see
    nearly the same speed, so their ratio is stable where a ratio of best-of-all-rounds times is not."""
    return float(np.median([r["step_s"] / b["step_s"] for r, b in zip(runs, bare_runs)]))


@contextlib.contextmanager
def quiet():
    """Silence Lightning's banner lines, warnings about our deliberately simple setup, and the progress bar."""
    names = ["lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"]
    levels = [logging.getLogger(n).level for n in names]
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            for n, lvl in zip(names, levels):
                logging.getLogger(n).setLevel(lvl)


def run_lightning(
    module: GPTLightningModule,
    shape: dict[str, Any],
    precision: str,
    device: torch.device,
    warmup: int,
    steps: int,
    extras: str = "none",
    log_every_n_steps: int = 10,
    phases: bool = False,
    profiler: cProfile.Profile | None = None,
) -> dict[str, Any]:
    """trainer.fit for warmup + steps batches (+1, to close the last period).

    extras: "none", or a '+'-joined subset of tb (TensorBoardLogger), lr (LearningRateMonitor), tput
    (ThroughputMonitor as in minigpt/training/trainer.py), bar (progress bar); "train_py" = tb+lr+tput."""
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ThroughputMonitor
    from lightning.pytorch.loggers import TensorBoardLogger

    n = warmup + steps + 1
    timer = StepTimer(device, phases)
    parts = set() if extras == "none" else set(extras.replace("train_py", "tb+lr+tput").split("+"))
    tmp = tempfile.TemporaryDirectory(prefix="bench_train_")
    callbacks: list[Callback] = [timer]
    if (
        "train_cli" in parts
    ):  # exactly what train.py adds: minigpt.training.trainer.run_callbacks, with its progress bar
        from minigpt.training.trainer import run_callbacks

        parts = {"tb", "bar"}
        run_config = dict(
            out_dir=tmp.name,
            checkpoint_every=1000,
            sample_tokens=200,
            attention_images="auto",
            compile=False,
            early_stopping={"patience": None},
            trainer={},
        )
        callbacks += [
            c for c in run_callbacks(run_config, shape["batch_size"]) if not isinstance(c, ModelCheckpoint)
        ] + [ModelCheckpoint(dirpath=tmp.name, filename="last", every_n_train_steps=1000)]
    if "lr" in parts:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    if "tput" in parts:
        callbacks.append(
            ThroughputMonitor(batch_size_fn=lambda b: b.size(0), length_fn=lambda b: b.size(1) - 1, window_size=10)
        )
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
        log_every_n_steps=log_every_n_steps,
        use_distributed_sampler=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar="bar" in parts,
        logger=TensorBoardLogger(tmp.name, name="", version="") if "tb" in parts else False,
        default_root_dir=tmp.name,
        callbacks=callbacks,
    )
    loader = make_loader(shape["model"]["vocab_size"], shape["model"]["block_size"], shape["batch_size"], n)
    with quiet(), tmp:
        trainer = L.Trainer(**trainer_kwargs)
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        trainer.fit(module, train_dataloaders=loader)
        if profiler is not None:
            profiler.disable()
    out = summarize(timer.stamps, warmup)
    out["fit_setup_s"] = timer.stamps["s"][0] - t0  # Trainer.fit up to the first batch (compile is in step 1)
    return out


def run_bare(
    module: GPTLightningModule,
    shape: dict[str, Any],
    precision: str,
    device: torch.device,
    warmup: int,
    steps: int,
    phases: bool = False,
) -> dict[str, Any]:
    """The same steps without Lightning (see the module docstring), stamped at the same points."""
    n = warmup + steps + 1
    module.to(device).train()
    cfg = module.configure_optimizers()
    optimizer, scheduler = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if precision.startswith("bf16") else contextlib.nullcontext()
    )
    loader = make_loader(shape["model"]["vocab_size"], shape["model"]["block_size"], shape["batch_size"], n)
    stamps: dict[str, list[float]] = {k: [] for k in ("s", "z", "bb", "ab", "bo", "e")}

    def stamp(key: str) -> None:
        if phases or key == "s":
            synchronize(device)
            stamps[key].append(time.perf_counter())

    for batch in loader:
        stamp("s")
        batch = batch.to(device, non_blocking=True)
        with autocast:
            _, loss = module.model(batch[:, :-1], batch[:, 1:])
        stamp("z")
        optimizer.zero_grad(set_to_none=True)  # where Lightning zeroes: after the forward, before backward
        stamp("bb")
        loss.backward()
        stamp("ab")
        stamp("bo")
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        stamp("e")
        scheduler.step()
    stamp("s")
    return summarize(stamps, warmup)


# --------------------------------------------------------------------------------------------------
# Optimizer micro-benchmark


def bench_adamw(shape: dict[str, Any], device: torch.device, repeats: int) -> list[dict[str, Any]]:
    module = make_module(shape, compile=False, total_steps=1000, device=device)
    params = [p for p in module.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3

    def groups() -> list[dict]:
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    rows = []
    for impl, kw in (("fused", dict(fused=True)), ("foreach", dict(foreach=True)), ("for-loop", dict(foreach=False))):
        try:
            opt = torch.optim.AdamW(groups(), lr=1e-4, betas=(0.9, 0.95), **kw)
        except (RuntimeError, ValueError) as e:  # fused not supported on this device
            rows.append(dict(shape=shape["name"], impl=impl, error=str(e)))
            continue
        t = median(time_fn(opt.step, device, repeats=repeats, warmup=3))
        rows.append(
            dict(
                shape=shape["name"],
                impl=impl,
                params=sum(p.numel() for p in params),
                tensors=len(params),
                step_ms=round(t * 1e3, 4),
            )
        )
    return rows


# --------------------------------------------------------------------------------------------------


def print_profile(profiler: cProfile.Profile, top: int = 30) -> str:
    s = io.StringIO()
    stats = pstats.Stats(profiler, stream=s).strip_dirs()
    stats.sort_stats("cumulative").print_stats(top)
    s.write("\n")
    stats.sort_stats("tottime").print_stats(top)
    return s.getvalue()


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def no_log(module: GPTLightningModule) -> None:
    module.log = _noop  # train_loss and grad_norm (every log_every_n_steps) are no longer logged


# name, runner ("bare" or "lightning"), extras for run_lightning, patch applied to the module
DETAIL_VARIANTS = [
    ("bare PyTorch loop", "bare", None, None),
    ("Lightning, minimal (as in the main table)", "lightning", "none", None),
    ("  minimal, module's self.log disabled", "lightning", "none", no_log),
    ("  + TensorBoard logger", "lightning", "tb", None),
    ("  + TensorBoard + LearningRateMonitor", "lightning", "tb+lr", None),
    ("  + TensorBoard + LR + ThroughputMonitor (train.py's set)", "lightning", "train_py", None),
    ("  + all that + progress bar (Lightning's default, redrawn every step)", "lightning", "train_py+bar", None),
    ("train.py's own callbacks, logger and progress bar", "lightning", "train_cli", None),
]


def fmt_checks(checks: dict[str, Any]) -> str:
    return ", ".join(f"{k}={('yes' if v else 'NO') if isinstance(v, bool) else v}" for k, v in checks.items())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common_parser(__doc__.splitlines()[0], "train")
    p.add_argument("--shapes", nargs="+", default=["nanogpt", "default"], choices=["nanogpt", "default"])
    p.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"], choices=["32-true", "bf16-mixed"])
    p.add_argument("--compile", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (median reported)")
    p.add_argument("--warmup", type=int, default=5, help="steps skipped before timing (compilation happens here)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="Lightning/bare run pairs per setting: ms/step from the best run, overhead the median of "
        "the per-pair ratios",
    )
    p.add_argument("--no_bare", action="store_true", help="skip the bare PyTorch loop comparison")
    p.add_argument(
        "--overhead_detail",
        default="auto",
        choices=["auto", "on", "off"],
        help="per-phase breakdown of the Lightning overhead and of train.py's logger/callbacks/progress "
        "bar on the nanogpt shape, fp32, eager (auto: on when the nanogpt shape is run)",
    )
    p.add_argument("--detail_rounds", type=int, default=2, help="alternating rounds of the breakdown variants")
    p.add_argument(
        "--overhead_rounds",
        type=int,
        default=8,
        help="adjacent (bare loop, train.py's loop) pairs for the headline overhead ratio",
    )
    p.add_argument("--detail_steps", type=int, default=30, help="timed steps per breakdown run")
    p.add_argument("--adamw", default="on", choices=["on", "off"], help="fused vs foreach AdamW micro-benchmark")
    p.add_argument(
        "--attention",
        default="sdpa",
        choices=["sdpa", "manual", "einops"],
        help="attention path of every shape (on a CPU, manual beats sdpa under bf16)",
    )
    p.add_argument(
        "--matmul_n", type=int, default=2048, help="largest matmul size for the peak FLOP/s (halved down to 64)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also cProfile one Lightning run (first shape, first precision, eager) and print the top",
    )
    args = p.parse_args(argv)

    device = pick_device(args.device)
    shapes = {"nanogpt": nanogpt_shape, "default": default_shape}
    shape_list = [shapes[s]() for s in args.shapes]
    for s in shape_list:
        s["model"]["attention"] = args.attention
    if args.quick:
        shape_list = [quick_shape()]
        args.steps, args.warmup, args.rounds, args.matmul_n = 3, 1, 1, 256
        args.detail_rounds, args.detail_steps, args.overhead_rounds = 1, 3, 2
        args.compile = ["off"]
        if args.overhead_detail == "auto":
            args.overhead_detail = "off"
    if "bf16-mixed" in args.precisions and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        args.precisions = [x for x in args.precisions if x != "bf16-mixed"]
    load_readings = wait_for_quiet(tries=args.wait_quiet)
    label = machine_label(device, "/".join(args.precisions))
    print(describe_machine(label), flush=True)
    for s in shape_list:
        print(
            f"Shape {s['name']}: {s['model']}, batch {s['batch_size']}"
            + (f" (vocab from {s['vocab_source']})" if "vocab_source" in s else "")
        )

    # Peak matmul FLOP/s in each matmul dtype, for MFU
    peaks: dict[str, dict[str, Any]] = {}
    for prec in args.precisions:
        key = "bfloat16" if prec.startswith("bf16") else "float32"
        if key not in peaks:
            peaks[key] = peak_matmul_flops(
                getattr(torch, key), device, n=args.matmul_n, repeats=3 if args.quick else 10
            )
    print(
        "Peak matmul: " + ", ".join(f"{k} {v['tflops'] * 1e3:.1f} GFLOP/s ({v['n']}^3)" for k, v in peaks.items()),
        flush=True,
    )

    rows: list[dict[str, Any]] = []
    for shape in shape_list:
        B, T = shape["batch_size"], shape["model"]["block_size"]
        for prec in args.precisions:
            matmul_dtype = "bfloat16" if prec.startswith("bf16") else "float32"
            for comp in args.compile:
                compiled = comp == "on"
                module = make_module(shape, compiled, args.warmup + args.steps + 1, device)
                fpt = module.model.flops_per_token(T)
                lightning_run = functools.partial(run_lightning, module, shape, prec, device, args.warmup, args.steps)
                if args.no_bare:
                    lruns, bruns = [lightning_run() for _ in range(args.rounds)], []
                else:
                    lruns, bruns = alternating_pairs(
                        lightning_run,
                        functools.partial(run_bare, module, shape, prec, device, args.warmup, args.steps),
                        args.rounds,
                    )
                lt = min(lruns, key=lambda r: r["step_s"])
                row = dict(
                    shape=shape["name"],
                    precision=prec,
                    compile=compiled,
                    batch_size=B,
                    block_size=T,
                    params=module.model.num_params(),
                    flops_per_token=fpt,
                    step_ms=round(lt["step_s"] * 1e3, 3),
                    tokens_per_s=round(B * T / lt["step_s"], 1),
                    mfu=round(fpt * B * T / lt["step_s"] / peaks[matmul_dtype]["flops"], 4),
                    step_ms_iqr=[round(x * 1e3, 3) for x in lt["step_s_iqr"]],
                    warmup_s=round(lruns[0]["warmup_s"], 3),
                    first_step_s=round(lruns[0]["first_step_s"], 3),
                    fit_setup_s=round(lruns[0]["fit_setup_s"], 3),
                    step_ms_per_round=[round(r["step_s"] * 1e3, 3) for r in lruns],
                )
                if bruns:
                    bt = min(bruns, key=lambda r: r["step_s"])
                    row.update(
                        bare_step_ms=round(bt["step_s"] * 1e3, 3),
                        bare_tokens_per_s=round(B * T / bt["step_s"], 1),
                        bare_step_ms_per_round=[round(r["step_s"] * 1e3, 3) for r in bruns],
                        overhead_pct=round(100 * (paired_ratio(lruns, bruns) - 1), 2),
                    )
                rows.append(row)
                print(
                    f"  {shape['name']:8s} {prec:10s} compile={comp:3s}: {row['step_ms']:8.2f} ms/step, "
                    f"{row['tokens_per_s']:9.0f} tok/s, MFU {100 * row['mfu']:.1f}%, warm-up "
                    f"{row['warmup_s']:.1f} s"
                    + (f", bare {row['bare_step_ms']:.2f} ms (overhead {row['overhead_pct']:+.1f}%)" if bruns else "")
                    + f"  load {load_avg()}",
                    flush=True,
                )
                del module

    # Where Lightning's per-step time goes, and what train.py's extras add (smallest shape, fp32, eager:
    # where a fixed per-step cost weighs most)
    detail: list[dict[str, Any]] = []
    headline: dict[str, Any] = {}
    detail_shape = next((s for s in shape_list if s["name"] == "nanogpt"), shape_list[0])
    if args.overhead_detail == "on" or (args.overhead_detail == "auto" and "nanogpt" in args.shapes):
        prec, steps = "32-true", args.detail_steps
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in DETAIL_VARIANTS}

        def run_detail(name: str, runner: str, extras: str | None, patch: Any) -> dict[str, Any]:
            module = make_module(detail_shape, False, args.warmup + steps + 1, device)
            if patch is not None:
                patch(module)
            if runner == "bare":
                return run_bare(module, detail_shape, prec, device, args.warmup, steps, phases=True)
            return run_lightning(module, detail_shape, prec, device, args.warmup, steps, extras=extras, phases=True)

        for i in range(args.detail_rounds):  # variants interleaved, order reversed every other round: drift
            for variant in DETAIL_VARIANTS[:: -1 if i % 2 else 1]:  # hits them alike
                runs[variant[0]].append(run_detail(*variant))
        # the headline ratio: train.py's loop and the bare loop in adjacent pairs, order alternated
        bare_variant, ours_variant = DETAIL_VARIANTS[0], next(v for v in DETAIL_VARIANTS if v[2] == "train_cli")
        bare_pairs, ours_pairs = alternating_pairs(
            lambda: run_detail(*bare_variant), lambda: run_detail(*ours_variant), args.overhead_rounds
        )
        headline = dict(
            rounds=args.overhead_rounds,
            steps=steps,
            ratio=paired_ratio(ours_pairs, bare_pairs),
            ratios=[round(o["step_s"] / b["step_s"], 4) for b, o in zip(bare_pairs, ours_pairs)],
            bare_ms=[round(b["step_s"] * 1e3, 3) for b in bare_pairs],
            train_py_ms=[round(o["step_s"] * 1e3, 3) for o in ours_pairs],
        )
        B, T = detail_shape["batch_size"], detail_shape["model"]["block_size"]
        best = {name: min(r, key=lambda x: x["step_s"]) for name, r in runs.items()}
        bare_runs = runs[DETAIL_VARIANTS[0][0]]
        for name, _runner, extras, patch in DETAIL_VARIANTS:
            r = best[name]
            d = dict(
                shape=detail_shape["name"],
                precision=prec,
                variant=name.strip(),
                extras=extras,
                patch=patch.__name__ if patch else None,
                step_ms=round(r["step_s"] * 1e3, 3),
                tokens_per_s=round(B * T / r["step_s"], 1),
                overhead_pct=round(100 * (paired_ratio(runs[name], bare_runs) - 1), 2),
                step_ms_per_round=[round(x["step_s"] * 1e3, 3) for x in runs[name]],
            )
            d.update({f"{k}_ms": v for k, v in r.get("phases_ms", {}).items()})
            detail.append(d)

    adamw: list[dict[str, Any]] = []
    if args.adamw == "on":
        for shape in shape_list:
            adamw += bench_adamw(shape, device, repeats=10 if args.quick else 50)

    profile_text = None
    if args.profile:
        shape = shape_list[0]
        prof = cProfile.Profile()
        module = make_module(shape, False, args.warmup + args.steps + 1, device)
        run_lightning(module, shape, args.precisions[0], device, args.warmup, args.steps, profiler=prof)
        profile_text = print_profile(prof)

    # ---------------------------------------------------------------- report
    print(
        "\nPeak matmul FLOP/s (MFU denominators): "
        + ", ".join(
            f"{k}: {v['tflops'] * 1e3:.1f} GFLOP/s (at {v['n']}^3, best of {', '.join(map(str, v['sizes']))}"
            + (f"; {', '.join(map(str, v['skipped']))} skipped, over 1 s a matmul" if v["skipped"] else "")
            + ")"
            for k, v in peaks.items()
        )
    )
    print(
        f"Per run: median of {args.steps} steps after {args.warmup} warm-up steps; best of {args.rounds} "
        f"run(s); tokens/s = B*T / step time; warm-up s = the {args.warmup} skipped steps (compilation)\n"
    )
    cols = [
        ("shape", "shape", ""),
        ("precision", "precision", ""),
        ("compile", "compile", ""),
        ("step_ms", "ms/step", ".2f"),
        ("tokens_per_s", "tokens/s", ",.0f"),
        ("mfu", "MFU", ".1%"),
        ("warmup_s", "warm-up s", ".2f"),
    ]
    if not args.no_bare:
        cols += [
            ("bare_step_ms", "bare ms/step", ".2f"),
            ("bare_tokens_per_s", "bare tokens/s", ",.0f"),
            ("overhead_pct", "Lightning overhead %", "+.1f"),
        ]
    print(markdown_table(rows, cols))
    if detail:
        print(
            f"\nLightning overhead breakdown ({detail_shape['name']}, 32-true, eager; {args.detail_rounds} interleaved"
            f" rounds of {args.detail_steps} steps; ms/step and phase medians from the best round, 'vs bare' the"
            f" median of the per-round ratios):\n"
        )
        print(
            markdown_table(
                detail,
                [("variant", "variant", ""), ("step_ms", "ms/step", ".2f"), ("overhead_pct", "vs bare %", "+.1f")]
                + [(f"{k}_ms", k, ".2f") for k, *_ in PHASES],
            )
        )
        print("\nPhases: " + "; ".join(f"{k} = {v}" for k, v in PHASE_HELP.items()))
        print(
            f"\ntrain.py's Lightning loop (its callbacks, TensorBoard logger and progress bar) vs the bare loop, "
            f"{headline['rounds']} adjacent pairs of {headline['steps']} steps, median of the per-pair ratios: "
            f"{headline['ratio']:.3f} ({100 * (headline['ratio'] - 1):+.1f}%); pairs (train.py/bare): "
            + ", ".join(f"{o:.2f}/{b:.2f} ms" for b, o in zip(headline["bare_ms"], headline["train_py_ms"]))
        )
    if adamw:
        print("\nAdamW step alone (median ms):\n")
        print(
            markdown_table(
                adamw,
                [
                    ("shape", "shape", ""),
                    ("impl", "implementation", ""),
                    ("tensors", "tensors", "d"),
                    ("params", "params", ",d"),
                    ("step_ms", "ms/step", ".3f"),
                ],
            )
        )

    checks: dict[str, Any] = {}
    nano = [r for r in rows if r["shape"] == "nanogpt"]
    if nano:
        fp32 = [r for r in nano if r["precision"] == "32-true" and not r["compile"]]
        if fp32:
            checks["nanogpt_fp32_eager_ge_reference"] = fp32[0]["tokens_per_s"] >= NANOGPT_TOKENS_PER_S
        best = max(nano, key=lambda r: r["tokens_per_s"])
        checks["nanogpt_best"] = f"{best['precision']} compile={best['compile']} {best['tokens_per_s']:.0f} tok/s"
        checks["nanogpt_best_ge_2x_reference"] = best["tokens_per_s"] >= 2 * NANOGPT_TOKENS_PER_S
    if any("overhead_pct" in r for r in rows):
        checks["lightning_overhead_lt_5pct_all_rows"] = all(r["overhead_pct"] < 5 for r in rows if "overhead_pct" in r)
    if rows:
        # Above 100% the denominator was not the peak: the MFU column would be meaningless.
        checks["mfu_below_measured_peak_all_rows"] = all(r["mfu"] < 1 for r in rows)
    if headline:
        checks["train_py_overhead_lt_5pct"] = headline["ratio"] < 1.05
    if checks:
        print(
            f"\nChecks (reference: nanoGPT ~{NANOGPT_MS_PER_ITER} ms/iter = ~{NANOGPT_TOKENS_PER_S} tokens/s fp32, "
            f"nanogpt shape): " + fmt_checks(checks)
        )
    if profile_text:
        print("\ncProfile of one Lightning run:\n")
        print(profile_text)

    settings = dict(
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        statistic="median per run; ms/step from the best run, overhead the median of per-round Lightning/bare ratios",
        shapes={s["name"]: s for s in shape_list},
        precisions=args.precisions,
        compile=args.compile,
        trainer=dict(
            gradient_clip_val=1.0,
            log_every_n_steps=10,
            logger=False,
            checkpointing=False,
            progress_bar=False,
            validation=False,
        ),
        data="RandomWindows over 1M random uint16 tokens",
        quick=args.quick,
        detail=dict(rounds=args.detail_rounds, steps=args.detail_steps, phases=PHASE_HELP),
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
        overhead_breakdown=detail,
        train_py_overhead=headline,
        adamw=adamw,
        checks=checks,
        profile=profile_text,
    )
    out = write_json(result, args.json)
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
