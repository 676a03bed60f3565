"""The `eval.py` command line: a checkpoint's exact loss on a text file, in nats/token and bits/char.

    python eval.py --ckpt out/default --text some.txt
    python eval.py --config eval.yaml                 # the same options from YAML (see --print_config)

The evaluation itself is minigpt.core.evaluate.evaluate_tokens; loading is minigpt.loading.load_model.  Every
user mistake (a bad flag, checkpoint or text file) ends in one `error:` line and exit code 2.
"""

from __future__ import annotations

import math
from pathlib import Path

from minigpt.loading import load_model
from minigpt.cli.parsing import CommandParser, add_source_argument, resolve_device
from minigpt.core.errors import UnknownCharactersError, UserError, run_cli, shown_chars
from minigpt.core.evaluate import evaluate_tokens


def build_parser() -> CommandParser:
    p = CommandParser(prog="eval.py", description="Evaluate a checkpoint on a text file: nats/token, bits/char.")
    add_source_argument(p)
    p.add_argument("--text", type=str, required=True, help="UTF-8 text file to evaluate on")
    p.add_argument("--batch_size", "--batch-size", type=int | None, default=None,
                   help="windows of block_size tokens evaluated at once (speed and memory, not the result); default "
                        "and upper bound: as many as keep the logits within 512 MiB")
    p.add_argument("--device", type=str, default="cpu", help="cpu, cuda, cuda:N, mps, or auto")
    return p


def read_text(path: Path) -> str:
    if not path.is_file():
        raise UserError(f"text file not found: {path}; pass an existing --text file")
    try:
        return path.read_text(encoding="utf-8", errors="strict")
    except UnicodeDecodeError as e:
        raise UserError(f"--text {path} is not UTF-8 text (byte {e.start}: {e.reason}); pass a UTF-8 file") from None
    except OSError as e:
        raise UserError(f"cannot read --text {path}: {type(e).__name__}") from None


def run(argv: list[str] | None = None) -> tuple[float, int]:
    """eval.py without the one-line error handling: prints the result line, returns (total nats, tokens)."""
    args = build_parser().parse_args(argv)
    if args.batch_size is not None and args.batch_size < 1:
        raise UserError(f"--batch_size must be >= 1, got {args.batch_size}")
    device = resolve_device(args.device)
    path = Path(args.text)
    text = read_text(path)
    model, tokenizer = load_model(args.ckpt, device=device)
    try:
        tokens = tokenizer.encode(text)
    except UnknownCharactersError as e:
        raise UserError(f"--text {path} has {len(e.chars)} character(s) outside the model's char vocabulary: "
                        f"{shown_chars(e.chars)}; a char-level model can only score text made of its training "
                        "text's characters") from None
    nats, n = evaluate_tokens(model, tokens, args.batch_size)
    # bits per character counts every character after the first token's, the ones that were predicted
    predicted_chars = max(1, len(text) - len(tokenizer.decode(tokens[:1])))
    print(f"{path}: {n:,} tokens, {nats / n:.4f} nats/token, {nats / math.log(2) / predicted_chars:.4f} bits/char",
          flush=True)
    return nats, n


def main(argv: list[str] | None = None) -> None:
    """eval.py: user mistakes end in one 'error:' line and exit code 2."""
    run_cli(lambda: run(argv))
