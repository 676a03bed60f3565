"""Time-to-loss: train.py under a wall-clock budget, one lever changed at a time, on any text file.

    python benchmarks/time_to_loss.py --corpus ../shared/data/tinyshakespeare.txt             # all variants

Method and results: docs/time_to_loss.md.
"""

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

import torch
import yaml

from benchmarks import common
from minigpt.core.precision import runs_on_cpu

CONFIG = "configs/shakespeare_char_cpu.yaml"
RESULT = "time_to_loss result: "
NUMERICS = {"float32": "32-true", "bf16": "bf16-mixed"}  # numerics -> the run's precision

# nanoGPT's documented CPU run, in train.py's terms (its shakespeare_char config with the CPU flags)
NANOGPT = """--trainer.precision 32-true --model.attention sdpa --optim.learning_rate 1e-3 --optim.warmup_steps 100
    --optim.min_lr_ratio 0.1 --optim.beta2 0.99 --optim.weight_decay 0.1 --data.batch_size 12 --model.block_size 64
    --model.n_layer 4 --model.n_head 4 --model.n_embd 128 --model.dropout 0.0 --optim.lr_schedule cosine
    --model.arch gpt --optim.optimizer adamw"""

# name -> (what changes relative to the shipped recipe, overrides); any other lever: --extra
VARIANTS: dict[str, tuple[str, str]] = {
    "recipe": ("configs/shakespeare_char_cpu.yaml as shipped", ""),
    "nanogpt": ("nanoGPT's CPU settings (fp32, lr 1e-3, batch 12, context 64, cosine) in our trainer", NANOGPT),
    "fp32": ("float32 forced (precision: auto picks it where bf16 is not native)", "--trainer.precision 32-true"),
    "bf16": ("bf16-mixed forced (the recipe before precision: auto)", "--trainer.precision bf16-mixed"),
    "numerics_float32": ("float32, Muon's iteration in float32 (a CPU without native bf16)", ""),
    "numerics_bf16": ("bf16-mixed, Muon's iteration in bf16 (a CPU with native bf16)", ""),
    "sdpa": ("SDPA attention instead of manual (CPU flash backward is slow in bf16)", "--model.attention sdpa"),
    "compile": ("torch.compile on", "--compile true"),
    "batch12": ("batch 12 instead of the recipe's", "--data.batch_size 12"),
    "batch64": ("batch 64", "--data.batch_size 64"),
    "ctx128": ("context 128 instead of 64", "--model.block_size 128"),
    "lr4e-3": ("peak learning rate 4e-3", "--optim.learning_rate 4e-3"),
    "wsd": ("warmup-stable-decay schedule", "--optim.lr_schedule wsd"),
    "llama": ("Llama block (RMSNorm, RoPE, SwiGLU)", "--model.arch llama"),
    "qk_norm": ("QK-norm on", "--model.qk_norm true"),
    "relu2": ("ReLU^2 MLP", "--model.mlp relu2"),
    "zero_init": ("zero-initialised output projections", "--model.zero_init_proj true"),
    "untied": ("untied output head", "--model.tie_embeddings false"),
    "muon": ("Muon for hidden matrices + AdamW for the rest", "--optim.optimizer muon"),
}
COLUMNS = [("variant", "variant", ""), ("seed", "seed", "d"), ("change", "change", "")]
COLUMNS += [("steps", "steps", "d"), ("ms_per_step", "ms/step", ".1f"), ("muon_dtype", "Muon's iteration", "")]


def train_child(numerics: str, argv: list[str]) -> None:
    """train.py's main with `numerics` everywhere, Muon's iteration included, then one line of what ran."""
    from minigpt.cli.train import main
    from minigpt.training.muon import Muon

    # Muon decides its iteration's dtype at the first step from the CPU it runs on: decide it here instead
    Muon.ns_dtype = torch.bfloat16 if numerics == "bf16" else torch.float32
    trainer = main([*argv, "--trainer.precision", NUMERICS[numerics]])
    muon = getattr(trainer.optimizers[0], "muon", None)
    ran = dict(precision=str(trainer.precision), steps=trainer.global_step)
    ran["muon_dtype"] = str(muon.ns_dtype).removeprefix("torch.") if muon is not None else None
    ran["full_val_loss"] = round(float(trainer.callback_metrics["full_val_loss"]), 4)
    print(RESULT + json.dumps(ran), flush=True)


def max_time(seconds: float) -> str:
    """Lightning's DD:HH:MM:SS, each field two digits (it refuses 00:00:00:114)."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"{days:02d}:{hours:02d}:{minutes:02d}:{secs:02d}"


def run_variant(name: str, seed: int | None, args: Any, work: Path) -> dict[str, Any]:
    out_dir = work / f"{name}-{seed}"
    if args.steps:
        stop = ["--trainer.max_time", "null", "--trainer.max_steps", str(args.steps)]
    else:
        stop = ["--trainer.max_time", max_time(args.budget), "--trainer.max_steps", "-1"]
    argv = ["--config", args.config, "--data.source", args.corpus, "--out_dir", str(out_dir), *stop]
    argv += [] if seed is None else ["--seed", str(seed)]
    argv += [] if args.val_every is None else ["--trainer.val_check_interval", str(args.val_every)]
    argv += "--trainer.enable_progress_bar false --sample_tokens 0 --checkpoint_every 1000000".split()
    argv += ["--overwrite", "true", *VARIANTS[name][1].split(), *args.extra]
    if name.startswith("numerics_"):
        runner = [sys.executable, __file__, "--child", name.removeprefix("numerics_")]
    else:
        runner = [sys.executable, str(common.REPO_ROOT / "train.py")]
    row: dict[str, Any] = dict(variant=name, seed=seed, change=VARIANTS[name][0])
    try:
        out = common.run_child([*runner, *argv]).stdout
    except SystemExit as e:  # one failed variant does not end the others
        return dict(row, error=str(e).splitlines()[-1])
    row["steps"] = int(re.search(r"after (\d+) steps", out).group(1))
    row["train_s"] = float(re.search(r"training time ([\d.]+)s", out).group(1))
    row["ms_per_step"] = round(1e3 * row["train_s"] / max(row["steps"], 1), 2)
    row["full_val_loss"] = float(re.search(r"full val loss ([\d.]+)", out).group(1))
    if bits := re.search(r"([\d.]+) bits/char", out):
        row["bits_per_char"] = float(bits.group(1))
    if ran := re.search(f"^{RESULT}(.*)$", out, re.MULTILINE):
        row["muon_dtype"] = json.loads(ran.group(1))["muon_dtype"]
    row["curve"] = [(step, loss) for _, step, loss in common.val_curve(out_dir)]
    # the first validation at the target (logged at the step it validated: after that many steps)
    hit = next((step for step, loss in row["curve"] if loss <= args.target), None)
    row["time_to_target_s"] = None if hit is None else round(hit * row["train_s"] / row["steps"], 1)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        train_child(argv[1], argv[2:])
        return {}
    p = common.parser(__doc__, "time_to_loss", device=False)  # train.py picks the device
    p.add_argument("--corpus", required=True, help="text file (or any --data.source) to train on")
    p.add_argument("--budget", type=common.positive_float, default=114.0, help="training seconds per run (default 114)")
    p.add_argument(
        "--steps", type=common.positive_int, default=None, help="train for this many steps instead of --budget"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[None], help="one run per seed (default: the config's)")
    p.add_argument("--target", type=float, default=1.88, help="val loss to reach (default 1.88)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--config", default=CONFIG)
    p.add_argument(
        "--val_every", type=common.positive_int, default=None, help="steps between validations (default: the config's)"
    )
    p.add_argument("--extra", action="append", default=[], metavar="--FLAG=VALUE", help="a train.py flag for every run")
    args = p.parse_args(argv)
    if args.quick:
        args.budget, args.variants = 3.0, args.variants[:1]
    # the children run in the repository's root: the user's paths from here (else from there, as the default config)
    args.corpus = common.user_path(args.corpus)
    args.config = args.config if args.config == CONFIG else common.user_path(args.config)
    if not (common.REPO_ROOT / args.config).is_file():
        p.error(f"--config {args.config}: no such file")
    config = yaml.safe_load((common.REPO_ROOT / args.config).read_text())
    accelerator = (config.get("trainer") or {}).get("accelerator", "auto")
    for flag in args.extra:  # --extra=--trainer.accelerator=cpu
        accelerator = flag.split("=", 1)[1] if flag.startswith("--trainer.accelerator=") else accelerator
    device = "cpu" if runs_on_cpu(accelerator) else "cuda" if torch.cuda.is_available() else "mps"  # train.py's
    label = common.start(args, device, "see variants")
    val_every = args.val_every or (config.get("trainer") or {}).get("val_check_interval")
    length = f"{args.steps} steps" if args.steps else f"{args.budget:.0f} s of training"
    print(f"Corpus {args.corpus}; {length} per run; target {args.target}; validation every {val_every} steps\n")
    losses = [("time_to_target_s", f"time to {args.target} (s)", ".1f"), ("full_val_loss", "full val loss", ".4f")]
    table = COLUMNS + losses + [("bits_per_char", "bits/char", ".4f")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="time_to_loss_") as tmp:
        # prepare the data once (cached in data/), so no run counts it
        prepare = [sys.executable, str(common.REPO_ROOT / "train.py"), "--config", args.config, *args.extra]
        prepare += ["--data.source", args.corpus, "--out_dir", str(Path(tmp) / "prep"), "--trainer.max_steps", "1"]
        common.run_child(prepare + "--eval_full false --trainer.enable_progress_bar false".split())
        for name in args.variants:
            for seed in args.seeds:
                rows.append(run_variant(name, seed, args, Path(tmp)))
                if "error" in rows[-1]:
                    print(f"{name} failed: {rows[-1]['error']}", flush=True)
                else:
                    common.print_row(rows[-1], table)
    common.print_table(rows, table)
    result = dict(benchmark="time_to_loss", machine=label, corpus=args.corpus, budget_s=args.budget, steps=args.steps)
    result |= dict(target=args.target, config=args.config, val_every=val_every, extra=args.extra, results=rows)
    finished = common.finish(result, args)
    if rows and all("error" in row for row in rows):
        raise SystemExit("every run failed; see the lines above")
    return finished


if __name__ == "__main__":
    main()
