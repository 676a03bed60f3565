"""The `minigpt` console script (minigpt.cli.main) and what an installed minigpt needs: its subcommands, the
default config shipped in the package (and in the wheel), and commands that start without Lightning."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import minigpt
from minigpt.cli import train
from minigpt.cli.main import COMMANDS, main
from minigpt.configs import default_config
from minigpt.core.config import GPTConfig

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
HEAVY = ("lightning", "pytorch_lightning", "matplotlib", "datasets", "transformers")


# --------------------------------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("argv", [[], ["--help"], ["-h"], ["help"]])
def test_help_and_no_arguments_list_every_command(argv, capsys):
    main(argv)
    out = capsys.readouterr().out
    assert out.startswith("usage: minigpt")
    listed = [line.split()[0] for line in out.split("commands:")[1].split("\n\n")[0].splitlines() if line.strip()]
    assert listed == ["train", "sample", "eval", "export", "attention", "serve"]


def test_version_is_the_packages(capsys):
    main(["--version"])
    assert capsys.readouterr().out.strip() == f"minigpt {PYPROJECT['project']['version']}"
    assert minigpt.__version__ == PYPROJECT["project"]["version"]


@pytest.mark.parametrize("metadata", [None, "9.9.9"])
def test_version_is_the_running_codes_in_a_source_tree(metadata, tmp_path):
    """`python3 -m minigpt --version` from a checkout that was never installed (no metadata: it was a traceback,
    PackageNotFoundError) or beside another install's metadata (it printed that version) names the code that runs."""
    shutil.copytree(REPO / "minigpt", tmp_path / "minigpt", ignore=shutil.ignore_patterns("__pycache__"))
    if metadata is not None:
        (info := tmp_path / f"minigpt-{metadata}.dist-info").mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: minigpt\nVersion: {metadata}\n")
    # -S: no site-packages, where this environment's own minigpt is installed
    cmd = [sys.executable, "-S", "-m", "minigpt", "--version"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert (done.returncode, done.stdout, done.stderr) == (0, f"minigpt {PYPROJECT['project']['version']}\n", "")


@pytest.mark.parametrize("argv", [["--help"], ["--version"]])
def test_a_reader_gone_before_the_help_or_version_is_a_silent_sigpipe_exit(argv):
    """`minigpt --help | head -1` where head has gone: it was a BrokenPipeError traceback (or 'Exception ignored'
    and exit 120); now it stops as a command killed by SIGPIPE (141), as the commands themselves do."""
    read, write = os.pipe()
    os.close(read)  # the reader has gone before a byte is written
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered, as for a user
    done = subprocess.run([sys.executable, "-m", "minigpt", *argv], stdout=write, stderr=subprocess.PIPE, env=env)
    os.close(write)
    assert (done.returncode, done.stderr.decode()) == (141, "")


@pytest.mark.parametrize("name,needle", [("trian", "unknown command 'trian'"), ("--verbose", "unknown option")])
def test_an_unknown_command_is_one_error_line(name, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--ckpt", "x"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err
    assert "train, sample, eval, export, attention" in err


def test_the_console_script_is_declared():
    assert PYPROJECT["project"]["scripts"] == {"minigpt": "minigpt.cli.main:main"}


def test_requires_python_admits_no_python_a_pinned_dependency_refuses():
    """requires-python said >=3.10 while numpy, matplotlib and filelock as pinned need 3.11 (and export used 3.11's
    hashlib.file_digest): pip on 3.10 took minigpt and then had no numpy==2.4.6 for it. Checked against each
    installed pin's own Requires-Python (the extras' too)."""
    project = PYPROJECT["project"]
    oldest = SpecifierSet(project["requires-python"])
    assert [str(s.operator) for s in oldest] == [">="]  # a floor: the oldest Python it admits is that version
    floor = next(iter(oldest)).version
    pins = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    refusing = {}
    for pin in map(Requirement, pins):
        try:
            needs = importlib.metadata.metadata(pin.name)["Requires-Python"]
        except importlib.metadata.PackageNotFoundError:  # not installed here (an extra)
            continue
        if needs and floor not in SpecifierSet(needs):
            refusing[pin.name] = needs
    assert refusing == {}, f"requires-python {oldest} admits Python {floor}"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_commands_help_is_its_own(command, capsys):
    """`minigpt CMD --help` is CMD's parser (named as its script, CMD.py, like every error it prints)."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {command}.py")


def test_help_command_is_the_commands_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["help", "sample"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: sample.py")


def test_python_dash_m_minigpt_is_the_console_script():
    """`python3 -m minigpt` runs the console script, and its commands name themselves as it does."""
    done = subprocess.run([sys.executable, "-m", "minigpt", "--version"], capture_output=True, text=True, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, f"minigpt {PYPROJECT['project']['version']}"), done.stderr
    for argv in (["sample", "--attention", "flash"], ["help", "sample"]):
        done = subprocess.run([sys.executable, "-m", "minigpt", *argv], capture_output=True, text=True, check=False)
        assert "minigpt sample" in done.stdout + done.stderr and "sample.py" not in done.stdout + done.stderr, argv


@pytest.mark.parametrize("command", ["sample", "eval", "export", "attention"])
def test_flags_reach_the_command(command, tmp_path, capsys):
    """The flags after the command name are the command's (not sys.argv, not the name itself)."""
    args = ["--ckpt", str(tmp_path / "missing.ckpt")] + {
        "eval": ["--text", str(REPO / "README.md")],
        "export": ["--out", str(tmp_path / "hf")],
        "attention": ["--prompt", "x", "--out", str(tmp_path / "lab")],
    }.get(command, [])
    with pytest.raises(SystemExit) as exit_info:
        main([command, *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checkpoint not found" in err and "missing.ckpt" in err


# --------------------------------------------------------------------------------------------------- the default config


def test_the_shipped_default_config_is_configs_default_yaml():
    assert default_config().read_bytes() == (REPO / "configs" / "default.yaml").read_bytes()


@pytest.mark.parametrize("entry", ["train.py", "minigpt train"])
def test_print_config_from_another_folder_shows_the_default_config(entry, tmp_path, monkeypatch, capsys):
    """The default config is found through the package, not the current folder."""
    monkeypatch.chdir(tmp_path)
    run = train.main if entry == "train.py" else (lambda argv: main(["train", *argv]))
    with pytest.raises(SystemExit) as exit_info:
        run(["--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    shipped = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    assert shipped["model"]["n_layer"] != GPTConfig().n_layer  # else this test could not tell them apart
    for section in ("model", "optim", "data"):
        for key, value in shipped[section].items():
            assert printed[section][key] == value, (section, key)
    assert printed["trainer"]["max_steps"] == shipped["trainer"]["max_steps"]


@pytest.mark.parametrize("entry", ["train.py", "minigpt train"])
def test_a_missing_config_file_is_one_line_naming_it(entry, tmp_path, capsys):
    run = train.main if entry == "train.py" else (lambda argv: main(["train", *argv]))
    with pytest.raises(SystemExit) as exit_info:
        run(["--config", str(tmp_path / "missing.yaml")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "missing.yaml" in err


def test_a_wheel_installs_every_data_file_and_the_default_config(tmp_path):
    """A non-editable install (the wheel) carries the data files the package reads at run time, and the
    installed default_config() finds its default.yaml from any folder."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "minigpt", source / "minigpt", ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "wheel"),
            str(source),
        ],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("minigpt-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # every file the package holds besides its modules: the default config, the lab's assets, the chat page
    data = {p.relative_to(REPO).as_posix() for p in (REPO / "minigpt").rglob("*") if p.is_file() and p.suffix != ".py"}
    data = {name for name in data if "__pycache__" not in name}
    assert {"minigpt/configs/default.yaml", "minigpt/serve/static/index.html"} <= data and data <= names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "minigpt = minigpt.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    target = tmp_path / "installed"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert installed.returncode == 0, installed.stderr
    probe = (
        "import json, minigpt; from minigpt.configs import default_config; "
        "print(json.dumps([minigpt.__file__, str(default_config()), default_config().read_text()]))"
    )
    ran = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )
    assert ran.returncode == 0, ran.stderr
    package, config, text = json.loads(ran.stdout)
    assert Path(package).is_relative_to(target) and Path(config).is_relative_to(target)
    assert text == (REPO / "configs" / "default.yaml").read_text()


# --------------------------------------------------------------------------------------------------- start-up imports

IMPORTED = """
import json, sys
heavy = {heavy!r}
seen, found = set(), {{}}
for name in {modules!r}:
    __import__(name)
    now = {{m.split(".")[0] for m in sys.modules}} & set(heavy)
    found[name] = sorted(now - seen)
    seen |= now
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def heavy_imports() -> dict[str, list[str]]:
    """The heavy libraries each module brings in at import time (in one fresh interpreter, in this order)."""
    modules = [
        "minigpt",
        "minigpt.cli.main",
        "minigpt.cli.sample",
        "minigpt.cli.eval",
        "minigpt.cli.export",
        "minigpt.cli.attention",
        "minigpt.cli.train",
    ]
    ran = subprocess.run(
        [sys.executable, "-c", IMPORTED.format(heavy=HEAVY, modules=modules)], capture_output=True, text=True, cwd=REPO
    )
    assert ran.returncode == 0, ran.stderr
    return json.loads(ran.stdout)


def test_minigpt_and_the_inference_commands_import_no_lightning(heavy_imports):
    assert heavy_imports["minigpt.cli.train"] and "lightning" in heavy_imports["minigpt.cli.train"]  # it can see one
    for module in ("minigpt", "minigpt.cli.main", "minigpt.cli.sample", "minigpt.cli.eval", "minigpt.cli.export"):
        assert heavy_imports[module] == [], module
    assert not {"lightning", "pytorch_lightning", "datasets", "transformers"} & set(
        heavy_imports["minigpt.cli.attention"]
    )


def test_the_attention_command_imports_matplotlib_only_when_it_draws(heavy_imports):
    assert heavy_imports["minigpt.cli.attention"] == []


def python_c(code: str) -> str:
    """The stdout of `python -c code` in a fresh interpreter at the repository root (which must exit 0)."""
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert ran.returncode == 0, ran.stderr
    return ran.stdout


def test_import_minigpt_loads_torch_with_the_first_name_used_and_every_name_is_there():
    """`import minigpt` and the scripts' first import (minigpt.cli.main) load no torch, so a Ctrl-C while a command
    starts lands in its handling; each name of the API is the module's own, imported on first use."""
    code = (
        "import sys, minigpt\ncore = 'minigpt.core' in sys.modules\nimport minigpt.cli.main\n"
        "before = 'torch' in sys.modules\nnames = {n: getattr(minigpt, n).__module__ for n in minigpt.__all__}\n"
        "print(core, before, 'torch' in sys.modules, set(minigpt.__all__) <= set(dir(minigpt)))"
    )
    # minigpt.core (the bytecode cache, the start-up clock) comes with any minigpt import, before torch
    assert python_c(code).split() == ["True", "False", "True", "True"]
    from minigpt.core.model import GPT

    assert minigpt.GPT is GPT and sorted(minigpt.__all__) == sorted(minigpt.FACADE)
    with pytest.raises(AttributeError, match="no attribute 'gpt'"):
        minigpt.gpt  # noqa: B018


def test_ctrl_c_while_a_command_loads_is_its_one_line(monkeypatch, capsys):
    import minigpt.cli.main as cli_main

    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "load_command", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        cli_main.run_command("sample", [])
    assert exit_info.value.code == 130 and capsys.readouterr().err == "error: interrupted\n"


def test_minigpt_sample_imports_only_the_sample_command():
    code = (
        "import sys\nfrom minigpt.cli.main import main\ntry:\n    main(['sample', '--help'])\n"
        "except SystemExit:\n    pass\nprint(sorted(m for m in sys.modules if m.startswith('minigpt.cli.') "
        "or m.split('.')[0] in ('lightning', 'pytorch_lightning')))"
    )
    assert (
        python_c(code).splitlines()[-1]
        == "['minigpt.cli.errors', 'minigpt.cli.main', 'minigpt.cli.parsing', 'minigpt.cli.sample']"
    )


@pytest.mark.parametrize(
    "argv, code, line",
    [(["sample.py", "--help"], 0, "usage: sample.py"), (["eval.py", "--ckpt", "no/such/run"], 2, "error: ")],
)
def test_a_commands_exit_skips_the_collectors_passes_over_what_the_imports_made(argv, code, line):
    """At a command's exit the live objects are frozen out of the garbage collector's last passes (~0.4 s of every
    command's exit on a 2-core CPU, ~1.4 s of train.py's), whether it ended well or in a user error: none is left in
    the collector's generations (~1,600 to ~2,000 are without the exit's freeze).  The check is an atexit callback
    registered before the command's: it runs after the command's (last in, first out)."""
    check = "import atexit, gc; atexit.register(lambda: print('left to collect at exit:', len(gc.get_objects())))"
    script = f"{check}\nimport runpy, sys\nsys.argv = {argv!r}\nrunpy.run_path({argv[0]!r}, run_name='__main__')"
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert ran.returncode == code and line in ran.stdout + ran.stderr, ran.stderr
    last = ran.stdout.splitlines()[-1]
    assert last.startswith("left to collect at exit: ") and int(last.split()[-1]) < 200, last


PAUSED = """
import atexit, gc, importlib.abc, json, runpy, sys
watched, seen, frozen_at_collections = {watched!r}, {{}}, []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in watched and name not in seen:  # the module's import begins
            seen[name] = dict(collecting=gc.isenabled(), collections_before=len(frozen_at_collections))
counted = [False]
def collecting(phase, info):  # the frozen count at the first collection once every watched import began, None at
    # the others: get_freeze_count walks all ~750,000 frozen objects, and --help makes thousands of collections
    if phase == "start":
        first = len(seen) == len(watched) and not counted[0]
        counted[0] |= first
        frozen_at_collections.append(gc.get_freeze_count() if first else None)
gc.callbacks.append(collecting)
sys.meta_path.insert(0, Watch())
atexit.register(lambda: print(json.dumps(dict(seen=seen, frozen=frozen_at_collections, collecting=gc.isenabled()))))
sys.argv = {argv!r}
{launch}
"""
LAUNCHED = {  # how each is launched, and the heavy imports its command makes with the collector paused
    "train.py": ("runpy.run_path('train.py', run_name='__main__')", ["torch", "lightning"]),
    "sample.py": ("runpy.run_path('sample.py', run_name='__main__')", ["torch"]),
    "minigpt": ("from minigpt.cli.main import main\nmain()", ["lightning"]),  # the package imported torch first
}


@pytest.mark.parametrize("argv", [["train.py", "--help"], ["sample.py", "--help"], ["minigpt", "train", "--help"]])
def test_a_commands_imports_run_with_the_collector_paused_then_frozen_out_of_its_collections(argv):
    """The imports make objects that live as long as the process (~750,000 for train.py); a full collection every
    time they grew by a quarter took a quarter of train.py's imports on a 2-core CPU.  So they run with the collector
    paused, what they made is frozen, and the collector resumes for the command: it collects (a long training run or
    a server that never did would only grow), and its first collection already skips what the imports made."""
    launch, watched = LAUNCHED[argv[0]]
    code = PAUSED.format(watched=watched, argv=argv, launch=launch)
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert ran.returncode == 0 and ran.stdout.startswith("usage: "), ran.stderr[-2000:]
    report = json.loads(ran.stdout.splitlines()[-1])
    assert set(report["seen"]) == set(watched) and report["collecting"]
    for module, state in report["seen"].items():
        assert not state["collecting"], f"{module} was imported with the collector running"
    after_imports = report["frozen"][max(state["collections_before"] for state in report["seen"].values()) :]
    assert after_imports, "the collector never ran after the imports"
    assert after_imports[0] > 50_000, f"the first collection after the imports found {after_imports[0]} frozen objects"
