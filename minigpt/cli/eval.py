"""The `eval.py` command line: a checkpoint's exact loss on a text file, in nats/token and bits/char, or the
lm-evaluation-harness's tasks on it.

    python eval.py --ckpt out/default --text some.txt
    python eval.py --ckpt hf:openai-community/gpt2 --tasks hellaswag,arc_easy --limit 100 --output results.json
    python eval.py --config eval.yaml                 # the same options from YAML (see --print_config)

The loss is minigpt.evaluation.loss.evaluate_tokens; the tasks run in process through
minigpt.evaluation.harness (the `eval` extra, imported only for --tasks); loading is
minigpt.loading.load_model.  Every user mistake (a bad flag, checkpoint, text file or task) ends in one
`error:` line and exit code 2.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

from minigpt.cli.errors import run_cli
from minigpt.cli.parsing import (
    QUANTIZE_CHOICES,
    CommandParser,
    add_quantize_argument,
    add_source_argument,
    checkpoint_lines,
    misplaced_setting,
    read_text_file,
    show_checkpoint_lines,
)
from minigpt.core.checkpoint import find_checkpoint
from minigpt.core.devices import resolve_device
from minigpt.core.errors import UserError
from minigpt.core.fsutil import make_writable_dir, write_error
from minigpt.evaluation.loss import bits_per_char_and_byte, evaluate_tokens, text_ids
from minigpt.loading import is_hf_source, load_model

MINIMUMS = {"batch_size": 1, "limit": 1, "num_fewshot": 0}  # each count's smallest value (CommandParser checks)


def build_parser() -> CommandParser:
    p = CommandParser(
        prog="eval.py",
        description="Evaluate a checkpoint on a text file (nats/token, bits/char), "
        "or on lm-evaluation-harness tasks (--tasks).",
        minimums=MINIMUMS,
        paths={"text": "the text file to evaluate on", "output": "the path of the JSON file to write"},
    )
    add_source_argument(p)
    p.add_argument("--text", type=str | None, default=None, help="UTF-8 text file to evaluate on")
    p.add_argument(
        "--tasks",
        type=str | None,
        default=None,
        help="lm-evaluation-harness tasks instead of --text: names (hellaswag,arc_easy,...) and paths of "
        "task YAML files (ending in .yaml), comma-separated (needs the eval extra: pip install -e "
        '".[eval]"). A task file is code, like a script: its `!function module.fn` hooks run, '
        "read from module.py beside the file and nowhere else; give only task files you trust",
    )
    p.add_argument("--limit", type=int | None, default=None, help="--tasks: at most this many examples per task")
    p.add_argument(
        "--num_fewshot",
        "--num-fewshot",
        type=int | None,
        default=None,
        help="--tasks: examples shown before each question (default: each task's own)",
    )
    p.add_argument("--output", type=str | None, default=None, help="--tasks: write the harness's results JSON here")
    p.add_argument(
        "--batch_size",
        "--batch-size",
        type=int | None,
        default=None,
        help="windows of block_size tokens (--text) or requests (--tasks, default 1) evaluated at once: "
        "speed and memory, not the result; at most as many as keep their scoring (logits and activations) "
        "within 512 MiB",
    )
    p.add_argument("--device", type=str, default="cpu", help="cpu, cuda, cuda:N, mps, or auto")
    add_quantize_argument(p)
    return p


def problems(args) -> Iterator[str]:
    """What is wrong with the flags together, one message each (each count's range: MINIMUMS, in the parser)."""
    if (args.text is None) == (args.tasks is None):
        yield (
            "give either --text FILE (the loss on a text) or --tasks NAMES (lm-evaluation-harness tasks)"
            + ("" if args.text is None else ", not both")
        )
    if args.output is not None and Path(args.output).is_dir():
        yield f"--output {args.output} is a directory; give the path of the JSON file to write"
    for flag in ("limit", "num_fewshot", "output"):
        if args.text is not None and getattr(args, flag) is not None:
            yield f"--{flag} is a setting of --tasks, which --text does not read; drop --{flag}"


def check_output(path: Path) -> None:
    """--output's folder made and written to before the tasks run (hours, on a large task), not after them."""
    try:
        make_writable_dir(path.parent)
    except OSError as e:  # a file where a folder must be is named; any other reason in the system's words
        fix = "choose a path you can write to"
        raise write_error(e, f"--output {path}", fix, UserError) or UserError(
            f"cannot write --output {path} ({e.strerror or type(e).__name__}); {fix}"
        ) from None


def run_tasks(args) -> dict:
    """--tasks: the harness's tasks on the model, in process; prints the harness's table, writes --output."""
    from minigpt.evaluation.harness import MiniGPTLM, evaluate_tasks, resolve_tasks, results_table, write_results

    tasks = resolve_tasks(args.tasks.split(","))  # before loading the model: a wrong name costs nothing
    if args.output is not None:
        check_output(Path(args.output))
    model, tokenizer = load_model(args.ckpt, device=resolve_device(args.device), quantize=args.quantize)
    show_checkpoint_lines()
    results = evaluate_tasks(
        MiniGPTLM(model, tokenizer, batch_size=args.batch_size or 1),
        tasks,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
    )
    # which model the figures are of (the harness records model_args: null for a model object)
    source = args.ckpt if is_hf_source(args.ckpt) else str(find_checkpoint(args.ckpt))
    results["config"]["model_args"] = {"ckpt": source, "quantize": args.quantize, "device": args.device}
    print(results_table(results), flush=True)
    if args.output is not None:
        print(f"results: {write_results(results, args.output)}", flush=True)
    return results


def run(argv: list[str] | None = None) -> tuple[float, int] | dict:
    """eval.py without the one-line error handling: prints the result line and returns (total nats, tokens), or
    with --tasks prints the harness's table and returns its results."""
    parser = build_parser()
    if problem := misplaced_setting(sys.argv[1:] if argv is None else argv, QUANTIZE_CHOICES):
        parser.error(problem)
    args = parser.parse_args(argv)
    if problem := next(problems(args), None):
        raise UserError(problem)
    if args.tasks is not None:
        return run_tasks(args)
    device = resolve_device(args.device)
    path = Path(args.text)
    text = read_text_file(path, "--text file")
    model, tokenizer = load_model(args.ckpt, device=device, quantize=args.quantize)
    tokens = text_ids(tokenizer, text, f"--text {path}")
    nats, n = evaluate_tokens(model, tokens, args.batch_size)
    show_checkpoint_lines()
    per_char, per_byte = bits_per_char_and_byte(nats, tokenizer, tokens)
    print(
        f"{path}: {n:,} tokens, {nats / n:.4f} nats/token, {per_char:.4f} bits/char, {per_byte:.4f} bits/byte",
        flush=True,
    )
    return nats, n


def main(argv: list[str] | None = None) -> None:
    """eval.py: user mistakes end in one 'error:' line and exit code 2."""
    with checkpoint_lines():
        run_cli(lambda: run(argv))
