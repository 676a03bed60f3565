"""The .gguf file written whole or not at all (minigpt.export.gguf_file): an existing file is replaced only with
--overwrite and only when it is a GGUF file minigpt wrote and nobody changed; a full disk or Ctrl-C leaves the old
file as it was and no temporary file; a killed export's leftover is removed by the next.  A full disk, a file-size
limit and a read-only folder are one line each (numpy's short write included), the last saying it is read-only."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minigpt.core.errors import UserError
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.export.gguf import export_gguf

sys.path.insert(0, str(Path(__file__).parent))
from gguf_models import random_model

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is as fast


def test_an_existing_out_is_replaced_only_with_overwrite_and_only_an_unchanged_export(tmp_path):
    out = tmp_path / "model.gguf"
    out.write_text("my notes")
    first, second = random_model(seed=1), random_model(seed=2)
    with pytest.raises(UserError, match="model.gguf already exists; choose another output file, or pass --overwrite"):
        export_gguf(first, ByteTokenizer(), out)
    with pytest.raises(UserError, match="is not a GGUF file export.py wrote .* so --overwrite would replace it"):
        export_gguf(first, ByteTokenizer(), out, overwrite=True)
    assert out.read_text() == "my notes"

    out.unlink()
    export_gguf(first, ByteTokenizer(), out)
    written = out.read_bytes()
    with pytest.raises(UserError, match="already exists"):
        export_gguf(second, ByteTokenizer(), out)
    export_gguf(second, ByteTokenizer(), out, overwrite=True)  # an unchanged export: replaced
    assert out.read_bytes() != written and [p.name for p in tmp_path.iterdir()] == ["model.gguf"]

    data = bytearray(out.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    out.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"was changed after export.py wrote it \(its SHA-256 differs"):
        export_gguf(first, ByteTokenizer(), out, overwrite=True)
    assert out.read_bytes() == bytes(data)
    (tmp_path / "link.gguf").symlink_to(out)
    with pytest.raises(UserError, match="link.gguf is a symbolic link, not a GGUF file export.py wrote"):
        export_gguf(first, ByteTokenizer(), tmp_path / "link.gguf", overwrite=True)


@pytest.mark.parametrize(
    "failure, error", [(OSError(28, "No space left on device"), UserError), (KeyboardInterrupt(), KeyboardInterrupt)]
)
def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(failure, error, tmp_path, monkeypatch):
    out = tmp_path / "model.gguf"
    export_gguf(random_model(seed=1), ByteTokenizer(), out)
    before = out.read_bytes()

    def fail_midway(self, *args, **kwargs):
        Path(self.fout[0].name).write_bytes(b"half a file")
        raise failure

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail_midway)
    with pytest.raises(error) as e:
        export_gguf(random_model(seed=2), ByteTokenizer(), out, overwrite=True)
    if error is UserError:
        assert str(e.value).startswith(f"cannot write {out} (No space left on device); free space there")
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["model.gguf"]
    with pytest.raises(error):
        export_gguf(random_model(seed=2), ByteTokenizer(), tmp_path / "new" / "model.gguf")
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]  # nor the folder it created


def test_a_killed_exports_leftover_is_removed_by_the_next(tmp_path):
    leftover = tmp_path / ".model.gguf.tmp-999999999"  # a process id that is not running
    leftover.write_bytes(b"half a file")
    export_gguf(random_model(), ByteTokenizer(), tmp_path / "model.gguf")
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


# ------------------------------------------------------------------------------------------ full and read-only disks

REPO = Path(__file__).resolve().parents[2]
# in the child: export.py as from a shell, under a file-size limit (`ulimit -f` with SIGXFSZ ignored, as `trap ''
# XFSZ`): numpy's tofile, which gguf-py writes tensors with, stops short and raises an OSError without errno
CHILD = r"""
import contextlib, io, json, resource, runpy, signal, sys
results = []

def export_py(*argv):
    sys.argv, err = ["export.py", *argv], io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path("export.py", run_name="__main__"); code = 0
        except SystemExit as e:
            code = e.code
    results.append([code, err.getvalue()])

ckpt, out, new = sys.argv[1:4]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
export_py("--ckpt", ckpt, "--format", "gguf", "--out", out, "--overwrite")
export_py("--ckpt", ckpt, "--format", "gguf", "--out", new)
print(json.dumps(results))
"""


def test_a_short_write_under_a_file_size_limit_is_one_line_and_keeps_the_old_file(tmp_path):
    from minigpt.core.checkpoint import model_checkpoint, save_file

    out, new = tmp_path / "out" / "model.gguf", tmp_path / "new" / "model.gguf"
    export_gguf(random_model(seed=1), ByteTokenizer(), out)
    before = out.read_bytes()
    save_file(model_checkpoint(random_model(seed=2), ByteTokenizer()), tmp_path / "model.ckpt")  # ~500 KB of f32
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "model.ckpt"), str(out), str(new)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    fix = "free space there or choose another output folder"
    assert json.loads(proc.stdout.splitlines()[-1]) == [
        [2, f"error: cannot write {out} (File too large); {fix}\n"],
        [2, f"error: cannot write {new} (File too large); {fix}\n"],
    ]
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt", "out"]
    assert [p.name for p in out.parent.iterdir()] == ["model.gguf"]  # no temporary file


def test_a_short_write_whose_cause_is_gone_keeps_its_traceback_and_leaves_nothing(tmp_path, monkeypatch):
    def short_write(self, *args, **kwargs):
        Path(self.fout[0].name).write_bytes(b"half a file")
        raise OSError("65536 requested and 184 written")  # numpy's words; the disk has room again

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", short_write)
    with pytest.raises(OSError, match="65536 requested and 184 written"):
        export_gguf(random_model(), ByteTokenizer(), tmp_path / "new" / "model.gguf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "failure, why",
    [
        (OSError(errno.EROFS, "Read-only file system"), "(Read-only file system); the folder is read-only; choose"),
        (PermissionError(errno.EACCES, "Permission denied"), "(Permission denied); the folder is read-only to this"),
    ],
    ids=["read-only file system", "no write permission"],
)
def test_a_read_only_folder_is_named_read_only(failure, why, tmp_path, monkeypatch):
    """As root a chmod stops nothing: the file system's answer is injected where the file is opened (the real
    read-only mount: test_a_full_and_a_read_only_file_system_are_one_line)."""

    def refuse(self, *args, **kwargs):
        raise failure

    monkeypatch.setattr(gguf.GGUFWriter, "open_output_file", refuse)
    with pytest.raises(UserError) as e:
        export_gguf(random_model(), ByteTokenizer(), tmp_path / "model.gguf")
    assert str(e.value).startswith(f"cannot write {tmp_path / 'model.gguf'} {why}") and "free space" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


# in a private mount namespace (gone with the process): a 256 KiB tmpfs, filled by the export, then the same
# file system mounted read-only; export.py as a user runs it, GGUF and Hugging Face
MOUNTED = r"""
set -e
mount -t tmpfs -o size=256k tmpfs "$1"
mkdir "$1/old" && cp "$2" "$1/old/model.gguf"
for out in "$1/old/model.gguf" "$1/new/model.gguf"; do
    python3 export.py --ckpt "$3" --format gguf --out "$out" --overwrite 2>&1 >/dev/null || echo "exit $?"
done
python3 export.py --ckpt "$3" --out "$1/hf" 2>&1 >/dev/null || echo "exit $?"
ls -A "$1" "$1/old"
cmp "$2" "$1/old/model.gguf" && echo unchanged
mount -o remount,ro "$1"
python3 export.py --ckpt "$3" --format gguf --out "$1/new/model.gguf" 2>&1 >/dev/null || echo "exit $?"
python3 export.py --ckpt "$3" --out "$1/hf" 2>&1 >/dev/null || echo "exit $?"
"""


def test_a_full_and_a_read_only_file_system_are_one_line(tmp_path):
    """A real tmpfs, full and then read-only (skipped where this process may not mount one)."""
    from minigpt.core.checkpoint import model_checkpoint, save_file

    probe = subprocess.run(["unshare", "-m", "mount", "-t", "tmpfs", "tmpfs", str(tmp_path)], capture_output=True)
    if probe.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.decode().strip()}")
    small = random_model(seed=1, n_layer=1, n_embd=32)  # ~100 KB: the tmpfs holds it, not the new ~500 KB
    export_gguf(small, ByteTokenizer(), tmp_path / "previous.gguf")
    save_file(model_checkpoint(random_model(seed=2), ByteTokenizer()), tmp_path / "model.ckpt")
    (tmp_path / "mnt").mkdir()
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", MOUNTED, "sh", str(tmp_path / "mnt"), str(tmp_path / "previous.gguf")]
        + [str(tmp_path / "model.ckpt")],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    mnt, full = tmp_path / "mnt", "(No space left on device); free space there or choose another output folder"
    read_only = "(Read-only file system); the folder is read-only; choose another output folder"
    assert proc.stdout.splitlines() == [
        f"error: cannot write {mnt / 'old' / 'model.gguf'} {full}",
        "exit 2",
        f"error: cannot write {mnt / 'new' / 'model.gguf'} {full}",
        "exit 2",
        f"error: cannot write {mnt / 'hf'} {full}",
        "exit 2",
        f"{mnt}:",  # nothing but the old export, unchanged
        "old",
        "",
        f"{mnt / 'old'}:",
        "model.gguf",
        "unchanged",
        f"error: cannot write {mnt / 'new' / 'model.gguf'} {read_only}",
        "exit 2",
        f"error: cannot write {mnt / 'hf'} {read_only}",
        "exit 2",
    ], proc.stderr
