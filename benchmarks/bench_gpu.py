"""On one GPU: minigpt against nanoGPT from launch to loss, and the training step on the GPT-2 124M shape.

    python benchmarks/bench_gpu.py --nanogpt PATH/TO/nanoGPT --corpus tinyshakespeare.txt --out results.json

Parts (--parts: bytecode, recipe, cold, variants, long, imports, nanogpt, throughput, overhead), method and results:
docs/time_to_loss.md#on-one-gpu-launch-to-loss-against-nanogpt.
"""

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import re
import shutil
import site
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import get_args

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from anywhere without installing

from benchmarks import common  # torch: in the children only (see machine)

PARTS = ("bytecode", "recipe", "cold", "variants", "long", "imports", "nanogpt", "throughput", "overhead")
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16 FLOP/s, the vendors' datasheets


def machine(device: str) -> tuple[str, str, str]:
    """(the device's name, torch's version, the CPU capability) for the report.  On a GPU without importing torch:
    this process only launches the runs, and the import took ~4 s of each of the GPU session's ~11 launches of
    this script on the H200, CUDA's start more (and GPU memory the runs need).  The capability of the host's CPU is
    then that of bytecode's probe, which imports torch anyway."""
    if device == "cpu":
        import torch

        return "cpu", torch.__version__, torch.backends.cpu.get_cpu_capability()
    from importlib.metadata import version

    try:  # CUDA's device 0: the first of CUDA_VISIBLE_DEVICES where it is set
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", first]
        name = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        name = ""
    if not name:  # no nvidia-smi: ask torch, and refuse where there is no GPU (CPU figures labelled as a GPU's)
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no GPU here (nvidia-smi and torch.cuda find none); run with --device cpu for a dry run")
        name = torch.cuda.get_device_name(0)
    return name, version("torch"), "see bytecode's probe"


def run_timed(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[list[tuple[float, str]], int]:
    """Runs cmd, killed after `timeout` seconds (printing or not); returns its output lines, each with the seconds since
    launch at which it arrived, and the exit code."""
    start = time.perf_counter()
    out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, **out)
    deadline = threading.Timer(timeout, proc.kill)  # a child that hangs silently is killed too
    deadline.start()
    lines = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            for part in line.replace("\r", "\n").splitlines():  # progress bars redraw with \r
                if part.strip():
                    lines.append((time.perf_counter() - start, part.rstrip()))
    finally:
        deadline.cancel()
    return lines, proc.wait()


def fresh_env(cache: Path) -> dict[str, str]:
    """The environment with its own compile caches (cold on first use) and unbuffered output."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"))
    env["TRITON_CACHE_DIR"] = str(cache / "triton")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def hidden_site(packages: list[str], work: Path) -> Path:
    """A site folder of links to every installed package but `packages`: with `python -S` and this folder on
    PYTHONPATH, a command runs as on a fresh install that lacks them (what Lightning's import pulls in varies)."""
    hidden = {name.lower().replace("-", "_") for name in packages}
    folder = work / ("site_without_" + "_".join(sorted(hidden)))
    folder.mkdir(exist_ok=True)
    for root in [Path(d) for d in site.getsitepackages() + [site.getusersitepackages()] if Path(d).is_dir()]:
        for entry in root.iterdir():  # a package's folder, its .libs, its NAME-VERSION.dist-info
            name = re.split(r"[-.]", entry.name.lower())[0]
            if name not in hidden and entry.name != "__pycache__" and not (folder / entry.name).exists():
                (folder / entry.name).symlink_to(entry)
    return folder


def minigpt_python(args, cache: Path, work: Path) -> tuple[list[str], dict[str, str]]:
    """The interpreter command and environment of minigpt's runs (--without: `python -S` and hidden_site's links)."""
    python, env = [sys.executable], fresh_env(cache)
    if args.without:
        python.append("-S")
        env["PYTHONPATH"] += os.pathsep + str(hidden_site(args.without.split(","), work))
    return python, env


BYTECODE_PROBE = """import gc, json, sys, time
gc.disable()  # as train.py imports (minigpt.cli.main.run_command)
start = time.perf_counter()
import minigpt.cli.train
from minigpt.core import bytecode_cache
imports_s = time.perf_counter() - start
import torch  # imported above: the host CPU's label for the report
folder = bytecode_cache.cache_folder()
pyc_files = sum(1 for _ in folder.rglob("*.pyc")) if folder.is_dir() else 0
print(json.dumps({"imports_s": round(imports_s, 2), "pycache_prefix": sys.pycache_prefix, "pyc_files": pyc_files,
                  "torch_cached_here": bytecode_cache.bytecode_cached("torch"),
                  "cpu_capability": torch.backends.cpu.get_cpu_capability()}))
"""


def bytecode_launches(python: list[str], env: dict[str, str]) -> dict:
    """train.py's imports in three launches, each timed from launch to exit by this process (and its imports alone
    by the child's clock), the garbage collector paused as train.py pauses it: with minigpt's bytecode cache off
    (the environment as it is), then on: the first launch (writes the cache where the environment keeps no compiled
    modules) and the next (reads it). A fourth launch, as the next under `-X importtime`, says where their time goes
    (common.import_breakdown), whatever the cache did."""
    rows = {"environment": {k: v for k, v in env.items() if k.startswith("PYTHON") and k != "PYTHONPATH"}}
    for launch in ("cache off", "first launch", "next launch", "next, -X importtime"):
        launch_env = dict(env, MINIGPT_BYTECODE_CACHE="0") if launch == "cache off" else env
        flags = ["-X", "importtime"] if "importtime" in launch else []
        start = time.perf_counter()
        cmd = python + flags + ["-c", BYTECODE_PROBE]
        got = subprocess.run(cmd, cwd=REPO, env=launch_env, capture_output=True, text=True)
        row = {"launch_to_exit_s": round(time.perf_counter() - start, 2), "rc": got.returncode}
        row |= json.loads(got.stdout.splitlines()[-1]) if got.returncode == 0 else {"tail": got.stderr[-2000:]}
        if flags and got.returncode == 0:
            row["breakdown"] = common.import_breakdown(got.stderr)
        rows[launch] = row
        print(launch, json.dumps(row), flush=True)
    return rows


def first(lines: list[tuple[float, str]], pattern: str) -> tuple[float, re.Match] | None:
    return next(((t, m) for t, line in lines if (m := re.search(pattern, line))), None)


def minigpt_run(args, name: str, overrides: list[str], cache: Path, work: Path) -> dict:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)  # a --work kept from an earlier invocation: this run starts afresh
    cmd = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/shakespeare_char_gpu.yaml")]
    cmd += ["--data.source", str(args.corpus), "--data.data_root", str(work / "data"), "--out_dir", str(out)]
    if args.tiny:
        cmd += ["--model.n_layer", "1", "--model.n_embd", "48", "--model.n_head", "2", "--data.batch_size", "4"]
        cmd += ["--trainer.max_time", "null", "--trainer.max_steps", "30", "--trainer.val_check_interval", "10"]
        cmd += ["--compile", "false", "--data.val_batches", "2", "--data.val_batch_size", "4"]
    if args.device == "cpu":
        cmd += ["--trainer.accelerator", "cpu"]
    python, env = minigpt_python(args, cache, work)
    settings = [o for o in overrides if re.fullmatch(r"[A-Z][A-Z0-9_]*=.*", o)]  # NAME=VALUE: the environment's
    env |= dict(setting.split("=", 1) for setting in settings)
    flags = [o for o in overrides if o not in settings]
    launched = time.time()  # TensorBoard's wall times of the val losses are counted from here
    lines, rc = run_timed(python + cmd[1:] + args.extra.split() + flags, REPO, env, args.timeout)
    (work / f"{name}.log").write_text("\n".join(f"{t:8.2f} {line}" for t, line in lines))
    row: dict = {"name": name, "overrides": " ".join(overrides), "rc": rc, "wall_s": lines[-1][0] if lines else None}
    if hit := first(lines, common.FIRST_STEP):
        row["first_step_s"], row["first_step_seen_s"], row["startup"] = float(hit[1][1]), hit[0], hit[1][2]
    if hit := first(lines, r"full val loss ([\d.]+)"):
        row["full_val"], row["full_val_at_s"] = float(hit[1][1]), hit[0]
    if hit := first(lines, r"full val loss of \S+ \(step (\d+)\): ([\d.]+)"):  # a run that ended above its best
        row["best_full_val"], row["best_step"], row["best_full_val_at_s"] = float(hit[1][2]), int(hit[1][1]), hit[0]
    if hit := first(lines, r"(?:torch.compile: compiled|CUDA graphs: recorded the training step) in ([\d.]+)s"):
        row["compile_s"] = float(hit[1][1])
    if hit := first(lines, r"\S.*; training without compiling"):  # a compile mode that fell back (a warning)
        row["not_compiled"] = hit[1][0]
    steps = [int(m[1]) for _, line in lines if (m := re.search(r"after (\d+) steps", line))]
    row["steps"] = steps[0] if steps else None
    row["curve"] = [(round(t - launched, 2), step, round(loss, 4)) for t, step, loss in common.val_curve(out)]
    if rc != 0:
        row["tail"] = [line for _, line in lines[-8:]]
    return row


def nanogpt_run(args, work: Path) -> dict:
    nano = args.nanogpt.resolve()
    data = nano / "data/shakespeare_char"
    if not (data / "input.txt").is_file():
        (data / "input.txt").write_bytes(args.corpus.read_bytes())
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", f"--max_iters={args.nanogpt_iters}"]
    cmd += [f"--out_dir={work / 'nanogpt_out'}"]
    if args.device == "cpu":
        cmd += ["--device=cpu", "--compile=False", "--dtype=float32"]
    if args.tiny:
        cmd += ["--n_layer=1", "--n_embd=48", "--n_head=2", "--batch_size=4", "--eval_iters=2", "--eval_interval=10"]
    lines, rc = run_timed(cmd, nano, fresh_env(work / "cache_nanogpt"), args.timeout)
    (work / "nanogpt.log").write_text("\n".join(f"{t:8.2f} {line}" for t, line in lines))
    evals = [(t, re.search(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", line)) for t, line in lines]
    curve = [(round(t, 2), int(m[1]), float(m[2])) for t, m in evals if m]
    row = {"name": "nanogpt", "rc": rc, "curve": curve, "wall_s": lines[-1][0] if lines else None}
    if hit := first(lines, r"iter 0: loss"):
        row["first_step_seen_s"] = hit[0]
    steps = [(int(m[1]), float(m[2])) for _, line in lines if (m := re.search(r"iter (\d+): .*time ([\d.]+)ms", line))]
    later = [ms for i, ms in steps if i >= 100 and i % 250 != 0]  # past compile, off the eval steps
    row["ms_per_step"] = round(sorted(later)[len(later) // 2], 2) if later else None
    if rc != 0:
        row["tail"] = [line for _, line in lines[-8:]]
    return row


def throughput_child(args) -> None:
    """In a fresh process: minigpt's training step on the 124M shape through Lightning's Trainer.  args.child:
    regions or whole, then +MODE (a --compile_mode) and/or +BACKEND (an SDPA kernel), e.g. whole+cudnn."""
    import lightning as L
    import torch

    from minigpt.core.config import SDPA_BACKENDS, GPTConfig
    from minigpt.training.callbacks import CompileMode, CompileModel
    from minigpt.training.lightning_module import GPTLightningModule
    from minigpt.training.optim import OptimConfig

    B, T, steps, warm = (2, 64, 6, 2) if args.tiny else (12, 1024, 30, 10)
    shape = dict(n_layer=2, n_head=2, n_embd=64) if args.tiny else dict(n_layer=12, n_head=12, n_embd=768)
    kind, *options = args.child.split("+")
    sdpa = next((o for o in options if o in SDPA_BACKENDS), None)
    mode = next((o for o in options if o != sdpa), "default")
    assert kind in ("regions", "whole") and mode in get_args(CompileMode), f"unknown compile kind {args.child}"
    config = GPTConfig(arch="gpt", block_size=T, vocab_size=50304, dropout=0.0, bias=False, sdpa_backend=sdpa, **shape)
    module = GPTLightningModule(config, OptimConfig(learning_rate=1e-4, weight_decay=1e-2, warmup_steps=1))
    batch = torch.randint(50304, (B, T + 1), generator=torch.Generator().manual_seed(1337))
    times: list[float] = []

    def stamp(trainer: L.Trainer, *_) -> None:
        if trainer.global_step in (warm, steps):
            common.synchronize(args.device)
            times.append(time.perf_counter())

    loader = torch.utils.data.DataLoader([batch] * (steps + 1), batch_size=None, pin_memory=args.device == "cuda")
    clock = L.pytorch.callbacks.LambdaCallback(on_train_batch_end=stamp)
    callbacks = [clock] + ([CompileModel(B, regions=kind == "regions", mode=mode)] if args.device == "cuda" else [])
    trainer = L.Trainer(
        accelerator=args.device, devices=1, precision="bf16-mixed" if args.device == "cuda" else "32-true",
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, gradient_clip_val=1.0, callbacks=callbacks, num_sanity_val_steps=0,
        limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    ms = (times[1] - times[0]) / (steps - warm) * 1000
    tokens_s = B * T / ms * 1000
    flops = module.model.flops_per_token(T)  # the same shape as bench.py's: its MFU is counted with this too
    print(json.dumps({"ms_per_iter": round(ms, 2), "tokens_per_s": round(tokens_s), "flops_per_token": flops}))


def overhead_child(args) -> None:
    """In a fresh process: ms per step of the GPU recipe's model per OPTIMIZER:LOOP:COMPILE run (see the docs);
    COMPILE: eager, regions or whole, +MODE (a --compile_mode, through CompileModel: the Trainer loops only)."""
    import numpy as np
    import torch
    import yaml
    from lightning.pytorch.callbacks import LambdaCallback

    from minigpt.core.config import GPTConfig
    from minigpt.training.callbacks import CompileModel, compile_regions
    from minigpt.training.datamodule import RandomWindows
    from minigpt.training.lightning_module import GPTLightningModule
    from minigpt.training.optim import OptimConfig
    from minigpt.training.sft import split_batch
    from minigpt.training.trainer import MiniGPTTrainer, run_callbacks

    recipe = yaml.safe_load((REPO / "configs/shakespeare_char_gpu.yaml").read_text())
    model, B = dict(recipe["model"], vocab_size=65), recipe["data"]["batch_size"]
    if args.tiny:
        model, B = model | dict(n_embd=32, n_head=2, block_size=16), 2
    warm, n = (3, 13) if args.tiny else (15, 165)
    tokens = np.random.default_rng(0).integers(0, 65, size=1 << 20, dtype=np.uint16)
    windows = RandomWindows(tokens, model["block_size"], B, seed=0, stream=0, length=n)
    loader = torch.utils.data.DataLoader(windows, batch_size=None, sampler=range(n), pin_memory=args.device == "cuda")

    def timed(run: str, profiler: "Profilers | None") -> float:
        """ms per step of one OPTIMIZER:LOOP:COMPILE run, synchronized at the timed steps' ends only."""
        optimizer, loop, compiled = run.split(":")
        optimizer, _, graph = optimizer.partition("+")  # +graph: the update replayed as a CUDA graph
        assert graph in ("", "graph"), run
        compiled, _, mode = compiled.partition("+")
        assert not (mode and loop == "bare"), "a compile mode needs a Trainer loop (CompileModel)"
        assert compiled in ("regions", "whole") if mode else compiled in ("eager", "regions", "whole"), run
        torch._dynamo.reset()  # each run compiles afresh: no graph, CUDA graph tree or pool left by the one before
        torch.manual_seed(0)
        optim = OptimConfig(
            **recipe["optim"]
            | dict(optimizer=optimizer, lr_schedule="cosine", decay_steps=10**6, cuda_graph=bool(graph))
        )
        module = GPTLightningModule(GPTConfig.from_dict(model), optim).to(args.device)
        if compiled == "regions" and not mode:
            compile_regions(module.model)
        elif compiled == "whole" and not mode:
            module.model.compile()
        stamps: list[float] = []

        def stamp(step: int) -> None:
            if step in (warm, n - 1):
                common.synchronize(args.device)
                stamps.append(time.perf_counter())
                if profiler is not None:  # the timed steps only: no compile, no warm-up
                    profiler.start() if step == warm else profiler.stop()

        if loop == "bare":
            opt = module.configure_optimizers()
            optimizer_, schedule = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
            for i, batch in enumerate(loader):
                stamp(i)
                with torch.autocast(args.device, torch.bfloat16, enabled=args.device == "cuda"):
                    _, loss = module.model(*split_batch(batch.to(args.device, non_blocking=True)))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
                optimizer_.step(), optimizer_.zero_grad(), schedule.step()
        else:
            train_py, tmp = loop == "train_py", tempfile.TemporaryDirectory()
            callbacks = [LambdaCallback(on_train_batch_start=lambda t, *_: stamp(t.global_step))]
            config = dict(out_dir=tmp.name, checkpoint_every=1000, sample_tokens=0, attention_images=False, seed=0)
            trainer_config = {"max_time": "00:00:10:00", "log_every_n_steps": 25}  # as the recipe: bar redraws too
            config |= dict(compile=False, early_stopping={"patience": None}, trainer=trainer_config)
            callbacks += run_callbacks(config, B) if train_py else []
            callbacks += [CompileModel(B, regions=compiled == "regions", mode=mode)] if mode else []
            with tmp:  # on a CPU in float32, as the bare loop (the default, auto, is bf16 on a native-bf16 CPU)
                MiniGPTTrainer(
                    accelerator=args.device, devices=1, max_steps=n, limit_val_batches=0, num_sanity_val_steps=0,
                    gradient_clip_val=1.0, log_every_n_steps=25, enable_model_summary=False, callbacks=callbacks,
                    enable_checkpointing=train_py, enable_progress_bar=train_py, logger=train_py,
                    default_root_dir=tmp.name, max_time="00:00:10:00" if train_py else None,
                    precision="auto" if args.device == "cuda" else "32-true",
                ).fit(module, train_dataloaders=loader)  # fmt: skip
        return round((stamps[1] - stamps[0]) / (n - 1 - warm) * 1000, 2)

    rows = {}
    for run in args.child.split(","):
        rows[run] = timed(run, None)
        print(f"{run}: {rows[run]} ms/step", file=sys.stderr, flush=True)
    if args.profile:  # once more, under the profilers: its ms are not the figure
        profiler, steps = Profilers(args.device), n - 1 - warm
        try:  # a profiler that fails (CUPTI beside CUDA graphs, say) costs its log, not the rows measured
            ms = timed(args.profile, profiler)
            profiler.write(args.profile_out, f"{args.profile}, {steps} steps under the profilers, {ms} ms/step", steps)
        except Exception as error:
            args.profile_out.write_text(f"{args.profile} failed under the profilers: {error!r}\n")
    print(json.dumps(rows))


class Profilers:
    """The host's Python functions (cProfile) and, beside them, the device's kernels (torch.profiler; on a CPU the
    ops): whether a step waits on the host or on the GPU is the kernels' time per step against the step's."""

    def __init__(self, device: str) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.host = cProfile.Profile()
        self.cuda = device == "cuda"
        self.device = profile(activities=[ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU])

    def start(self) -> None:
        self.device.start()
        self.host.enable()

    def stop(self) -> None:
        self.host.disable()
        self.device.stop()

    def write(self, path: Path, title: str, steps: int) -> None:
        """The kernels' time and count per step and the top 25 by it; then the host's top 40 functions by own time
        and by time with callees. Both profilers slow the host: its ms per step is not the figure, the kernels' is."""
        events = self.device.key_averages()
        what = "GPU kernels" if self.cuda else "CPU ops (own time)"
        busy_ms = sum(e.self_device_time_total if self.cuda else e.self_cpu_time_total for e in events) / 1e3
        calls = sum(e.count for e in events)
        out = io.StringIO()
        out.write(f"{title}\n{what}: {busy_ms / steps:.2f} ms per step, {calls / steps:.0f} per step\n")
        sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        out.write(events.table(sort_by=sort, row_limit=25, max_name_column_width=60) + "\n")
        for order in ("tottime", "cumulative"):
            pstats.Stats(self.host, stream=out).sort_stats(order).print_stats(40)
        path.write_text(out.getvalue())


def last_json(lines: list[tuple[float, str]]) -> dict | None:
    """A child's result: its last JSON line (Inductor's max-autotune prints JSON lines of its own before it)."""
    for _, line in reversed(lines):
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):  # a log line that only looks like JSON
                return json.loads(line)
    return None


def child(args, work: Path, cache: str, what: str) -> tuple[dict, list[tuple[float, str]]]:
    """This script's --child in a fresh process: the JSON line it printed (or its exit code and tail), its lines."""
    cmd = [sys.executable, __file__, "--child", what, "--device", args.device, *(["--tiny"] if args.tiny else [])]
    if args.profile and ":" in what:  # the overhead part's child
        cmd += ["--profile", args.profile, "--profile_out", str(work / "overhead_profile.log")]
    lines, rc = run_timed(cmd, REPO, fresh_env(work / cache), args.timeout)
    got = last_json(lines) if rc == 0 else None  # a child that died after autotuning printed only the tuner's
    return got or {"rc": rc, "tail": [line for _, line in lines[-6:]]}, lines


def throughput(args, work: Path) -> dict:
    peak = next((flops for gpu, flops in PEAK_BF16.items() if gpu in args.gpu_name), None)  # None: no MFU (JSON null)
    rows: dict = {}
    flops_per_token = None
    for kind in args.compile_kinds.split(","):
        row, lines = child(args, work, f"cache_tp_{kind}", kind)
        if "flops_per_token" in row:
            flops_per_token = row.pop("flops_per_token")
            row["mfu"] = round(flops_per_token * row["tokens_per_s"] / peak, 4) if peak else None
        row["launch_to_end_s"] = lines[-1][0]
        rows[{"regions": "minigpt_regions", "whole": "minigpt_whole_model"}.get(kind, f"minigpt_{kind}")] = row
    if args.device == "cuda":  # bench.py synchronizes CUDA unconditionally
        nano = args.nanogpt.resolve()
        cmd = [sys.executable, "bench.py", "--real_data=False", "--compile=True"]
        lines, rc = run_timed(cmd, nano, fresh_env(work / "cache_tp_nano"), args.timeout)
        hit = first(lines, r"time per iteration: ([\d.]+)ms, MFU: ([\d.]+)%")
        rows["nanogpt_bench"] = {"rc": rc, "launch_to_end_s": lines[-1][0] if lines else None}
        if hit:
            ms, tokens_s = float(hit[1][1]), 12 * 1024 / float(hit[1][1]) * 1000
            mfu = round(flops_per_token * tokens_s / peak, 4) if flops_per_token and peak else None
            row = dict(ms_per_iter=ms, tokens_per_s=round(tokens_s), mfu=mfu, mfu_own_a100_basis=float(hit[1][2]) / 100)
            rows["nanogpt_bench"] |= row
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nanogpt", type=Path, help="a checkout of karpathy/nanoGPT (not a dependency)")
    p.add_argument("--corpus", type=Path, help="tinyshakespeare.txt")
    p.add_argument("--parts", default="bytecode,recipe,variants,imports,nanogpt,throughput")
    p.add_argument("--variant", action="append", default=[], help="variants: NAME=FLAGS (and ENV=VALUE)")
    p.add_argument("--nanogpt_iters", type=int, default=2000, help="nanoGPT's recipe, cut here (its best: ~2000)")
    p.add_argument("--overhead_runs", help="overhead: OPTIMIZER:LOOP:COMPILE runs, comma-separated (see the docs)")
    p.add_argument(
        "--profile", help="overhead: run this OPTIMIZER:LOOP:COMPILE once more under cProfile and torch.profiler"
    )
    p.add_argument("--profile_out", type=Path, help=argparse.SUPPRESS)  # where the overhead child writes it
    p.add_argument("--compile_kinds", default="regions", help="throughput: regions, whole (one graph), +MODE, +SDPA")
    p.add_argument("--extra", default="", help="train.py options added to every minigpt run (e.g. a compile mode)")
    p.add_argument("--work", type=Path, help="folder for the runs, data and compile caches (default: a new one)")
    p.add_argument("--without", default="", help="recipe runs as if these packages were not installed (a,b)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny sizes: the script's own smoke test")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per launched command")
    p.add_argument("--out", type=Path, help="write the results as JSON here (logs beside it)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # throughput's compile kind, or the overhead part's runs
    args = p.parse_args()
    if args.child:
        return overhead_child(args) if ":" in args.child else throughput_child(args)
    parts = args.parts.split(",")  # what each part needs, checked before any runs: not minutes into a session
    if unknown := [part for part in parts if part not in PARTS]:
        p.error(f"--parts: unknown part {unknown[0]!r}; choose from {', '.join(PARTS)}")
    if args.corpus is None and {"recipe", "cold", "variants", "long"} & set(parts):
        p.error("--corpus FILE is needed: the text minigpt's runs train on (e.g. tinyshakespeare.txt)")
    if args.nanogpt is None and ("nanogpt" in parts or ("throughput" in parts and args.device == "cuda")):
        p.error(
            "--nanogpt PATH is needed by the nanogpt part (and throughput on a GPU): a checkout of karpathy/nanoGPT; "
            "or leave them out of --parts"
        )
    args.gpu_name, torch_version, capability = machine(args.device)
    print(f"device: {args.gpu_name}; torch {torch_version}; cpu capability {capability}")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_gpu_"))  # --work: caches kept across invocations
    work.mkdir(parents=True, exist_ok=True)
    logs = args.out.with_suffix("") if args.out else work
    logs.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": args.gpu_name, "torch": torch_version, "date": time.strftime("%Y-%m-%d")}
    results |= {"extra": args.extra, "without": args.without}

    def save(part: str = "", value=None) -> None:  # after each part: a run cut short still leaves what it measured
        if part:
            results[part] = value
            print(json.dumps(value), flush=True)
        for log in work.glob("*.log"):
            (logs / log.name).write_text(log.read_text())
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))

    def recipe(name: str, overrides: list[str], cache: str = "") -> None:  # each run cold but the warm one
        row = minigpt_run(args, name, overrides, work / f"cache_{cache or name}", work)
        results.setdefault("minigpt", []).append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "curve"}), "\n  curve:", row["curve"], flush=True)
        save()

    if "bytecode" in parts:  # first, through the recipe runs' interpreter and site folder: they read the cache it
        # leaves, as a user's second launch would
        save("bytecode", bytecode_launches(*minigpt_python(args, work / "cache_bytecode", work)))
    if "recipe" in parts or "cold" in parts:
        recipe("recipe_cold", [])
    if "recipe" in parts:
        recipe("recipe_warm", [], cache="recipe_cold")  # the same caches, now filled
    for spec in args.variant if "variants" in parts else []:
        name, _, overrides = spec.partition("=")
        recipe(f"variant_{name}", overrides.split())
    if "long" in parts:
        recipe("recipe_120s", ["--trainer.max_time", "00:00:01:45", "--trainer.val_check_interval", "500"])
    if "imports" in parts:  # where a launch's import time goes (after the runs above: a warm disk cache)
        python, env = minigpt_python(args, work / "cache_imports", work)
        cmd = python + ["-X", "importtime", "-c", "import gc; gc.disable(); import minigpt.cli.train"]
        got = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        save("imports", common.import_breakdown(got.stderr, top=25))
    if "nanogpt" in parts:
        save("nanogpt", nanogpt_run(args, work))
    if "overhead" in parts:  # the recipe's step, layer by layer: a fresh process (its own compile caches)
        runs = "muon:bare:regions,adamw:bare:regions,muon:bare:whole,muon:bare:eager,muon:minimal:regions"
        runs += ",adamw:minimal:regions,muon:train_py:regions,adamw:train_py:regions"
        runs = "muon:bare:eager,adamw+graph:minimal:eager,muon:train_py:eager" if args.tiny else runs  # no compiling
        runs = args.overhead_runs or runs
        save("overhead_ms_per_step", child(args, work, "cache_oh", runs)[0])
    if "throughput" in parts:
        save("throughput", throughput(args, work))
    save()


if __name__ == "__main__":
    main()
