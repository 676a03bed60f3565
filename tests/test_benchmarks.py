"""Smoke tests: each benchmark script runs once end to end at its tiny size (--quick) and writes the JSON it promises.
The figures are not checked: they depend on the machine.  bench_eval and bench_gguf run beside what they measure
(tests/evaluation/test_harness.py, tests/export/test_gguf_cli.py); time_to_loss trains for a fixed number of steps
here, not its time budget."""

import importlib
import json
import os
import random
import re
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `benchmarks` is a folder of scripts, not an installed package

SLOW = pytest.mark.slow
# script -> its flags after --quick --json PATH ({text}: 200 KB of varied words; {tmp}: a scratch folder)
QUICK = [
    pytest.param("bench_attention", ["--device", "cpu"]),
    pytest.param("bench_train", ["--device", "cpu", "--shapes", "finetune"]),  # GPT-2's shape, made tiny
    pytest.param("bench_long_context", ["--device", "cpu"]),
    pytest.param("bench_serve", ["--device", "cpu"]),
    pytest.param("bench_engine", ["--device", "cpu", "--ways", "growing, eager", "static, eager"]),
    pytest.param("bench_engine", ["--device", "cpu"], marks=SLOW, id="bench_engine-compiled"),  # two compiles
    pytest.param("bench_startup", ["--device", "cpu", "--commands", "sample.py --help"]),
    pytest.param(
        "bench_startup", ["--device", "cpu", "--commands", "train.py 20 steps"], marks=SLOW, id="startup-train"
    ),
    pytest.param("bench_prepare", ["--corpus", "{text}"]),
    pytest.param("tokens_per_char", ["--text", "english={text}"]),
    pytest.param("val_estimate", ["--corpus", "{text}", "--data_root", "{tmp}/data"]),
    pytest.param("bench_decode", [], marks=SLOW),  # compiles the decode step of four tiny models
    # the GPU measurement (eager, compiled, transformers, the serve engine), tiny and on the CPU
    pytest.param("bench_decode", ["--single_stream", "--device", "cpu"], marks=SLOW, id="bench_decode-single_stream"),
    pytest.param("bench_attention_lab", ["--device", "cpu", "--repeats", "1"], marks=SLOW),
    pytest.param("bench_hf", [], marks=SLOW),  # on the CPU: no --device
    pytest.param("bench_lora", ["--work", "{tmp}"], marks=SLOW),  # about 45 s of CPU: eight train.py children
]


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """Words over many letters, so a BPE of the benchmarks' quick vocabularies finds its merges."""
    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlucmfw") for _ in range(rng.randint(2, 8))) for _ in range(3000)]
    path = tmp_path_factory.mktemp("text") / "words.txt"
    path.write_text("\n".join(" ".join(rng.choices(words, k=12)) + "." for _ in range(3000)) + "\n")
    return path


@pytest.mark.parametrize("script, flags", QUICK)
def test_each_benchmark_runs_once_at_its_tiny_size(script, flags, text, tmp_path, capsys, one_thread):
    module = importlib.import_module(f"benchmarks.{script}")
    out = tmp_path / "results" / f"{script}.json"  # the folder does not exist yet: the script creates it
    module.main(["--quick", "--json", str(out), *(f.format(text=text, tmp=tmp_path) for f in flags)])
    assert json.loads(out.read_text())  # the JSON it promises
    assert capsys.readouterr().out.strip()  # and the figures, printed


def test_bench_decode_measures_a_cpu_kind_in_a_process_started_as_that_kind():
    """A kind's figures come from a process whose environment is that kind's: `--kinds avx2` from a native shell
    (or `--kinds native` from an emulating one) runs the script again as the kind instead of labelling its own
    process's figures with it (a native run reported as avx2, until 2026-11-28)."""
    from benchmarks import bench_decode

    native, avx2 = {"PATH": "/bin"}, {"PATH": "/bin", **bench_decode.KINDS["avx2"]}
    assert bench_decode.runs_here(["native"], native) and bench_decode.runs_here(["avx2"], avx2)
    assert not bench_decode.runs_here(["avx2"], native) and not bench_decode.runs_here(["native"], avx2)
    assert not bench_decode.runs_here(["avx2"], {"ATEN_CPU_CAPABILITY": "avx2"})  # half of the kind
    assert not bench_decode.runs_here(["native", "avx2"], native)  # each as a child of its own
    assert bench_decode.kind_environment("avx2", native) == avx2
    assert bench_decode.kind_environment("native", avx2) == native


def test_time_to_loss_gives_its_budget_as_a_duration_lightning_reads():
    """The documented --budget 114 was `00:00:00:114`, which Lightning refuses: every run failed."""
    from lightning.pytorch.callbacks import Timer

    from benchmarks.time_to_loss import max_time

    assert [max_time(s) for s in (3, 40.4, 114, 90061)] == ["00:00:00:03", "00:00:00:40", "00:00:01:54", "01:01:01:01"]
    Timer(duration=max_time(114))  # Lightning's own check of the string (it refused the old one)


def test_time_to_loss_numerics_variants_train_as_each_kind_of_cpu_computes(
    tiny_run_args, corpus, data_root, tmp_path, monkeypatch, capsys
):
    # the figure they report (loss per step with a native-bf16 CPU's numerics, measured on any CPU) is only right if
    # the bf16 run really trains in bf16 autocast with Muon's iteration in bf16, and the float32 run in neither
    from benchmarks import time_to_loss
    from minigpt.training.muon import Muon

    monkeypatch.setattr(Muon, "ns_dtype", None)  # what the children set is undone after the test
    ran = {}
    for numerics in ("bf16", "float32"):
        argv = [
            "--config",
            time_to_loss.CONFIG,
            *tiny_run_args(corpus, data_root, tmp_path / numerics, steps=2),
            "--compile",
            "false",
            "--trainer.max_time",
            "null",
            "--sample_tokens",
            "0",
        ]
        time_to_loss.train_child(numerics, argv)
        line = capsys.readouterr().out.splitlines()[-1]
        ran[numerics] = json.loads(line.removeprefix(time_to_loss.RESULT))
    assert {k: (r["precision"], r["muon_dtype"], r["steps"]) for k, r in ran.items()} == {
        "bf16": ("bf16-mixed", "bfloat16", 2),
        "float32": ("32-true", "float32", 2),
    }
    assert all(0 < r["full_val_loss"] < 10 for r in ran.values())


def test_time_to_loss_runs_the_config_as_shipped_and_validates_at_its_interval(
    corpus, data_root, tmp_path, capsys, monkeypatch
):
    # the recipe's row is the recipe as a user runs it: the benchmark adds no validations the config does not make
    import yaml

    from benchmarks import time_to_loss

    config = yaml.safe_load((REPO / time_to_loss.CONFIG).read_text())
    config["trainer"]["val_check_interval"] = 7
    config_path = tmp_path / "recipe.yaml"
    config_path.write_text(yaml.safe_dump(config))
    # a fixed step count, not the benchmark's time budget: what a busy machine trains in 3 s is not a test's to know
    tiny = [
        "--data.data_root",
        data_root,
        "--model.n_layer",
        1,
        "--model.n_embd",
        32,
        "--model.n_head",
        2,
        "--model.mlp_hidden",
        64,
        "--model.block_size",
        32,
        "--data.batch_size",
        8,
        "--data.val_batches",
        2,
        "--compile",
        "false",
        "--trainer.max_steps",
        21,
        "--trainer.max_time",
        "null",
    ]
    extra = [f"--extra={flag}={value}" for flag, value in zip(tiny[::2], tiny[1::2])]
    out = tmp_path / "ttl.json"
    monkeypatch.chdir(tmp_path)  # the corpus and the config relative to the user's folder, not the children's
    paths = ["--corpus", os.path.relpath(corpus), "--config", config_path.name, "--target", "100"]
    time_to_loss.main(["--quick", *paths, "--json", str(out), *extra])
    result = json.loads(out.read_text())
    assert result["val_every"] == 7 and "validation every 7 steps" in capsys.readouterr().out
    (row,) = result["results"]
    assert row["variant"] == "recipe" and row["steps"] == 21, row
    assert 0 < row["full_val_loss"] < 10
    # every 7 steps, as the config says (each validation logged at the step it validated)
    assert [step for step, _ in row["curve"]] == [7, 14, 21], row["curve"]
    # any loss is below a target of 100: reached at the first validation, after 7 of the 21 steps
    assert row["time_to_target_s"] == round(7 * row["train_s"] / 21, 1)


@SLOW  # ~80 s: a copy of the site folders as links, then three launches that compile train.py's imports
def test_bench_bytecode_emulates_an_environment_without_compiled_modules(tmp_path, capsys):
    """minigpt's first import (before torch) sets the bytecode cache where torch's bytecode is missing: off, the first
    launch and the next, as bench_bytecode.py emulates such an environment."""
    from benchmarks import bench_bytecode

    out = tmp_path / "bytecode.json"
    launches = bench_bytecode.main(["--quick", "--json", str(out)])["launches"]
    assert launches["environment"]["PYTHONDONTWRITEBYTECODE"] == "1"
    off, first, after = launches["cache off"], launches["first launch"], launches["next launch"]
    assert off["rc"] == first["rc"] == after["rc"] == 0
    assert off["pycache_prefix"] is None and not off["torch_cached_here"] and off["pyc_files"] == 0
    assert first["pycache_prefix"].endswith("/minigpt/pycache") and after["pycache_prefix"] == first["pycache_prefix"]
    assert first["pyc_files"] > 1000 and after["torch_cached_here"]  # torch, Lightning, sympy: thousands of modules
    assert after["cpu_capability"] == torch.backends.cpu.get_cpu_capability()  # bench_gpu's label of the host CPU
    assert json.loads(out.read_text())["rows"] and "next launch" in capsys.readouterr().out
    # the next launch again under -X importtime: where the time went, torch's own modules among the slowest packages
    breakdown = launches["next, -X importtime"]["breakdown"]
    assert breakdown["modules"] > 1000 and "torch" in dict(breakdown["by_package"]) and breakdown["total_s"] > 0


def test_an_importtime_breakdown_sums_each_packages_own_time():
    """Where a launch's imports went, from `python -X importtime`'s lines: a package's own time is its modules'
    self times (not what they import: lightning importing torchmetrics counts for torchmetrics), the total is the
    top-level imports' cumulative times."""
    from benchmarks.common import import_breakdown

    importtime = """import time: self [us] | cumulative | imported package
import time:       100 |        100 | _io
import time:    400000 |    400000 |   torch._C
import time:    200000 |    600000 | torch
import time:     50000 |      50000 |       torchmetrics.functional
import time:     30000 |      80000 |     torchmetrics
import time:     20000 |     100000 |   lightning.fabric
import time:     10000 |     110000 | lightning
noise that is no importtime line
"""
    got = import_breakdown(importtime, top=2)
    assert got["modules"] == 7 and got["total_s"] == 0.71  # 100 us + 0.6 s + 0.11 s
    assert got["by_package"] == [("torch", 0.6), ("torchmetrics", 0.08)]  # the top 2; lightning's own: 0.03
    assert got["slowest"] == [("torch._C", 0.4), ("torch", 0.2)]


@SLOW  # a train.py child and two Lightning children
def test_bench_gpu_runs_minigpts_parts_on_a_cpu(corpus, tmp_path):
    """bench_gpu.py's minigpt side at tiny sizes (nanoGPT's side needs its checkout and a GPU)."""
    import subprocess

    out = tmp_path / "gpu.json"
    cmd = [sys.executable, str(REPO / "benchmarks/bench_gpu.py"), "--device", "cpu", "--tiny", "--corpus", str(corpus)]
    parts = ["--parts", "cold,variants,throughput,overhead", "--profile", "muon:train_py:eager", "--out", str(out)]
    parts += ["--variant", "cg=--compile true --compile_mode cudagraphs"]  # a GPU's compile mode: falls back here
    subprocess.run(cmd + parts, check=True, capture_output=True)
    result = json.loads(out.read_text())
    cold, fallback = result["minigpt"]  # the recipe cold (its warm run, the same command again, is left out: ~15 s)
    assert fallback["rc"] == 0 and fallback["not_compiled"].endswith(
        "compile_mode cudagraphs needs a CUDA GPU (this run is on cpu: --compile_mode default compiles there); "
        "training without compiling"
    )
    assert "not_compiled" not in cold
    assert cold["rc"] == 0 and cold["steps"] == 30 and 0 < cold["full_val"] < 10 and cold["first_step_s"] > 0
    assert [step for _, step, _ in cold["curve"]] == [10, 20, 30]  # val_loss at the step validated, from TensorBoard
    assert result["throughput"]["minigpt_regions"]["ms_per_iter"] > 0
    assert set(result["overhead_ms_per_step"]) == {
        "muon:bare:eager",
        "adamw+graph:minimal:eager",
        "muon:train_py:eager",
    }
    assert all(ms > 0 for ms in result["overhead_ms_per_step"].values())
    # --profile: that run once more under cProfile and torch.profiler, its timed steps only, beside the results
    # (not among them): the device's time per step (here the CPU's ops), its top ops, then the host's functions
    profile = (tmp_path / "gpu" / "overhead_profile.log").read_text()
    title, device, *table = profile.splitlines()
    assert title.startswith("muon:train_py:eager, 9 steps under the profilers")
    assert re.fullmatch(r"CPU ops \(own time\): \d+\.\d\d ms per step, \d+ per step", device), device
    assert float(device.split()[4]) > 0 and "aten::mm" in profile and "training/muon.py" in profile


def test_bench_gpu_names_the_gpu_and_torchs_version_without_importing_torch(tmp_path):
    """bench_gpu's parent only launches the runs: on the GPU machine its own torch import (and CUDA's start) cost
    seconds of each of the session's launches of it.  It asks nvidia-smi for CUDA's device 0 instead."""
    import subprocess

    smi = tmp_path / "nvidia-smi"  # the real one's answer for GPU 1 (CUDA's device 0 when CUDA_VISIBLE_DEVICES=1,0)
    smi.write_text('#!/bin/sh\n[ "$*" = "--query-gpu=name --format=csv,noheader -i 1" ] && echo "NVIDIA H200"\n')
    smi.chmod(0o755)
    code = "import json, sys; from benchmarks.bench_gpu import machine\n"
    code += "print(json.dumps([*machine('cuda'), 'torch' in sys.modules]))"
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}", CUDA_VISIBLE_DEVICES="1,0")
    got = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert json.loads(got.stdout) == ["NVIDIA H200", torch.__version__, "see bytecode's probe", False]


def test_bench_gpu_takes_a_childs_last_json_line_as_its_result():
    """max-autotune prints its choice of kernel as a JSON line before the child's own result."""
    from benchmarks.bench_gpu import last_json

    autotune = '{"num_choices": 20, "best_kernel": "mm"}'
    lines = [(1.0, "compiling"), (2.0, autotune), (3.0, '{"ms_per_iter": 26.2}'), (3.1, "done")]
    assert last_json(lines) == {"ms_per_iter": 26.2}
    assert last_json([(1.0, "Traceback")]) is None
    assert last_json([(1.0, '{"ms_per_iter": 26.2}'), (2.0, "{not json")]) == {"ms_per_iter": 26.2}


def test_offline_wheels_fetches_what_the_gpu_machine_lacks_at_the_versions_tested_here(tmp_path, monkeypatch):
    """A machine with no package index gets the wheels of what it lacks, pinned as installed here; an extra's
    requirements are followed (jsonargparse[signatures] -> docstring-parser, minigpt[serve] -> fastapi); torch never
    travels (the machine's own drives its GPU)."""
    from importlib.metadata import version

    import benchmarks.offline_wheels as offline_wheels

    lacking = {"jsonargparse", "docstring-parser", "fastapi", "torch"}
    everything = offline_wheels.closure("minigpt", {"serve"}, "3.12")
    assert lacking <= set(everything) and "lightning" in everything
    (tmp_path / "theirs.txt").write_text("\n".join(sorted(set(everything) - lacking)))
    calls = []
    monkeypatch.setattr(offline_wheels.subprocess, "run", lambda cmd, check: calls.append(cmd))
    argv = ["offline_wheels.py", "--have", str(tmp_path / "theirs.txt"), "--dest", str(tmp_path / "wheels")]
    monkeypatch.setattr(sys, "argv", argv)
    offline_wheels.main()
    (cmd,) = calls
    assert cmd[:5] == [sys.executable, "-m", "pip", "download", "-q"] and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    wanted = [arg for arg in cmd if "==" in arg]
    assert wanted == [f"{name}=={version(name)}" for name in ("docstring-parser", "fastapi", "jsonargparse")]


def test_gpu_session_skips_each_step_that_its_budget_cannot_hold(tmp_path):
    """benchmarks/gpu_session.sh on a lease too short for any step: each step says it was skipped and why, and
    the half still ends with its digest and its packed results.  The second half runs again the first half's
    variant that reached 1.47 soonest (else the lowest loss), among those that ended well."""
    import subprocess
    import tarfile

    kit, out, state = tmp_path / "kit", tmp_path / "out", tmp_path / "state"
    kit.mkdir()
    env = dict(os.environ, KIT=str(kit), OUT=str(out), STATE=str(state), BUDGET="1", DRY="1")
    variants = [  # name, rc, full-split val loss, its seconds since launch
        ("variant_shipped", 0, 1.4608, 39.5),
        ("variant_graphed", 0, 1.4690, 31.0),  # the first at <= 1.47
        ("variant_wide_12s", 0, 1.4650, 33.0),
        ("variant_graph", 1, 1.4500, 30.0),  # it failed after its validation: not a candidate
    ]
    for half, steps in [("first", 9), ("rest", 8)]:
        got = subprocess.run(["bash", str(REPO / "benchmarks/gpu_session.sh"), half], env=env, capture_output=True)
        assert got.returncode == 0, got.stderr.decode()
        for name, rc, loss, at in variants if half == "first" else []:  # as bench_gpu.py writes them
            row = dict(name=name, overrides=f"--flag {name}", rc=rc, full_val=loss, full_val_at_s=at)
            (state / "first" / f"{name}.json").write_text(json.dumps({"minigpt": [row]}))
        digest = (out / f"{half}.txt").read_text()
        assert ("again: graphed_again=--flag variant_graphed" in digest) == (half == "rest"), digest
        skipped = re.findall(r"^== (\w+): skipped, -?\d+s left of the \d+s it needs$", digest, re.M)
        assert len(skipped) == steps and ("variant_wide_40s" in skipped) == (half == "rest"), digest
        assert f"== {half} done" in digest
        with tarfile.open(out / f"{half}.tgz") as packed:
            assert packed.getnames() == [half]


def test_bench_train_builds_each_shape_with_a_schedule_optim_config_accepts():
    """The shapes without an optim section (nanogpt, default) keep OptimConfig's 100 warmup steps: the decay ends
    after the run's steps past that warmup (it ended at step 26, before the warmup's end, and OptimConfig refused
    it, until 2026-11-29)."""
    from benchmarks import bench_train
    from minigpt.training.optim import OptimConfig

    for name in ("nanogpt", "default", "finetune"):
        shape = bench_train.make_shape(name, quick=False)
        optim = bench_train.optim_config(shape, 5 + 20 + 1)  # the default warm-up and steps
        assert optim.decay_steps == optim.warmup_steps + 26 and OptimConfig(**vars(optim)) == optim
        module = bench_train.make_module(bench_train.make_shape(name, quick=True), False, 26, torch.device("cpu"))
        assert module.optim.decay_steps > module.optim.warmup_steps


@pytest.mark.parametrize(
    "script, flags",
    [
        ("bench_attention", ["--seq_lens", "0"]),
        ("bench_attention", ["--n_head", "0"]),
        ("bench_attention", ["--repeats", "0"]),
        ("bench_attention", ["--device", "foo"]),
        ("bench_long_context", ["--blocks", "1"]),
        ("bench_long_context", ["--block_sizes", "1"]),
        ("bench_long_context", ["--chat_block_size", "16"]),
        ("bench_prepare", ["--corpus", "/nonexistent"]),
        ("bench_prepare", ["--mb", "0"]),
        ("bench_prepare", ["--mb", "-1"]),
        ("tokens_per_char", ["--text", "foo"]),
        ("tokens_per_char", ["--text", "english=/nonexistent.txt"]),  # was an empty table, exit 0
        ("bench_engine", ["--repeat", "0"]),
        ("bench_serve", ["--clients", "0"]),
        ("bench_startup", ["--repeats", "0"]),
        ("bench_hf", ["--repeats", "0"]),
        ("bench_hf", ["--device", "cpu"]),  # it runs on the CPU: no --device to ignore
        ("bench_lora", ["--steps", "3"]),  # s/step is the median period after the first two steps
        ("bench_attention_lab", ["--repeats", "0"]),  # was a median of nothing: "nan s", "chromium not installed"
        ("bench_attention_lab", ["--tokens", "0"]),  # was a traceback
        ("bench_decode", ["--repeats", "0"]),  # was nan tokens/s
        ("bench_decode", ["--tokens", "0"]),
    ],
)
def test_a_benchmarks_bad_argument_is_one_error_line(script, flags, capsys):
    module = importlib.import_module(f"benchmarks.{script}")
    with pytest.raises(SystemExit) as exit:
        module.main(flags)
    assert exit.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith(f"{os.path.basename(sys.argv[0])}: error: "), line


def test_each_benchmarks_help_describes_it_in_whole_sentences(capsys):
    for script in ("bench_gguf", "bench_long_context", "bench_serve", "bench_engine"):
        module = importlib.import_module(f"benchmarks.{script}")
        with pytest.raises(SystemExit):
            module.main(["--help"])
        description = capsys.readouterr().out.split("\n\n")[1]
        assert description.rstrip().endswith("."), description


def test_bench_gpu_kills_a_silent_child_at_its_timeout():
    """A hung child that prints nothing is killed at the timeout too (it was only checked at each line)."""
    import time

    from benchmarks.bench_gpu import run_timed

    started = time.perf_counter()
    code = "print('started', flush=True); import time; time.sleep(120)"
    lines, rc = run_timed([sys.executable, "-c", code], REPO, dict(os.environ), timeout=2)
    assert rc != 0 and [line for _, line in lines] == ["started"] and time.perf_counter() - started < 60


def test_offline_wheels_fetches_nothing_when_nothing_is_missing(tmp_path, monkeypatch, capsys):
    import benchmarks.offline_wheels as offline_wheels

    everything = offline_wheels.closure("minigpt", {"serve"}, "3.12")
    (tmp_path / "theirs.txt").write_text("\n".join(everything))
    monkeypatch.setattr(offline_wheels.subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    monkeypatch.setattr(sys, "argv", ["offline_wheels.py", "--have", str(tmp_path / "theirs.txt"), "--dest", "w"])
    offline_wheels.main()
    assert capsys.readouterr().out.startswith("nothing to fetch")
    monkeypatch.setattr(sys, "argv", ["offline_wheels.py", "--have", str(tmp_path / "none.txt"), "--dest", "w"])
    with pytest.raises(SystemExit) as exit:
        offline_wheels.main()
    assert exit.value.code == 2 and "error: --have" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--parts", "nanogpt", "--corpus", "t.txt"], "--nanogpt PATH is needed by the nanogpt part"),
        (["--parts", "recipe"], "--corpus FILE is needed"),
        (["--parts", "recipes", "--corpus", "t.txt"], "--parts: unknown part 'recipes'"),
    ],
)
def test_bench_gpu_refuses_what_a_part_lacks_before_it_runs_anything(flags, error):
    """A missing --nanogpt was an AttributeError after every part before nanogpt's had run (minutes on a GPU)."""
    import subprocess

    cmd = [sys.executable, str(REPO / "benchmarks/bench_gpu.py"), "--device", "cpu", "--tiny", *flags]
    got = subprocess.run(cmd, capture_output=True, text=True)
    assert got.returncode == 2 and got.stdout == ""
    assert got.stderr.strip().splitlines()[-1].startswith(f"bench_gpu.py: error: {error}"), got.stderr


def test_bench_gpu_records_a_run_that_failed_and_goes_on(corpus, tmp_path):
    """A variant whose train.py fails (here a misspelt flag) is a row with its exit code and output's tail; it was a
    traceback (TensorBoard's reader on the run directory it never made) that lost every part after it."""
    import subprocess

    out = tmp_path / "gpu.json"
    cmd = [sys.executable, str(REPO / "benchmarks/bench_gpu.py"), "--device", "cpu", "--tiny", "--corpus", str(corpus)]
    cmd += ["--parts", "variants", "--variant", "bad=--model.n_layr 2", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    (bad,) = json.loads(out.read_text())["minigpt"]
    assert bad["rc"] == 2 and bad["curve"] == [] and "--model.n_layr" in bad["tail"][-1]


def test_val_estimate_refuses_a_checkpoint_trained_with_another_tokenizer(text, tmp_path, capsys):
    """Its ids would mean other characters: the figures were computed all the same, of nothing."""
    from benchmarks import val_estimate
    from minigpt.core.checkpoint import model_checkpoint, save_file
    from minigpt.core.config import GPTConfig
    from minigpt.core.model import GPT
    from minigpt.core.tokenizers import CharTokenizer

    tokenizer = CharTokenizer("abcdefghijklmnopqrstuvwxyz .\n")  # not the words' characters
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=tokenizer.vocab_size))
    save_file(model_checkpoint(model, tokenizer), tmp_path / "other.ckpt")
    flags = ["--ckpt", str(tmp_path / "other.ckpt"), "--corpus", str(text), "--data_root", str(tmp_path / "data")]
    with pytest.raises(SystemExit) as exit:
        val_estimate.main([*flags, "--json", str(tmp_path / "out.json")])
    assert exit.value.code == 2 and not (tmp_path / "out.json").exists()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: --ckpt" in line and "was not trained on --corpus" in line, line
