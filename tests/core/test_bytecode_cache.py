"""Compiled modules cached in the user's cache folder where the environment keeps none (minigpt/core/bytecode_cache.py):
an image built without .pyc files and run with PYTHONDONTWRITEBYTECODE=1 compiles every import at every launch."""

import compileall
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minigpt.core import bytecode_cache


@pytest.fixture
def image(tmp_path, monkeypatch):
    """An installed package with no .pyc files, in a process that may not write them (as in such an image), a cache
    folder of its own; sys's and the environment's settings are restored after the test."""
    site = tmp_path / "site"
    (site / "nopyc_pkg").mkdir(parents=True)
    (site / "nopyc_pkg" / "__init__.py").write_text("")
    (site / "nopyc_pkg" / "mod.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.delenv(bytecode_cache.ENV, raising=False)
    for name in ("nopyc_pkg", "nopyc_pkg.mod"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return site


def test_uncached_environment_compiles_into_the_users_cache_once(image, tmp_path):
    folder = bytecode_cache.keep_bytecode("nopyc_pkg")
    assert folder == tmp_path / "cache" / "minigpt" / "pycache"
    import nopyc_pkg.mod  # noqa: F401 -- this import writes its .pyc

    source = image / "nopyc_pkg" / "mod.py"
    written = list(folder.rglob("mod.*.pyc"))
    assert [p.parent for p in written] == [folder / source.parent.relative_to("/")], "the .pyc mirrors the source path"
    assert not list(image.rglob("*.pyc")), "the environment's own folders are left as they were"

    # The next launch, and every process this one starts, inherits the setting and reads the .pyc instead of compiling
    env = dict(os.environ, PYTHONPATH=str(image))
    command = [sys.executable, "-v", "-c", "import nopyc_pkg.mod"]
    child = subprocess.run(command, env=env, capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    assert f"code object from '{written[0]}'" in child.stderr


def test_environment_with_compiled_modules_is_left_alone(image):
    compileall.compile_dir(image, quiet=1)  # as pip leaves an install
    assert bytecode_cache.keep_bytecode("nopyc_pkg") is None
    assert sys.pycache_prefix is None and sys.dont_write_bytecode


@pytest.mark.parametrize("setting", ["user's prefix", "turned off", "no such module"])
def test_users_choice_is_kept(image, tmp_path, monkeypatch, setting):
    sentinel = "nopyc_pkg"
    if setting == "user's prefix":
        monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "mine"))
    elif setting == "turned off":
        monkeypatch.setenv(bytecode_cache.ENV, "0")
    else:
        sentinel = "no_such_module_here"
    before = sys.pycache_prefix
    assert bytecode_cache.keep_bytecode(sentinel) is None
    assert sys.pycache_prefix == before and sys.dont_write_bytecode
    assert not Path(tmp_path / "cache").exists()
