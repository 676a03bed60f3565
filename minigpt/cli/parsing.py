"""What the three commands (train.py, sample.py, eval.py) share: jsonargparse parsers whose mistakes end in one
line, and the device option.  Each command has `--help`, `--config FILE` (YAML) and `--print_config`."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, TextIO

import torch
from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

from minigpt.core.errors import UserError

# --help reads each config field's docstring: a field is documented once, where it is declared
set_parsing_settings(docstring_parse_attribute_docstrings=True)

_LINKED = re.compile(r'^Linked "([^"]+)" must be given via "([^"]+)"')
_LITERAL = re.compile(r'^Parser key "([^"]+)":\s*Expected a typing\.Literal\[(.*)\]\.\s*Got value: (.*)$', re.S)


def one_line(message: str) -> str:
    """jsonargparse's multi-line parse errors as one line that names the key (and the choices, for a choice)."""
    text = " ".join(line.strip() for line in str(message).splitlines() if line.strip()) or "invalid arguments"
    if m := _LINKED.match(text):
        return f"{m.group(1)} is not a setting: it is taken from {m.group(2)}; remove it from the config and flags"
    if m := _LITERAL.match(text):
        choices = ", ".join(c.strip().strip("'\"") for c in m.group(2).split(","))
        return f"{m.group(1)}: unknown value {m.group(3).strip()!r}; choose one of {choices}"
    if text.startswith("Parser key") and "- " in text:  # a union's alternatives: keep the first
        text = text.split(" - ", 1)[0] + " " + text.split(" - ", 2)[1]
    return text


class OneLineErrors:
    """Parse mistakes (unknown key, wrong type, bad choice) end in one line naming the key, not a usage dump."""

    prog: str

    def error(self, message: str, ex: Exception | None = None) -> None:  # type: ignore[override]
        print(f"error: {one_line(message)} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


class CommandParser(OneLineErrors, ArgumentParser):
    """The parser of sample.py and eval.py: flags, plus --config FILE and --print_config like train.py."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--config", action=ActionConfigFile, help="a YAML file of these options")


def add_source_argument(p: ArgumentParser) -> None:
    """--ckpt: anything minigpt.loading.load_model reads (sample, eval, attention and export share it)."""
    p.add_argument("--ckpt", type=str | None, default=None,
                   help="checkpoint file, run directory, Hugging Face model directory or hf:ORG/NAME "
                        "(default: the newest run under out/)")


def add_prompt_arguments(p: ArgumentParser, what: str) -> None:
    """--prompt TEXT | --prompt - (stdin) | --prompt-file F, read by read_prompt."""
    p.add_argument("--prompt", type=str, default="", help=f"{what}; '-' reads it from stdin")
    p.add_argument("--prompt-file", "--prompt_file", dest="prompt_file", type=str | None, default=None,
                   help="read the prompt from this file (instead of --prompt)")


def resolve_device(name: str) -> str:
    """`auto` -> cuda if available else cpu; a device that does not exist here is a one-line error."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"device {name!r} is not a device; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name}: CUDA is not available here; use cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"device {name}: only {torch.cuda.device_count()} CUDA device(s) here; use cuda:0")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device {name}: MPS is not available here; use cpu")
    if device.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"device {name!r} is not supported; use cpu, cuda, cuda:N or auto")
    return name


def read_prompt(args: Any, stdin: TextIO) -> str:
    if args.prompt_file is not None:
        if args.prompt:
            raise UserError("give the prompt with --prompt or --prompt-file, not both")
        path = Path(args.prompt_file)
        if not path.is_file():
            raise UserError(f"prompt file not found: {path}")
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read prompt file {path}: {type(e).__name__}") from None
    if args.prompt == "-":
        return stdin.read()
    return args.prompt
