"""Time-to-loss: train.py under a wall-clock budget, one lever changed at a time, on any text file.

    python benchmarks/time_to_loss.py --corpus ../shared/data/tinyshakespeare.txt             # all variants
    python benchmarks/time_to_loss.py --corpus ../shared/data/tinyshakespeare.txt --budget 40 --variants recipe
    python benchmarks/time_to_loss.py --corpus stdlib --variants nanogpt recipe                # a second corpus
    python benchmarks/time_to_loss.py --corpus ../shared/data/tinyshakespeare.txt --budget 40 --variants recipe \
        --extra=--model.n_layer=2 --extra=--optim.learning_rate=6e-3                            # any other lever

Each variant is `python train.py --config configs/shakespeare_char_cpu.yaml --data.source CORPUS` plus its
overrides, stopped by `--trainer.max_time` after --budget seconds of training (the learning-rate decay is
placed on the budget in training time, see minigpt.training.optim.LRSchedule).  Reported per variant:

* full val loss: train.py's own evaluation of the final weights on the whole validation split;
* time to --target: the training time at the first periodic validation whose loss (val_batches windows,
  an estimate like nanoGPT's eval_iters) is <= target, read from the run's TensorBoard events; the time of
  step s is s * training_time / steps (steps take equal time);
* steps, tokens/s and training time (the fit loop: validation included, data preparation and the final
  evaluation not).

Runs validate as often as the config does (the shipped recipe: every 250 steps), so the recipe's row is the
recipe as a user runs it: each validation spends budget that training would have had.  --val_every 100 gives
a finer time-to-target column at the cost of a few dozen steps of a 114 s run.

Data preparation happens once, before the first variant, and is not counted.  Runs go one after another
(never in parallel: two runs on 2 cores slow each other down).  Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks.common import (
    REPO_ROOT,
    common_parser,
    describe_machine,
    load_avg,
    machine_label,
    markdown_table,
    wait_for_quiet,
    write_json,
)

CONFIG = "configs/shakespeare_char_cpu.yaml"

# nanoGPT's documented CPU run, in train.py's terms (its shakespeare_char config with the CPU flags)
NANOGPT = [
    "--trainer.precision",
    "32-true",
    "--model.attention",
    "sdpa",
    "--optim.learning_rate",
    "1e-3",
    "--optim.warmup_steps",
    "100",
    "--optim.min_lr_ratio",
    "0.1",
    "--optim.beta2",
    "0.99",
    "--optim.weight_decay",
    "0.1",
    "--data.batch_size",
    "12",
    "--model.block_size",
    "64",
    "--model.n_layer",
    "4",
    "--model.n_head",
    "4",
    "--model.n_embd",
    "128",
    "--model.dropout",
    "0.0",
    "--optim.lr_schedule",
    "cosine",
    "--model.arch",
    "gpt",
    "--optim.optimizer",
    "adamw",
]

# name -> (what changes relative to the shipped recipe, overrides)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "recipe": ("configs/shakespeare_char_cpu.yaml as shipped", []),
    "cosine_lr2e-3": (
        "cosine decay to 0.1 at peak lr 2e-3 (the first recipe)",
        ["--optim.lr_schedule", "cosine", "--optim.learning_rate", "2e-3", "--optim.min_lr_ratio", "0.1"],
    ),
    "nanogpt": ("nanoGPT's CPU settings (fp32, lr 1e-3, batch 12, context 64, cosine) in our trainer", NANOGPT),
    "fp32": ("float32 forced (precision: auto picks it where bf16 is not native)", ["--trainer.precision", "32-true"]),
    "bf16": ("bf16-mixed forced (the recipe before precision: auto)", ["--trainer.precision", "bf16-mixed"]),
    "sdpa": ("SDPA attention instead of manual (CPU flash backward is slow in bf16)", ["--model.attention", "sdpa"]),
    "compile": ("torch.compile on", ["--compile", "true"]),
    "batch12": ("batch 12 instead of the recipe's", ["--data.batch_size", "12"]),
    "batch64": ("batch 64", ["--data.batch_size", "64"]),
    "ctx128": ("context 128 instead of 64", ["--model.block_size", "128"]),
    "lr1e-3": ("peak learning rate 1e-3", ["--optim.learning_rate", "1e-3"]),
    "lr4e-3": ("peak learning rate 4e-3", ["--optim.learning_rate", "4e-3"]),
    "cosine": ("cosine decay instead of warmup-stable-decay", ["--optim.lr_schedule", "cosine"]),
    "wsd": ("warmup-stable-decay schedule", ["--optim.lr_schedule", "wsd"]),
    "gpt": ("GPT-2 block (LayerNorm, learned positions, GELU)", ["--model.arch", "gpt"]),
    "llama": ("Llama block (RMSNorm, RoPE, SwiGLU)", ["--model.arch", "llama"]),
    "qk_norm": ("QK-norm on", ["--model.qk_norm", "true"]),
    "no_qk_norm": ("QK-norm off", ["--model.qk_norm", "false"]),
    "relu2": ("ReLU^2 MLP", ["--model.mlp", "relu2"]),
    "zero_init": ("zero-initialised output projections", ["--model.zero_init_proj", "true"]),
    "no_zero_init": ("GPT-2 init of output projections", ["--model.zero_init_proj", "false"]),
    "untied": ("untied output head", ["--model.tie_embeddings", "false"]),
    "tied": ("tied output head", ["--model.tie_embeddings", "true"]),
    "muon": ("Muon for hidden matrices + AdamW for the rest", ["--optim.optimizer", "muon"]),
    "adamw": ("AdamW for everything", ["--optim.optimizer", "adamw"]),
}


def seconds_to_max_time(seconds: float) -> str:
    s = int(round(seconds))
    return f"00:{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def val_curve(run_dir: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    if "val_loss" not in acc.Tags().get("scalars", []):
        return []
    return [(e.step, e.value) for e in acc.Scalars("val_loss")]


def config_val_every(config: str) -> int | float | None:
    """The config's own trainer.val_check_interval."""
    import yaml

    return (yaml.safe_load((REPO_ROOT / config).read_text()).get("trainer") or {}).get("val_check_interval")


def run_variant(
    name: str,
    overrides: list[str],
    corpus: str,
    budget: float,
    config: str,
    work: Path,
    val_every: int | None,
    extra: list[str],
) -> dict[str, Any]:
    out_dir = work / name
    validation = [] if val_every is None else ["--trainer.val_check_interval", str(val_every)]
    cmd = [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        "--config",
        config,
        "--data.source",
        corpus,
        "--trainer.max_time",
        seconds_to_max_time(budget),
        "--trainer.max_steps",
        "-1",
        *validation,
        "--trainer.enable_progress_bar",
        "false",
        "--sample_tokens",
        "0",
        "--checkpoint_every",
        "1000000",
        "--out_dir",
        str(out_dir),
        "--overwrite",
        "true",
        *overrides,
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        return dict(variant=name, error=tail[0] if tail else f"exit {proc.returncode}")
    out = proc.stdout
    steps = int(re.search(r"after (\d+) steps", out).group(1))
    train_s = float(re.search(r"training time ([\d.]+)s", out).group(1))
    full = float(re.search(r"full val loss ([\d.]+)", out).group(1))
    curve = val_curve(out_dir)
    return dict(
        variant=name,
        steps=steps,
        train_s=round(train_s, 1),
        full_val_loss=round(full, 4),
        ms_per_step=round(1e3 * train_s / max(steps, 1), 2),
        curve=curve,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common_parser(__doc__.splitlines()[0], "time_to_loss")
    p.add_argument("--corpus", required=True, help="text file (or any --data.source) to train on")
    p.add_argument("--budget", type=float, default=114.0, help="training seconds per run (default 114)")
    p.add_argument("--target", type=float, default=1.88, help="val loss to reach (default 1.88)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--config", default=CONFIG)
    p.add_argument(
        "--val_every",
        type=int,
        default=None,
        help="steps between periodic validations (default: the config's own, as the recipe ships; "
        "100 for a finer time-to-target column)",
    )
    p.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="--FLAG=VALUE",
        help="a train.py flag added to every run, written with '=': --extra=--optim.learning_rate=6e-3 "
        "(repeat for several)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.budget, args.variants = 3.0, args.variants[:1]

    load_readings = wait_for_quiet(tries=args.wait_quiet)
    label = machine_label("cpu", "see variants")
    print(describe_machine(label), flush=True)
    val_every = config_val_every(args.config) if args.val_every is None else args.val_every
    print(
        f"Corpus {args.corpus}; budget {args.budget:.0f} s of training per run; target {args.target}; "
        f"validation every {val_every} steps\n",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="time_to_loss_") as tmp:
        work = Path(tmp)
        # prepare the data once (cached in data/), so no run counts it
        prep = subprocess.run(
            [
                sys.executable,
                str(REPO_ROOT / "train.py"),
                "--config",
                args.config,
                "--data.source",
                args.corpus,
                "--trainer.max_steps",
                "1",
                "--eval_full",
                "false",
                "--trainer.enable_progress_bar",
                "false",
                "--out_dir",
                str(work / "prep"),
                *args.extra,
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
        )
        if prep.returncode != 0:
            raise SystemExit(f"data preparation failed: {(prep.stderr or prep.stdout).strip().splitlines()[-1]}")
        for name in args.variants:
            what, overrides = VARIANTS[name]
            r = run_variant(name, overrides, args.corpus, args.budget, args.config, work, args.val_every, args.extra)
            r["change"] = what
            if "curve" in r:
                hit = next((s for s, v in r["curve"] if v <= args.target), None)
                r["time_to_target_s"] = None if hit is None else round(hit * r["train_s"] / r["steps"], 1)
                r["best_val_estimate"] = round(min(v for _, v in r["curve"]), 4) if r["curve"] else None
                print(
                    f"  {name:12s} full val {r['full_val_loss']:.4f}, to {args.target}: "
                    f"{r['time_to_target_s']} s, {r['steps']} steps in {r['train_s']} s "
                    f"({r['ms_per_step']} ms/step)  load {load_avg()}",
                    flush=True,
                )
            else:
                print(f"  {name:12s} failed: {r['error']}", flush=True)
            rows.append(r)

    print()
    print(
        markdown_table(
            rows,
            [
                ("variant", "variant", ""),
                ("change", "change", ""),
                ("time_to_target_s", f"time to {args.target} (s)", ".1f"),
                ("full_val_loss", f"full val loss at {args.budget:.0f} s", ".4f"),
                ("steps", "steps", "d"),
                ("ms_per_step", "ms/step", ".1f"),
            ],
        )
    )
    result = dict(
        benchmark="time_to_loss",
        machine=label,
        load_avg_1m_before=load_readings,
        load_avg_1m_after=load_avg(),
        corpus=args.corpus,
        budget_s=args.budget,
        target=args.target,
        config=args.config,
        val_every=val_every,
        extra=args.extra,
        results=rows,
    )
    print(f"\nwrote {write_json(result, args.json)}")
    return result


if __name__ == "__main__":
    main()
