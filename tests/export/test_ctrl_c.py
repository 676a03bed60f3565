"""Ctrl-C at every point of an export, in a real process (tests/export/ctrl_c.py: a SIGINT the process sends itself
at a chosen point, no timing): never a traceback and never a silent kill.  Before the final rename: exit 130, a line
saying the export was not completed, the old export (or nothing) as it was.  After it, and while the result line is
printed: exit 130 and a line saying the export is complete, which it is (its SHA-256 record holds), with nothing
left beside it.  While the interpreter exits: ignored, exit 0.  (peft, whose base is written first: test_peft.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.config import GPTConfig
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.export.folder import check_previous_export
from minigpt.export.gguf import export_gguf
from minigpt.export.gguf_file import check_previous_gguf
from minigpt.export.hf import export_hf

sys.path.insert(0, str(Path(__file__).parent))
from ctrl_c import POINTS, export_with_ctrl_c

pytest.importorskip("gguf")
TINY = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=256)


def tiny_model(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**TINY)).eval()


def snapshot(path: Path) -> dict[str, bytes] | bytes | None:
    if path.is_dir():
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    return path.read_bytes() if path.exists() else None


@pytest.mark.parametrize("previous", [False, True], ids=["new", "overwrite"])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_ctrl_c_at_any_point_says_whether_the_export_is_complete(fmt, point, previous, tmp_path):
    save_file(model_checkpoint(tiny_model(1), ByteTokenizer()), tmp_path / "model.ckpt")
    out = tmp_path / "exports" / ("model.gguf" if fmt == "gguf" else "hf")
    if previous:
        (export_gguf if fmt == "gguf" else export_hf)(tiny_model(2), ByteTokenizer(), out)
    before = snapshot(out)
    argv = ["--ckpt", str(tmp_path / "model.ckpt"), "--out", str(out), "--format", fmt]
    proc = export_with_ctrl_c(point, out, *argv, *(["--overwrite"] if previous else []))
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr
    if point == "before the final rename":
        assert (proc.returncode, proc.stderr) == (
            130,
            f"error: interrupted before the export was complete; {out} as it was\n",
        )
        assert snapshot(out) == before
    else:
        complete = f"interrupted after the export was complete: it is in {out}\n"
        assert (proc.returncode, proc.stderr) == ((0, "") if point == "during the exit" else (130, complete))
        assert proc.stdout.startswith("wrote ") == (point != "after the final rename")
        check_previous_gguf(out) if fmt == "gguf" else check_previous_export(out)  # whole, and ours
        assert snapshot(out) != before
    leftovers = sorted(p.name for p in out.parent.iterdir()) if out.parent.exists() else []
    assert leftovers == ([out.name] if before is not None or point != "before the final rename" else [])


def test_a_finished_minigpt_export_ignores_ctrl_c_while_it_exits(tmp_path):
    """`minigpt export`, whether it exported or refused: the line it ends with, its exit code, no traceback."""
    save_file(model_checkpoint(tiny_model(1), ByteTokenizer()), tmp_path / "model.ckpt")
    out = tmp_path / "model.gguf"
    proc = export_with_ctrl_c("during the exit", out, "minigpt", "--ckpt", str(tmp_path / "model.ckpt"), "--format")
    assert (proc.returncode, proc.stderr.count("\n")) == (2, 1) and "--format" in proc.stderr  # a mistake: its line
    argv = ["minigpt", "--ckpt", str(tmp_path / "model.ckpt"), "--format", "gguf", "--out", str(out)]
    proc = export_with_ctrl_c("during the exit", out, *argv)
    assert (proc.returncode, proc.stderr) == (0, "") and proc.stdout.startswith("wrote gpt2 GGUF")
    check_previous_gguf(out)
