"""The `attention.py` command line: run a prompt through a checkpoint, write the attention lab's files.

    python attention.py --ckpt out/default --prompt "def forward(self, x):"
    python attention.py --prompt-file prompt.txt --out figures/attention
    echo "text" | python attention.py --prompt -

Writes into --out (default out/attention): attention.html (open it in a browser, no network needed),
attention_grid.png and attention_layer{N}.png (matplotlib), attention.npz (raw weights, tokens, config).
Every user mistake (a bad flag, checkpoint or prompt) ends in one `error:` line and exit code 2.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

from minigpt.cli.errors import run_cli
from minigpt.cli.parsing import (
    CommandParser,
    add_prompt_arguments,
    add_source_argument,
    checkpoint_lines,
    read_prompt,
    show_checkpoint_lines,
    utf8_stdin,
)
from minigpt.core.devices import resolve_device
from minigpt.core.errors import UserError
from minigpt.core.seed import check_seed
from minigpt.lab.capture import capture_attention, save_npz
from minigpt.lab.html import write_html
from minigpt.loading import load_model

DEFAULT_OUT = "out/attention"


def build_parser() -> CommandParser:
    p = CommandParser(
        prog="attention.py",
        description="Look at every attention head of a minigpt checkpoint "
        "on one prompt: an offline HTML page, PNG figures and the raw weights.",
    )
    add_source_argument(p)
    add_prompt_arguments(p, "the text to look at")
    p.add_argument("--out", type=str, default=DEFAULT_OUT, help="folder for the files (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="draws the random sequence of the induction score")
    p.add_argument("--device", type=str, default="cpu", help="cpu, cuda, cuda:N, mps, or auto")
    return p


def _main(argv: list[str] | None, stdout: TextIO, stdin: TextIO) -> None:
    args = build_parser().parse_args(argv)
    check_seed(args.seed)
    device = resolve_device(args.device)
    prompt = read_prompt(args, stdin)  # an empty one is refused by the lab (lab_prompt_ids)
    out = Path(args.out)
    if not args.out.strip():  # an unset shell variable: never the current directory
        raise UserError(f"--out is empty; give the folder to write, e.g. --out {DEFAULT_OUT}")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a folder")
    model, tokenizer = load_model(args.ckpt, device=device)
    start = time.perf_counter()
    capture = capture_attention(model, tokenizer, prompt, seed=args.seed)
    show_checkpoint_lines()
    seconds = time.perf_counter() - start
    try:
        out.mkdir(parents=True, exist_ok=True)
        title = f"{len(capture.tokens)} tokens"
        paths = [write_html(capture, out / "attention.html"), save_npz(capture, out / "attention.npz")]
        from minigpt.lab.figures import save_figures  # matplotlib: ~0.7 s, paid only when figures are drawn

        paths += save_figures(capture.weights, capture.tokens, out, title=f"attention, {title}")
    except OSError as e:
        raise UserError(
            f"cannot write to --out {out} ({e.strerror or type(e).__name__}); choose a writable folder"
        ) from None
    stdout.write(
        f"captured {capture.n_layer} layers x {capture.n_head} heads over {len(capture.tokens)} tokens "
        f"in {seconds:.2f}s\n"
    )
    for path in paths:
        stdout.write(f"wrote {path}\n")
    stdout.flush()


def main(argv: list[str] | None = None, stdout: TextIO | None = None, stdin: TextIO | None = None) -> None:
    """attention.py: user mistakes (bad flags, checkpoint or prompt) end in one 'error:' line, exit code 2."""
    with checkpoint_lines():
        run_cli(
            lambda: _main(
                argv, stdout if stdout is not None else sys.stdout, stdin if stdin is not None else utf8_stdin()
            )
        )
