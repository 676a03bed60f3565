"""export.py in a child process that sends itself SIGINT, as a Ctrl-C would, at one chosen point of the export:
no timing, each point is reached by a hook on the function that runs there.  Shared by the export tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
POINTS = ("before the final rename", "after the final rename", "while the result line is printed", "during the exit")
CHILD = r"""
import atexit, builtins, os, runpy, signal, sys
from pathlib import Path
import minigpt.cli.export as cli, minigpt.export.folder as folder, minigpt.export.gguf_file as gguf_file
import minigpt.export.hf as hf

point, out = sys.argv[1], Path(sys.argv[2]).resolve()
signal.signal(signal.SIGINT, signal.default_int_handler)  # a suite started in the background inherits SIG_IGN
ctrl_c = lambda: os.kill(os.getpid(), signal.SIGINT)  # raised as KeyboardInterrupt right as os.kill returns

def after(module, name, when=lambda *args: True):
    real = getattr(module, name, None) or getattr(builtins, name)  # print: the builtin, shadowed in the module
    pressed = []
    def hooked(*args, **kwargs):  # one Ctrl-C, the first time `when` holds
        result = real(*args, **kwargs)
        if when(*args) and not pressed:
            pressed.append(True)
            ctrl_c()
        return result
    setattr(module, name, hooked)

if point == "before the final rename":  # the file sealed, the folder's manifest written: not yet in place
    after(gguf_file, "seal")
    after(hf, "seal_export", lambda folder_, *a: folder_.parent == out.parent)
elif point == "after the final rename":  # the directory entry made durable, right after the rename
    after(gguf_file, "fsync_dir", lambda path: Path(path) == out.parent)
    after(folder, "fsync_dir", lambda path: Path(path) == out.parent)
elif point == "while the result line is printed":
    after(cli, "print")
elif point == "during the exit":  # an atexit callback: the interpreter is exiting
    atexit.register(ctrl_c)
if sys.argv[3] == "minigpt":  # the installed console script's entry point
    from minigpt.cli.main import main
    sys.argv = ["minigpt", "export", *sys.argv[4:]]
    main()
else:
    sys.argv = ["export.py", *sys.argv[3:]]
    runpy.run_path("export.py", run_name="__main__")
"""


def export_with_ctrl_c(point: str, out: Path, *argv: str) -> subprocess.CompletedProcess:
    """`python export.py ARGV` (whose output is `out`) with a Ctrl-C at `point` (one of POINTS); ARGV starting with
    "minigpt": `minigpt export ARGV[1:]`."""
    assert point in POINTS
    return subprocess.run(
        [sys.executable, "-c", CHILD, point, str(out), *argv],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
