"""Start-up where the Python environment keeps no compiled modules, with minigpt's bytecode cache off and on.

    python benchmarks/bench_bytecode.py               # train.py's imports 3 ways, then 20-step runs off and on

Such an environment (installed without .pyc files, run with PYTHONDONTWRITEBYTECODE=1: many container images, and
the GPU image docs/time_to_loss.md measures on) is emulated on any machine: `python -S` over a copy of this
interpreter's site folders made of links to each file but the `__pycache__` folders, with a cache folder of its own
(XDG_CACHE_HOME). First train.py's imports alone in three launches (the cache off, its first launch, the next; a
fourth, as the next under `-X importtime`, says where the time goes), then a 20-step train.py (the default config),
the cache off and on in turn, each launch to exit with its own report of the first optimizer step. Method and
results: docs/performance.md#start-up.
"""

import os
import site
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks import common
from benchmarks.bench_gpu import bytecode_launches

COLUMNS = common.columns("run:run:, launch_to_exit_s:launch to exit (s):.2f, first_step:train.py's own report:")


def site_without_bytecode(folder: Path) -> Path:
    """Links to every file of this interpreter's site folders but their compiled modules."""
    for root in [Path(d) for d in site.getsitepackages() + [site.getusersitepackages()] if Path(d).is_dir()]:
        for here, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            target = folder / Path(here).relative_to(root)
            target.mkdir(parents=True, exist_ok=True)
            for name in files:
                if not name.endswith(".pyc") and not (target / name).exists():
                    (target / name).symlink_to(Path(here) / name)
    return folder


def train_run(python: list[str], env: dict[str, str], work: Path, name: str) -> dict:
    cmd = python + [str(common.REPO_ROOT / "train.py"), *common.TRAIN_20_STEPS, "--out_dir", str(work / name)]
    start = time.perf_counter()
    got = common.run_child(cmd + ["--data.data_root", str(work / "data")], cwd=work, env=env)
    report = common.first_step_report(got.stdout + got.stderr)
    first_step = report[0].removeprefix("first optimizer step ") if report else "-"
    return dict(run=name, launch_to_exit_s=round(time.perf_counter() - start, 2), first_step=first_step)


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__, "bytecode", device=False)  # train.py picks the device
    p.add_argument(
        "--rounds", type=common.non_negative_int, default=2, help="20-step runs each way, alternated (default 2)"
    )
    args = p.parse_args(argv)
    label = common.start(args, common.pick_device())  # where its train.py runs train
    with tempfile.TemporaryDirectory(prefix="bench_bytecode_") as tmp:
        work = Path(tmp)
        made = time.perf_counter()
        emulated = site_without_bytecode(work / "site")
        print(f"site folders linked without their bytecode in {time.perf_counter() - made:.1f} s", flush=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "MINIGPT_BYTECODE_CACHE")}
        env |= dict(PYTHONDONTWRITEBYTECODE="1", XDG_CACHE_HOME=str(work / "cache"), PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(common.REPO_ROOT), str(emulated)])
        python = [sys.executable, "-S"]
        launches = bytecode_launches(python, env)
        rows = [
            dict(run=f"imports, {k}", launch_to_exit_s=v["launch_to_exit_s"])
            for k, v in launches.items()
            if k != "environment"
        ]
        for round_ in range(args.rounds if not args.quick else 0):
            for mode in ("cache off", "cache on"):
                run_env = dict(env, MINIGPT_BYTECODE_CACHE="0") if mode == "cache off" else env
                rows.append(train_run(python, run_env, work, f"train.py 20 steps, {mode}, round {round_ + 1}"))
                common.print_row(rows[-1], COLUMNS)
    common.print_table(rows, COLUMNS, title="Imports compiled from source at each launch, against minigpt's cache")
    return common.finish(dict(benchmark="bytecode", machine=label, launches=launches, rows=rows), args)


if __name__ == "__main__":
    main()
