"""bf16 numerics vs float32: the CPU recipe for fixed steps, in float32 and as a native-bf16 CPU computes it.

    python benchmarks/bf16_numerics.py --corpus ../shared/data/tinyshakespeare.txt --steps 1000 --seeds 1337 1

On a CPU with native bf16 (AVX512_BF16/AMX) `precision: auto` trains the recipe in bf16-mixed and Muon runs its
Newton-Schulz iteration in bf16; without it, both are float32.  A time-to-loss figure mixes two things, the steps a
budget buys and the loss each step reaches; this script isolates the second, on any CPU: each seed trains the
recipe twice for --steps steps (`--trainer.max_time null --trainer.max_steps N`, so the learning-rate schedule is
the same), once in float32 (32-true, Muon's iteration in float32) and once with a native-bf16 CPU's numerics
(bf16-mixed, Muon's iteration in bf16), and prints train.py's full-split val loss of each.  Only the numbers
matter here, not the speed: on a CPU without native bf16 the bf16 run emulates bf16 and is ~20x slower a step.
"""

from __future__ import annotations

import json
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
    machine_label,
    markdown_table,
    write_json,
)

CONFIG = "configs/shakespeare_char_cpu.yaml"
NUMERICS = {"float32": "32-true", "bf16": "bf16-mixed"}  # name -> the run's precision
RESULT = "bf16_numerics result: "


def train_child(numerics: str, argv: list[str]) -> None:
    """Run train.py's main with `numerics` everywhere, Muon's iteration included, and print what ran."""
    import minigpt.training.optim
    from minigpt.cli.train import main

    # Muon picks its iteration's dtype from has_native_bf16(device): decide it here, as the other kind of CPU would
    minigpt.training.optim.has_native_bf16 = lambda device: numerics == "bf16"
    trainer = main([*argv, "--trainer.precision", NUMERICS[numerics]])
    optimizer = trainer.optimizers[0]
    muon = getattr(optimizer, "muon", None)
    print(
        RESULT
        + json.dumps(
            dict(
                numerics=numerics,
                precision=str(trainer.precision),
                steps=trainer.global_step,
                muon_dtype=str(muon.ns_dtype).removeprefix("torch.") if muon is not None else None,
                full_val_loss=round(float(trainer.callback_metrics["full_val_loss"]), 4),
            )
        ),
        flush=True,
    )


def run(numerics: str, seed: int, args: Any, work: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        numerics,
        "--config",
        args.config,
        "--data.source",
        args.corpus,
        "--seed",
        str(seed),
        "--trainer.max_time",
        "null",
        "--trainer.max_steps",
        str(args.steps),
        "--trainer.enable_progress_bar",
        "false",
        "--sample_tokens",
        "0",
        "--checkpoint_every",
        "1000000",
        "--out_dir",
        str(work / f"{numerics}-{seed}"),
        "--overwrite",
        "true",
        *args.extra,
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    found = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        raise SystemExit(f"the {numerics} run (seed {seed}) failed: {tail[0] if tail else f'exit {proc.returncode}'}")
    return dict(seed=seed, **json.loads(found[-1].removeprefix(RESULT)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        train_child(argv[1], argv[2:])
        return {}
    p = common_parser(__doc__.splitlines()[0], "bf16_numerics")
    p.add_argument("--corpus", required=True, help="text file (or any --data.source) to train on")
    p.add_argument("--steps", type=int, default=1000, help="training steps per run (default 1000)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1337])
    p.add_argument("--config", default=CONFIG)
    p.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="--FLAG=VALUE",
        help="a train.py flag added to every run, written with '=' (repeat for several)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.extra = 2, args.seeds[:1], [*args.extra, "--compile=false"]

    label = machine_label("cpu", "float32 and bf16-mixed")
    print(describe_machine(label), flush=True)
    print(f"Corpus {args.corpus}; {args.steps} steps per run; seeds {args.seeds}\n", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bf16_numerics_") as tmp:
        for seed in args.seeds:
            fp32, bf16 = (run(numerics, seed, args, Path(tmp)) for numerics in NUMERICS)
            row = dict(
                seed=seed,
                steps=fp32["steps"],
                float32=fp32["full_val_loss"],
                bf16=bf16["full_val_loss"],
                difference=round(bf16["full_val_loss"] - fp32["full_val_loss"], 4),
                muon_dtypes=f"{fp32['muon_dtype']} / {bf16['muon_dtype']}",
            )
            print(
                f"  seed {seed}: float32 {row['float32']:.4f}, bf16 {row['bf16']:.4f} after {row['steps']} steps "
                f"(Muon's iteration in {row['muon_dtypes']})",
                flush=True,
            )
            rows.append(row)
    print()
    print(
        markdown_table(
            rows,
            [
                ("seed", "seed", "d"),
                ("steps", "steps", "d"),
                ("float32", "full val loss, float32", ".4f"),
                ("bf16", "full val loss, bf16 numerics", ".4f"),
                ("difference", "bf16 - float32", "+.4f"),
                ("muon_dtypes", "Muon's iteration", ""),
            ],
        )
    )
    result = dict(
        benchmark="bf16_numerics",
        machine=label,
        corpus=args.corpus,
        steps=args.steps,
        config=args.config,
        extra=args.extra,
        results=rows,
    )
    print(f"\nwrote {write_json(result, args.json)}")
    return result


if __name__ == "__main__":
    main()
