"""Start-up time of the commands, next to `python -c "import torch"`, which every one of them pays.

    python benchmarks/bench_startup.py                  # median of 3 runs of each command
    python benchmarks/bench_startup.py --commands "train.py 20 steps"   # train.py's own start-up report too

The goal holds for the commands that do not train; train.py's rows (it imports Lightning) are timed, not graded.

Method and results: docs/performance.md#start-up.
"""

import re
import string
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks import common
from minigpt.configs import default_config
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.config import GPTConfig
from minigpt.core.model import GPT
from minigpt.core.tokenizers import CharTokenizer

GOAL_S = 1.5  # seconds a command may take beyond `import torch`
BASELINE = "import torch"
NEW_TOKENS = 50
COLUMNS = [("command", "command", ""), ("seconds", "seconds", ".2f"), ("over_torch_s", f"- {BASELINE} (s)", "+.2f")]
COLUMNS += [("ratio", f"x {BASELINE}", ".2f"), ("goal", f"within {GOAL_S} s", "")]
COLUMNS += [("first_step_s", "train.py: first step (s)", ".1f"), ("imports_s", "of which imports (s)", ".1f")]
TRAIN_STEPS = [*common.TRAIN_20_STEPS, "--overwrite", "true", "--out_dir", "train"]  # data: prepared in warm-up


def make_checkpoint(folder: Path) -> Path:
    """The default config's shape, random weights (generation costs the same whatever they are), printable chars."""
    torch.manual_seed(1337)
    tokenizer = CharTokenizer(string.printable)
    shape = yaml.safe_load(default_config().read_text())["model"]
    model = GPT(GPTConfig(**shape, vocab_size=tokenizer.vocab_size)).eval()
    save_file(model_checkpoint(model, tokenizer), folder / "startup.ckpt")
    return folder / "startup.ckpt"


def commands(ckpt: Path | str, device: str) -> dict[str, list[str] | None]:
    """name -> argv (None: not available here)."""
    py = sys.executable
    # the baseline skips the exit's collector passes as every command does (run_cli's gc.freeze): ~0.45 s here
    cases: dict[str, list[str] | None] = {BASELINE: [py, "-c", "import gc; gc.disable(); import torch; gc.freeze()"]}
    here = f"import sys; sys.path.insert(0, {str(common.REPO_ROOT)!r}); "  # this checkout's, not an installed one
    cases["from minigpt import load_model"] = [
        py,
        "-c",
        here + "import gc; gc.disable(); from minigpt import load_model; gc.freeze()",
    ]
    for name in ("sample", "eval", "export", "attention"):
        cases[f"{name}.py --help"] = [py, str(common.REPO_ROOT / f"{name}.py"), "--help"]
    # the installed `minigpt` beside this interpreter (not a version manager's shim, which adds its own start-up):
    # the installed package's start-up, whichever checkout that is
    script = Path(sys.executable).parent / "minigpt"
    cases["minigpt sample --help (installed)"] = [str(script), "sample", "--help"] if script.is_file() else None
    sample = ["--ckpt", str(ckpt), "--device", device, "--max_new_tokens", str(NEW_TOKENS), "--prompt", "def "]
    cases[f"sample.py {NEW_TOKENS} tokens"] = [py, str(common.REPO_ROOT / "sample.py"), *sample]
    cases["train.py --help"] = [py, str(common.REPO_ROOT / "train.py"), "--help"]
    cases["train.py 20 steps"] = [py, str(common.REPO_ROOT / "train.py"), *TRAIN_STEPS]  # the default config
    return cases


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__, "startup")
    p.add_argument("--ckpt", default=None, help="checkpoint for the generation (default: a random-weight model)")
    p.add_argument(
        "--repeats",
        type=common.positive_int,
        default=3,
        help="runs of each command; the median is reported (default 3)",
    )
    p.add_argument(
        "--warmup", type=common.non_negative_int, default=1, help="untimed rounds first (default 1; --quick: 0)"
    )
    p.add_argument("--commands", default=None, help=f"comma-separated names to time (default all; {BASELINE!r} too)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup = 1, 0
    device = common.pick_device(args.device)
    label = common.start(args, device)
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        work = Path(tmp)
        ckpt = common.user_path(args.ckpt) if args.ckpt else make_checkpoint(work)  # the children run in `work`
        cases = commands(ckpt, str(device))
        if args.commands:
            wanted = {BASELINE} | {name.strip() for name in args.commands.split(",")}
            if unknown := wanted - set(cases):
                p.error(f"unknown --commands {sorted(unknown)}; choose from {list(cases)}")
            cases = {name: argv for name, argv in cases.items() if name in wanted}
        times: dict[str, list[float]] = {name: [] for name, argv in cases.items() if argv is not None}
        reports: dict[str, list[tuple[float, float]]] = {name: [] for name in times}
        for round_ in range(args.warmup + args.repeats):
            for name in times:
                t0 = time.perf_counter()
                ran = common.run_child(cases[name], cwd=work)  # a folder with no out/ and no configs/
                if round_ >= args.warmup:
                    times[name].append(round(time.perf_counter() - t0, 4))
                    if report := common.first_step_report(ran.stdout + ran.stderr):  # train.py's: s, imports s
                        reports[name].append((float(report[1]), float(re.search(r"imports ([\d.]+)s", report[2])[1])))

    base = common.median(times[BASELINE])
    rows = [dict(command=name, goal="not installed (pip install -e .)") for name in cases if name not in times]
    for name, runs in times.items():
        row = dict(command=name, seconds=round(common.median(runs), 3), runs=runs)
        if reports[name]:  # medians of train.py's own figures: launch to first optimizer step, and its imports
            first_step, imports = (list(column) for column in zip(*reports[name]))
            row |= dict(first_step_s=common.median(first_step), imports_s=common.median(imports))
            row |= dict(first_step_runs=first_step, imports_runs=imports)
        if name.startswith("train.py"):
            row |= dict(over_torch_s=round(common.median(runs) - base, 3), goal="(not graded)")
        elif name != BASELINE:
            extra = common.median(runs) - base
            row |= dict(over_torch_s=round(extra, 3), ratio=round(row["seconds"] / base, 2), goal_met=extra <= GOAL_S)
            row["goal"] = "PASS" if extra <= GOAL_S else "FAIL"
        rows.append(row)
    met = [r["goal_met"] for r in rows if "goal_met" in r]
    passed, score = all(met), f"{sum(met)} of {len(met)}"
    print(f"Python {sys.executable}; median of {args.repeats} run(s) after {args.warmup} warm-up round(s)")
    common.print_table(rows, COLUMNS)
    print(f"\nGoal: every command within {GOAL_S} s of `{BASELINE}`: {'PASS' if passed else 'FAIL'} ({score})")
    settings = dict(repeats=args.repeats, warmup=args.warmup, goal_s=GOAL_S, new_tokens=NEW_TOKENS, ckpt=args.ckpt)
    result = dict(benchmark="startup", machine=label, settings=settings, baseline_s=round(base, 3), passed=passed)
    return common.finish(result | dict(results=rows), args)


if __name__ == "__main__":
    main()
