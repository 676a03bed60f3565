"""attention.py (minigpt.cli.attention): it writes every file, and a bad prompt or a missing checkpoint is one line,
exit 2, without a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

from minigpt.cli.attention import main as attention_main
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.tokenizers import CharTokenizer
from support import LAB_CHARS as CHARS
from support import LAB_PROMPT as PROMPT
from support import lab_model as random_model

REPO = Path(__file__).resolve().parents[2]  # the repository root


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run") / "checkpoints" / "best.ckpt"
    path.parent.mkdir(parents=True)
    save_file(model_checkpoint(random_model("llama", n_head=4, n_kv_head=2), CharTokenizer(CHARS)), path)
    return path


def test_attention_py_writes_every_file(ckpt, tmp_path, capsys):
    attention_main(["--ckpt", str(ckpt), "--prompt", PROMPT, "--out", str(tmp_path / "lab")])
    out = capsys.readouterr().out
    assert f"captured 2 layers x 4 heads over {len(PROMPT)} tokens" in out
    names = sorted(p.name for p in (tmp_path / "lab").iterdir())
    assert names == [
        "attention.html",
        "attention.npz",
        "attention_grid.png",
        "attention_layer0.png",
        "attention_layer1.png",
    ]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", ""], "the prompt is empty"),
        (["--prompt", "a" * 33], "the prompt is 33 tokens but the model reads at most block_size=32"),
        (["--prompt", "abcZ"], "1 character(s) outside the model's char vocabulary: 'Z'"),
        (["--prompt-file", "nonexistent.txt"], "prompt file not found"),
    ],
)
def test_bad_prompts_are_one_line_errors(ckpt, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        attention_main(["--ckpt", str(ckpt), "--out", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_missing_checkpoint_is_one_line_without_traceback(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "attention.py"), "--ckpt", str(tmp_path / "nope.ckpt"), "--prompt", "abc"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
