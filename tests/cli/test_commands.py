"""What the commands share (issue 40): standard input closed, not UTF-8 or typed with Windows line endings; a run
an --overwrite set aside when it was killed, found by every reader; a run stopped by its time budget saying so;
usage lines naming `minigpt COMMAND`.  Every input is built here, on the fly."""

from __future__ import annotations

import io
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from minigpt.cli import attention as attention_cli
from minigpt.cli import eval as eval_cli
from minigpt.cli import export as export_cli
from minigpt.cli import sample as sample_cli
from minigpt.cli import train as train_cli
from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.checkpoint import find_checkpoint, model_checkpoint, save_file
from minigpt.core.tokenizers import CharTokenizer
from support import varied_gpt

REPO = Path(__file__).resolve().parents[2]
CHARS = "\n !',.:;?abcdefghijklmnopqrstuvwxyz0123456789"
pytestmark = pytest.mark.usefixtures("one_thread")


def write_run(run: Path, tokenizer, vocab_size: int) -> Path:
    (run / "checkpoints").mkdir(parents=True)
    save_file(
        model_checkpoint(varied_gpt("gpt", vocab_size=vocab_size, block_size=64), tokenizer),
        run / "checkpoints" / "last.ckpt",
    )
    return run


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> Path:
    tokenizer = ChatTokenizer.for_base(CharTokenizer(CHARS))
    return write_run(tmp_path_factory.mktemp("chat") / "run", tokenizer, tokenizer.vocab_size)


def one_error(capsys, run) -> str:
    with pytest.raises(SystemExit) as e:
        run()
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if x.strip()]
    return line


# ------------------------------------------------------------------------------------------- standard input


def test_chat_turns_piped_with_windows_line_endings_are_read_as_typed(chat_run, capsys):
    """The "\\r" of "\\r\\n" stayed in each turn, and a char model refused it as a character it does not know."""
    out = io.StringIO()
    sample_cli.main(
        ["--ckpt", str(chat_run), "--chat", "--temperature", "0", "--max_new_tokens", "4"],
        stdout=out,
        stdin=io.StringIO("what is 1 and 2?\r\n\r\nand 3 and 4?\r\n"),
    )
    assert len(out.getvalue().splitlines()) == 2 and "error" not in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--chat"], ["--prompt", "-", "--no-stop"]])
def test_closed_or_unreadable_standard_input_is_an_empty_prompt(chat_run, monkeypatch, flags):
    """`sample.py --prompt - <&-` gave sys.stdin = None and an AttributeError; a closed stream raises on read."""
    closed = io.StringIO("never read")
    closed.close()
    for stdin in (None, closed):
        monkeypatch.setattr(sys, "stdin", stdin)
        out = io.StringIO()
        sample_cli.main(["--ckpt", str(chat_run), "--max_new_tokens", "3", *flags], stdout=out)
        assert out.getvalue() == "" if flags == ["--chat"] else len(out.getvalue()) > 0  # no turns / from nothing


def test_standard_input_that_is_not_utf8_is_one_line(chat_run, capsys):
    line = one_error(
        capsys,
        lambda: sample_cli.main(
            ["--ckpt", str(chat_run), "--prompt", "-"], stdout=io.StringIO(), stdin=io.StringIO("what \udcff")
        ),
    )
    assert line.startswith("error: standard input is not UTF-8 text")  # (Python reads bad bytes as surrogates)


# ------------------------------------------------------------------------------------------- a hidden run


def test_a_run_set_aside_by_a_killed_overwrite_is_found_by_every_reader(tmp_path, capsys):
    """An --overwrite killed before its first checkpoint left the run in .checkpoints.old-PID: train.py put it back,
    but sample, eval, export and attention said "no checkpoint in run directory" until someone trained again."""
    run = write_run(tmp_path / "run", CharTokenizer(CHARS), len(CHARS))
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, signal, sys; from pathlib import Path; "
            "from minigpt.training.run_dir import replacing\n"
            "with replacing(Path(sys.argv[1]), True): os.kill(os.getpid(), signal.SIGKILL)",
            str(run),
        ],
        cwd=REPO,
    )
    assert killed.returncode == -9 and not (run / "checkpoints" / "last.ckpt").exists()
    aside = find_checkpoint(run)
    assert aside.parent.parent.name.startswith(".checkpoints.old-") and aside.name == "last.ckpt"
    assert find_checkpoint(None, out_root=tmp_path) == aside  # "the newest run under out/" too

    (tmp_path / "text.txt").write_text("the cat sat on the mat.\n" * 20)
    out = io.StringIO()
    sample_cli.main(["--ckpt", str(run), "--prompt", "the", "--max_new_tokens", "3"], stdout=out)
    assert out.getvalue().startswith("the")
    eval_cli.main(["--ckpt", str(run), "--text", str(tmp_path / "text.txt")])
    export_cli.main(["--ckpt", str(run), "--out", str(tmp_path / "export")])
    attention_cli.main(
        ["--ckpt", str(run), "--prompt", "the cat", "--out", str(tmp_path / "lab")], stdout=io.StringIO()
    )
    assert "nats/token" in capsys.readouterr().out and (tmp_path / "export" / "config.json").is_file()


# ------------------------------------------------------------------------------------------- train.py output


def test_a_run_ended_by_max_time_says_so_and_lightning_warns_nothing(
    tiny_run_args, corpus, data_root, tmp_path, capsys
):
    """The README's SFT demo stopped after 131 of its 2,000 steps with nothing on screen saying why."""
    argv = tiny_run_args(
        corpus,
        data_root,
        tmp_path / "run",
        steps=1_000_000,
        trainer__max_time="00:00:00:01",
        trainer__val_check_interval=1_000_000,
        checkpoint_every=1_000_000,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train_cli.main(argv)
    out = capsys.readouterr().out
    assert f"after {trainer.global_step} steps" in out and "estimated val loss" in out  # the 2-batch estimate
    assert out.rstrip().endswith(f"stopped by max_time (00:00:00:01) after {trainer.global_step:,} of 1,000,000 steps")
    assert not [w for w in caught if "LeafSpec" in str(w.message)]  # Lightning's deprecated tree leaf, at its cause


MAINS = {
    "train": train_cli.main,
    "sample": sample_cli.main,
    "eval": eval_cli.main,
    "export": export_cli.main,
    "attention": attention_cli.main,
}


@pytest.mark.parametrize("command", MAINS)
def test_usage_names_the_command_as_it_was_run(monkeypatch, capsys, command):
    """`minigpt train --help` said `usage: train.py`."""
    for argv0, usage in [
        ("/usr/local/bin/minigpt", f"usage: minigpt {command} "),
        (f"{command}.py", f"usage: {command}.py "),
    ]:
        monkeypatch.setattr(sys, "argv", [argv0, *([command] if "minigpt" in argv0 else []), "--help"])
        with pytest.raises(SystemExit) as e:
            MAINS[command](["--help"])
        assert e.value.code == 0 and capsys.readouterr().out.startswith(usage)
