"""What differs on Windows, checked on Linux by giving the code Windows' answers: folders that os.open refuses,
open files that cannot be removed, os.kill's signal 0 (CTRL_C_EVENT there), no SIGPIPE, MSVC's cl."""

import errno
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from minigpt.core import compiled, fsutil

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def windows(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")

    def no_kill(pid, sig):
        raise AssertionError(f"os.kill({pid}, {sig}) on Windows: signal 0 is CTRL_C_EVENT there")

    monkeypatch.setattr(os, "kill", no_kill)


def test_atomic_write_on_windows_flushes_no_folder(windows, monkeypatch, tmp_path):
    """Windows' os.open refuses a folder (PermissionError): every checkpoint save and data preparation failed,
    the preparation as `error: cannot write prepared data in data (Permission denied)`."""
    real_open = os.open

    def windows_open(path, flags, *args, **kwargs):
        if os.path.isdir(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", windows_open)
    fsutil.atomic_write(tmp_path / "x.bin", lambda f: f.write(b"abc"))
    assert (tmp_path / "x.bin").read_bytes() == b"abc"


def test_pid_alive_on_windows_asks_the_process_not_os_kill(windows, monkeypatch):
    """os.kill(pid, 0) on Windows sends Ctrl-C to the console, or raises OSError (WinError 87) for a pid that is
    gone: remove_stale then failed with a traceback wherever a killed writer had left a temporary file."""
    exited, running, denied = 11, 12, 13

    def open_process(access, inherit, pid):
        if pid in (running, exited):
            return pid
        error = OSError(errno.EINVAL if pid != denied else errno.EACCES, "...")
        error.winerror = 5 if pid == denied else 87
        raise error

    waits = {exited: 0, running: 0x102}  # WAIT_OBJECT_0, WAIT_TIMEOUT
    closed = []
    fake = types.SimpleNamespace(
        OpenProcess=open_process, WaitForSingleObject=lambda h, ms: waits[h], CloseHandle=closed.append
    )
    monkeypatch.setitem(sys.modules, "_winapi", fake)
    assert fsutil.pid_alive(running) and fsutil.pid_alive(denied)
    assert not fsutil.pid_alive(exited) and not fsutil.pid_alive(99999)
    assert sorted(closed) == [exited, running]


def test_run_lock_closes_where_an_open_file_cannot_be_removed(monkeypatch, tmp_path):
    """Windows refuses to remove the lock file while filelock holds it open (a sharing violation): every train.py
    ended in a PermissionError traceback and exit 1 after its run had finished."""
    from minigpt.training.run_dir import LOCK_FILE, RunLock

    lock = RunLock(tmp_path)
    real_unlink = Path.unlink

    def windows_unlink(self, missing_ok=False):
        if self.name == LOCK_FILE and lock.lock.is_locked:
            raise PermissionError(errno.EACCES, "being used by another process", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", windows_unlink)
    lock.close()
    assert not lock.lock.is_locked
    RunLock(tmp_path).close()  # free for the next run


def test_a_closed_pipe_without_sigpipe_exits_quietly():
    """Windows has no signal.SIGPIPE: `sample.py ... | more` that stops reading ended in an AttributeError."""
    code = (
        "import signal; del signal.SIGPIPE\n"
        "from minigpt.cli.errors import run_cli\n"
        "def main():\n    raise BrokenPipeError\n"
        "run_cli(main)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 141 and result.stderr == "", result.stderr


def test_the_cpu_compiler_on_windows_is_msvc(monkeypatch):
    """Inductor runs $CXX, else cl on Windows: looking for g++ there refused torch.compile with a compiler on PATH
    (or let it fail mid-run with only MinGW's g++), and told a Windows user to `apt-get install g++`."""
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(sys, "platform", "win32")
    assert compiled.cpp_compiler() == "cl"
    assert "'cl' was not found" in compiled.no_cpp_compiler() and "apt-get" not in compiled.no_cpp_compiler()


def test_a_piped_prompt_is_read_as_utf8_whatever_the_locale(tmp_path):
    """Windows decodes a pipe or a file on stdin in its ANSI code page (cp1252): `sample.py --prompt - < prompt.txt`
    read a UTF-8 "é" as "Ã©", refused by a char model and silently garbled for a BPE one."""
    from minigpt.core.checkpoint import model_checkpoint, save_file
    from minigpt.core.tokenizers import CharTokenizer
    from support import varied_gpt

    ckpt = tmp_path / "run.ckpt"
    save_file(model_checkpoint(varied_gpt("gpt", 2, vocab_size=6), CharTokenizer("abcé\n ")), ckpt)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "cp1252", "OMP_NUM_THREADS": "1"}
    args = ["--ckpt", str(ckpt), "--prompt", "-", "--max_new_tokens", "0"]
    result = subprocess.run(
        [sys.executable, str(REPO / "sample.py"), *args], input="é".encode(), capture_output=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr.decode("cp1252")
    assert result.stdout.decode("cp1252") == "é\n"
