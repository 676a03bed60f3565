"""Start-up time of the commands, next to `python -c "import torch"`, which every one of them pays.

    python benchmarks/bench_startup.py                  # median of 3 runs of each command
    python benchmarks/bench_startup.py --ckpt out/RUN   # the generation from a trained checkpoint
    python benchmarks/bench_startup.py --quick          # one run of each (smoke test)

Wall time of fresh interpreters: `import torch`, `import minigpt`, `X.py --help` for sample, eval, export and
attention, `minigpt sample --help` (the installed console script), and sample.py generating 50 tokens from a
checkpoint (--ckpt, else a random-weight model of configs/default.yaml's shape with a char tokenizer, made in a
temporary folder).  The runs go round-robin (every command once, then again), so a change in the machine's load
touches all of them alike.  Goal: every command within GOAL_S seconds of `import torch`.  Prints a markdown table
and writes the same figures as JSON (default benchmarks/results/startup.json).
"""

from __future__ import annotations

import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks.common import (
    REPO_ROOT,
    common_parser,
    describe_machine,
    load_avg,
    machine_label,
    markdown_table,
    median,
    pick_device,
    wait_for_quiet,
    write_json,
)
from minigpt.configs import default_config
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.config import GPTConfig
from minigpt.core.model import GPT
from minigpt.core.tokenizers import CharTokenizer

GOAL_S = 1.5  # seconds a command may take beyond `import torch`
BASELINE = "import torch"
NEW_TOKENS = 50
PROMPT = "def "


def console_script() -> Path | None:
    """The installed `minigpt` next to this interpreter (not a version manager's shim, which adds its own
    start-up); None when minigpt is not installed (`pip install -e .`)."""
    script = Path(sys.executable).parent / "minigpt"
    return script if script.is_file() else None


def make_checkpoint(folder: Path, seed: int) -> Path:
    """A random-weight model of the default config's shape, saved with a char tokenizer of printable ASCII:
    generation costs the same per token whatever the weights."""
    torch.manual_seed(seed)
    tokenizer = CharTokenizer(string.printable)
    shape = yaml.safe_load(default_config().read_text())["model"]
    model = GPT(GPTConfig(**shape, vocab_size=tokenizer.vocab_size)).eval()
    path = folder / "startup.ckpt"
    save_file(model_checkpoint(model, tokenizer), path)
    return path


def commands(ckpt: Path, device: str) -> dict[str, list[str] | None]:
    """name -> argv (None: not available here)."""
    py = sys.executable
    script = console_script()
    cases: dict[str, list[str] | None] = {
        BASELINE: [py, "-c", "import torch"],
        "import minigpt": [py, "-c", "import minigpt"],
    }
    for name in ("sample", "eval", "export", "attention"):
        cases[f"{name}.py --help"] = [py, str(REPO_ROOT / f"{name}.py"), "--help"]
    cases["minigpt sample --help"] = [str(script), "sample", "--help"] if script else None
    cases[f"sample.py {NEW_TOKENS} tokens"] = [
        py,
        str(REPO_ROOT / "sample.py"),
        "--ckpt",
        str(ckpt),
        "--device",
        device,
        "--max_new_tokens",
        str(NEW_TOKENS),
        "--prompt",
        PROMPT,
    ]
    return cases


def wall_time(argv: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    ran = subprocess.run(argv, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if ran.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {ran.returncode}: {ran.stderr.strip()[-2000:]}")
    return seconds


def main(argv: list[str] | None = None) -> dict:
    p = common_parser(__doc__.splitlines()[0], "startup")
    p.add_argument(
        "--ckpt",
        default=None,
        help="checkpoint for the generation (default: a random-weight model of "
        "the default config's shape, made in a temporary folder)",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs of each command; the median is reported (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1; --quick: 0)")
    p.add_argument(
        "--commands",
        default=None,
        help=f"comma-separated names of the commands to time (default all; {BASELINE!r} is always timed)",
    )
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup = 1, 0
    device = pick_device(args.device)

    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        work = Path(tmp)
        ckpt = Path(args.ckpt) if args.ckpt else make_checkpoint(work, args.seed)
        cases = commands(ckpt, str(device))
        if args.commands:
            wanted = {BASELINE} | {name.strip() for name in args.commands.split(",")}
            unknown = wanted - set(cases)
            if unknown:
                p.error(f"unknown --commands {sorted(unknown)}; choose from {list(cases)}")
            cases = {name: argv for name, argv in cases.items() if name in wanted}
        runnable = {name: argv for name, argv in cases.items() if argv is not None}

        load_readings = wait_for_quiet(tries=args.wait_quiet)
        label = machine_label(device, "float32")
        times: dict[str, list[float]] = {name: [] for name in runnable}
        for round_ in range(args.warmup + args.repeats):
            for name, command in runnable.items():
                seconds = wall_time(command, work)  # cwd: a folder with no out/ and no configs/
                if round_ >= args.warmup:
                    times[name].append(round(seconds, 4))

    base = median(times[BASELINE])
    rows = []
    for name in cases:
        if name not in runnable:
            rows.append(dict(command=name, note="not installed (pip install -e .)"))
            continue
        seconds = median(times[name])
        row = dict(command=name, seconds=round(seconds, 3), runs=times[name])
        if name != BASELINE:
            extra = seconds - base
            row.update(
                over_torch_s=round(extra, 3),
                ratio=round(seconds / base, 2),
                goal_met=extra <= GOAL_S,
                goal="PASS" if extra <= GOAL_S else "FAIL",
            )
        rows.append(row)
    judged = [r for r in rows if "goal_met" in r]
    passed = all(r["goal_met"] for r in judged)

    print(describe_machine(label))
    print(
        f"Python {sys.executable}; median of {args.repeats} run(s) per command after {args.warmup} warm-up "
        f"round(s); generation: {NEW_TOKENS} tokens from {PROMPT!r}, "
        f"{'--ckpt ' + str(args.ckpt) if args.ckpt else 'random weights, default config shape'}\n"
    )
    for r in rows:
        if "seconds" not in r:
            print(f"{r['command']:<28} {r['note']}")
        elif r["command"] == BASELINE:
            print(f"{r['command']:<28} {r['seconds']:6.2f} s")
        else:
            print(
                f"{r['command']:<28} {r['seconds']:6.2f} s   {r['over_torch_s']:+.2f} s, x{r['ratio']:.2f} "
                f"of {BASELINE}   {r['goal']}"
            )
    print(
        f"\nGoal: every command within {GOAL_S} s of `{BASELINE}`: "
        f"{'PASS' if passed else 'FAIL'} ({sum(r['goal_met'] for r in judged)} of {len(judged)})\n"
    )
    print(
        markdown_table(
            rows,
            [
                ("command", "command", ""),
                ("seconds", "seconds", ".2f"),
                ("over_torch_s", f"- {BASELINE} (s)", "+.2f"),
                ("ratio", f"x {BASELINE}", ".2f"),
                ("goal", f"within {GOAL_S} s", ""),
            ],
        )
    )
    result = dict(
        benchmark="startup",
        machine=label,
        load_avg_1m_before=load_readings,
        load_avg_1m_after=load_avg(),
        settings=dict(
            repeats=args.repeats,
            warmup=args.warmup,
            goal_s=GOAL_S,
            new_tokens=NEW_TOKENS,
            prompt=PROMPT,
            ckpt=args.ckpt,
            python=sys.executable,
        ),
        baseline_s=round(base, 3),
        passed=passed,
        results=rows,
    )
    print(f"\nwrote {write_json(result, args.json)}")
    return result


if __name__ == "__main__":
    main()
