"""What the commands share: jsonargparse parsers whose mistakes end in one line, the checks made before parsing,
the --ckpt / --prompt options and the device option.  Each command has `--help`, `--config FILE` (YAML) and
`--print_config`.  Importing this module imports no Lightning: sample, eval, export and attention start fast."""

from __future__ import annotations

import contextlib
import difflib
import io
import logging
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, TextIO, get_args, get_origin, get_type_hints

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, get_loader, set_loader, set_parsing_settings

from minigpt.cli.errors import fail
from minigpt.core.errors import UserError, first_line
from minigpt.core.quantize import QUANTIZATIONS, Quantization
from minigpt.core.user_files import DOCUMENT_BYTES, MAX_JSON_DEPTH, TOO_DEEP, json_depth, read_user_text


def bounded_yaml_load(text: str) -> Any:
    """jsonargparse's YAML loader (for --config files and flag values) behind the JSON depth bound: libyaml's
    parser, its default, crashes the interpreter on brackets nested ~100,000 deep."""
    if isinstance(text, str) and json_depth(io.BytesIO(text.encode("utf-8", "surrogatepass"))) > MAX_JSON_DEPTH:
        raise yaml.YAMLError(TOO_DEEP)
    if isinstance(text, str) and (repeated := repeated_key(text)):
        raise yaml.YAMLError(repeated)
    return yaml_load(text)


def repeated_key(text: str) -> str | None:
    """A key given twice in one YAML mapping, which YAML reads as the last one alone: a config with two `model:`
    sections trained with the second one's settings only, without a word."""
    stack = [yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))]
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value in seen:
                    lines = f"lines {seen[key.value]} and {key.start_mark.line + 1}"
                    return f"{key.value!r} is given twice ({lines}), and YAML keeps the last alone; merge them"
                seen[key.value] = key.start_mark.line + 1
            stack += [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value
    return None


if get_loader("yaml") is not bounded_yaml_load:  # (this module imported twice: tests reload it)
    yaml_load = get_loader("yaml")
    set_loader("yaml", bounded_yaml_load, exceptions=(yaml.YAMLError,))


def read_field_docs(args: Sequence[str]) -> None:
    """Whether the parsers made next read each config field's docstring, for --help to print (a field is documented
    once, where it is declared): only where `args` ask for help, since reading them parses the classes' source,
    ~0.1 s of every train.py launch on a 2-core CPU."""
    set_parsing_settings(docstring_parse_attribute_docstrings=any(arg in ("-h", "--help") for arg in args))


def one_line(message: str) -> str:
    """A parse error of jsonargparse's (several lines) as one line; the mistakes minigpt names itself (a choice
    outside its Literal, a linked setting) are found before parsing, by misplaced_setting."""
    return " ".join(line.strip() for line in str(message).splitlines() if line.strip()) or "invalid arguments"


def flag_values(args: Sequence[str]) -> Iterator[tuple[str, str | None]]:
    """(key, value) of each `--key value` / `--key=value` in a command line (value None when none follows)."""
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            key, eq, value = arg[2:].partition("=")
            yield key, value if eq else (args[i + 1] if i + 1 < len(args) else None)


def literal_choices(section: str, cls: type) -> dict[str, tuple[Any, ...]]:
    """`section.field` -> its allowed values, for each field of a dataclass declared as a Literal."""
    choices = {}
    for name, hint in get_type_hints(cls).items():
        literals = [a for a in (hint, *get_args(hint)) if get_origin(a) is Literal]  # Literal[...] or Optional of one
        if literals:
            optional = (None,) if type(None) in get_args(hint) else ()
            choices[f"{section}.{name}"] = tuple(v for lit in literals for v in get_args(lit)) + optional
    return choices


def misplaced_setting(
    args: Sequence[str], choices: dict[str, tuple[Any, ...]], links: dict[str, str] | None = None
) -> str | None:
    """What is wrong with a command line before it is parsed, in one line, or None: a flag given a value outside
    its choices (named with the choices), or a setting that a link fills (target -> source) given by hand."""
    for key, value in flag_values(args):
        if links and key in links:
            return f"{key} is not a setting: it is taken from {links[key]}; remove it from the config and flags"
        allowed = [str(c) for c in choices.get(key, ()) if c is not None]
        allowed += ["null", "None"] if None in choices.get(key, ()) else []
        if key in choices and value is not None and value not in allowed:
            return f"{key}: unknown value {value!r}; choose one of " + ", ".join(allowed[: len(choices[key])])
    return None


def as_given(config: Any, parser: Any) -> Any:
    """train.py's --print_config of a fine-tune (init_from): the config without the model settings and data.tokenizer
    that its source fills and the user did not set (not in the parser's file_keys, from the --config files, or its
    flag_keys), so that the printed file, fed back as --config, is the same run rather than one that sets them."""
    if "init_from" not in config or not config["init_from"]:
        return config
    given = getattr(parser, "file_keys", set()) | getattr(parser, "flag_keys", set())
    config = config.clone()
    for key in [f"model.{k}" for k in config["model"].keys()] + ["data.tokenizer"]:
        if key not in given and key in config:
            del config[key]
    return config


def invoked_as(prog: str | None) -> str | None:
    """A command's name as the user ran it, for its usage line and errors: `minigpt train` through the console
    script (minigpt.cli.main; also `python3 -m minigpt`, `minigpt help train`), else as given (`train.py`)."""
    command = (prog or "").removesuffix(".py")
    runner = sys.argv[0] if sys.argv else ""
    mains = (str(Path("minigpt/cli/main.py")), str(Path("minigpt/__main__.py")))
    via_main = Path(runner).name in ("minigpt", "minigpt.exe") or runner.endswith(mains)
    named = sys.argv[1:2] == [command] or sys.argv[1:3] == ["help", command]
    return f"minigpt {command}" if prog and prog.endswith(".py") and via_main and named else prog


# the keys of the commands' config files that name a file or folder, and a shell variable in one: a config file is
# not read by a shell, so `out_dir: $HOME/runs` made a folder named "$HOME"
PATH_KEYS = (
    "ckpt",
    "out",
    "out_dir",
    "init_from",
    "data.source",
    "data.data_root",
    "data.tokenizer",
    "data.chat_template",
)
SHELL_VARIABLE = re.compile(r"\$\{?[A-Za-z_]\w*\}?")


class OneLineErrors:
    """Parse mistakes (unknown key, wrong type, bad choice) end in one line naming the key, not a usage dump; the
    usage line names the command as it was run (invoked_as), and a mistake in a --config file names the file."""

    prog: str
    train_sections: tuple[str, ...] = ()  # sections of train.py's config, which this command does not read

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if "prog" in kwargs:
            kwargs["prog"] = invoked_as(kwargs["prog"])
        self.links: dict[str, str] = kwargs.pop("links", {})  # settings a link fills (target: its source)
        super().__init__(*args, **kwargs)
        self.reading: Any = None  # the config file being read, for its errors
        self.key_files: dict[str, Any] = {}  # key -> the config file that set it: its unknown keys are found later

    def error(self, message: str, ex: Exception | None = None) -> None:  # type: ignore[override]
        message = one_line(message)
        required = "the following arguments are required: "
        if message.startswith(required):  # named as the user types them: "--out", not "out"
            names = [f"--{name.strip()}" for name in message.removeprefix(required).split(",")]
            message = f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} required"
        unknown = "unrecognized arguments: "
        if message.startswith(unknown) and (near := self.nearest_key(message.removeprefix(unknown))):
            message += f"; did you mean --{near}?"
        file = self.reading
        if key := unknown_key(message):  # found once every file is read: named with the file that set it
            file = self.key_files.get(key, file)
            near = self.nearest_key(key)
            message = f"unknown key {key}" + (f"; did you mean {near}?" if near else "")
            sections = {k.split(".")[0] for k, f in self.key_files.items() if f == file}
            if sections & set(self.train_sections):  # a run's config.yaml given to sample.py, eval.py, ...
                message = f"unknown key {key}: this is train.py's config; name the run with --ckpt instead"
        if message.startswith("Unexpected config:"):  # YAML that is not a mapping: nothing, a word, a list
            held = message.removeprefix("Unexpected config:").strip()
            message = "holds no settings; write them as YAML `key: value` lines"
            if not file:  # a --config value that names no file, which jsonargparse read as YAML text
                unset = "" if held else " (an unset shell variable?)"
                message = f"--config {held!r} names no file{unset}; give the path of a YAML file"
        if file:
            message = f"{file}: " + message.replace(' in "<unicode string>",', " at")
        fail(f"{message} (see `{self.prog} --help`)")

    def parse_args(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        parsed = super().parse_args(*args, **kwargs)
        expand_home(parsed, (*PATH_KEYS, *getattr(self, "paths", ())))
        return parsed

    def parse_path(self, path: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """A --config file, its mistakes named with it; and refused here, what jsonargparse takes from a file but
        the run would not use as written (a linked setting, a section that is not a mapping, a shell variable)."""
        self.reading = path
        try:
            parsed = super().parse_path(path, *args, **kwargs)
            if linked := [key for key in self.links if key in parsed]:  # the link would replace it without a word
                self.error(f"{linked[0]} is not a setting: it is taken from {self.links[linked[0]]}; remove it there")
            # a section that is not a mapping (its lines commented out: null) broke the run later, or was a traceback
            if flat := [g for g in self.groups or {} if g in parsed and not isinstance(parsed[g], Namespace)]:
                held = "is empty" if parsed[flat[0]] is None else f"holds {parsed[flat[0]]!r}"
                self.error(f"section {flat[0]}: {held}; give it `key: value` lines under it, or remove it")
            for key in (*PATH_KEYS, *getattr(self, "paths", ())):
                if isinstance(value := parsed.get(key), str) and (variable := SHELL_VARIABLE.search(value)):
                    self.error(
                        f"{key}: {value!r} holds {variable[0]}, which a config file does not expand (no shell reads "
                        f'it); write the path out, or give it as a flag the shell expands: --{key} "{value}"'
                    )
        except UnicodeDecodeError as e:  # jsonargparse's read_text lets it through: a traceback
            self.error(f"not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8")
        finally:
            self.reading = None
        self.key_files.update(dict.fromkeys(parsed.keys(), path))
        return parsed

    def dump(self, cfg: Any, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return super().dump(as_given(cfg, self) if hasattr(self, "print_config") else cfg, *args, **kwargs)

    def nearest_key(self, flags: str) -> str | None:
        """The setting the first unknown flag likely meant: the one it names without its section
        (--max_steps: trainer.max_steps), else the closest spelling (--learning_rat: optim.learning_rate)."""
        name = flags.split()[0].lstrip("-").split("=")[0] if flags.split() else ""
        try:
            keys = [k for k in self.get_defaults().keys() if k not in ("config", "print_config")]
        except Exception:  # defaults that cannot be read: no suggestion, the message stands
            return None
        same = [k for k in keys if k.rsplit(".", 1)[-1] == name]
        return same[0] if len(same) == 1 else next(iter(difflib.get_close_matches(name, keys, n=1, cutoff=0.8)), None)


def unknown_key(message: str) -> str | None:
    """The key that jsonargparse's message says no option has (one a config file set), or None."""
    found = re.fullmatch(r"Group '(.+)' does not accept option '(.+)'|Option '(.+)' is not accepted", message)
    return None if found is None else found[3] or f"{found[1]}.{found[2]}"


class CommandParser(OneLineErrors, ArgumentParser):
    """The parser of sample.py and eval.py: flags, plus --config FILE and --print_config like train.py.
    minimums (flag -> its smallest value) declares the counts' lower bounds, and paths (flag -> what it names) the
    flags that name a file, which may not be empty (Path("") is the current folder: "it is a directory"); both
    checked here after parsing (flags and --config alike); a flag left out (None) is not checked."""

    def __init__(
        self, *args: Any, minimums: dict[str, int] | None = None, paths: dict[str, str] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.minimums, self.paths = minimums or {}, paths or {}
        self.train_sections = ("trainer", "model", "data", "optim", "lora", "early_stopping", "dpo", "grpo")
        self.add_argument("--config", action=ActionConfigFile, help="a YAML file of these options")

    def parse_args(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        parsed = super().parse_args(*args, **kwargs)
        for flag, low in self.minimums.items():
            if (value := parsed.get(flag)) is not None and value < low:
                self.error(f"--{flag} must be >= {low}, got {value}")
        for flag, what in self.paths.items():
            if (value := parsed.get(flag)) is not None and not value.strip():
                self.error(f"--{flag} is empty; give {what}")
        return parsed


def expand_home(parsed: Any, keys: Sequence[str]) -> None:
    """A path setting's leading ~ as a shell expands it: a config file's, or a flag written --out_dir=~/x, reached the
    run as a folder named "~" (and Lightning, which expands it, wrote out_dir's checkpoints elsewhere)."""
    for key in keys:
        if isinstance(value := parsed.get(key), str) and value.startswith("~"):
            parsed[key] = str(Path(value).expanduser())


def add_source_argument(p: ArgumentParser) -> None:
    """--ckpt: anything minigpt.loading.load_model reads (sample, eval, attention and export share it)."""
    p.add_argument(
        "--ckpt",
        type=str | None,
        default=None,
        help="checkpoint file, run directory, Hugging Face model directory or hf:ORG/NAME "
        "(default: the newest run under out/)",
    )


class _PendingLines(logging.Handler):
    """Holds minigpt.loading's lines until the command has accepted its inputs (show_checkpoint_lines): a mistake
    found after loading (a prompt the vocabulary lacks) stays the command's one `error:` line."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def show(self) -> None:
        for line in self.lines:
            print(line, file=sys.stderr, flush=True)  # sys.stderr as it is now (tests swap the stream)
        self.lines.clear()


@contextlib.contextmanager
def checkpoint_lines() -> Iterator[None]:
    """While a command runs, the line minigpt.loading logs when it picks a checkpoint (for a run directory, or no
    --ckpt) goes to stderr, where the command's other messages go, once the command starts its work
    (show_checkpoint_lines) or, at the latest, when it ends well; a command that fails shows only its error."""
    logger = logging.getLogger("minigpt.loading")
    handler, level = _PendingLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
        handler.show()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def show_checkpoint_lines() -> None:
    """The command accepted its inputs and starts its work: say which checkpoint it took (see checkpoint_lines)."""
    for handler in logging.getLogger("minigpt.loading").handlers:
        if isinstance(handler, _PendingLines):
            handler.show()


def add_quantize_argument(p: ArgumentParser) -> None:
    """--quantize: minigpt.core.quantize's Quantization (sample, chat, eval, serve share it); its choices are also
    checked before parsing (misplaced_setting with QUANTIZE_CHOICES), for a one-line error naming them."""
    p.add_argument(
        "--quantize",
        type=Quantization | None,
        default=None,
        help="int8: every weight as int8 with a scale per row, for inference: a quarter of the memory and "
        "faster decoding on a CPU, nearly always float32's next token. Measured against float32 once per machine: "
        "where int8 is slower here, a note says so and float32 runs (docs/performance.md#decode)",
    )


QUANTIZE_CHOICES = {"quantize": QUANTIZATIONS}


def add_prompt_arguments(p: ArgumentParser, what: str) -> None:
    """--prompt TEXT | --prompt - (stdin) | --prompt-file F, read by read_prompt."""
    p.add_argument("--prompt", type=str, default="", help=f"{what}; '-' reads it from stdin")
    p.add_argument(
        "--prompt-file",
        "--prompt_file",
        dest="prompt_file",
        type=str | None,
        default=None,
        help="read the prompt from this file (instead of --prompt)",
    )
    if isinstance(p, CommandParser):
        p.paths["prompt_file"] = "the file that holds the prompt"


def typed(stdin: TextIO | None, line: bool = False) -> str:
    """What the user typed or piped: all of standard input, or its next line, with Windows (and old Mac) line
    endings read as "\n".  Standard input that is closed (`<&-`) or cannot be read (a directory) holds nothing,
    like an empty prompt; bytes that are not UTF-8 are one error line."""
    try:
        text = (stdin.readline() if line else stdin.read()) if stdin is not None else ""
        text.encode("utf-8")  # the bytes Python could not decode come as lone surrogates (surrogateescape)
    except UnicodeError as e:
        raise UserError(
            f"standard input is not UTF-8 text (a byte that is not UTF-8 near character {e.start}); pipe "
            "UTF-8 text, or give the prompt with --prompt-file"
        ) from None
    except (OSError, ValueError):  # closed (ValueError: I/O operation on closed file), a directory (EISDIR)
        return ""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def utf8_stdin() -> TextIO | None:
    """sys.stdin, read as UTF-8 where it is a pipe or a file, as `typed` expects: Windows reads those in its ANSI code
    page (cp1252), so a UTF-8 prompt (`--prompt - < prompt.txt`) came in garbled (é as Ã©) without a word."""
    stdin = sys.stdin
    if not is_terminal(stdin) and hasattr(stdin, "reconfigure"):
        with contextlib.suppress(OSError, ValueError):  # closed, or read from already
            stdin.reconfigure(encoding="utf-8")
    return stdin


def is_terminal(stdin: TextIO | None) -> bool:
    try:
        return stdin is not None and stdin.isatty()
    except (OSError, ValueError):  # closed
        return False


def read_prompt(args: Any, stdin: TextIO | None) -> str:
    if args.prompt_file is None and args.prompt == "-":
        return typed(stdin)
    if args.prompt_file is None:
        try:  # bytes that are not UTF-8 reach argv as lone surrogates (Python's surrogateescape)
            args.prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UserError(
                f"--prompt is not UTF-8 text (a byte that is not UTF-8 at character {e.start}); pass UTF-8 text"
            ) from None
        return args.prompt
    if args.prompt:
        raise UserError("give the prompt with --prompt or --prompt-file, not both")
    return read_text_file(args.prompt_file, "prompt file")


def read_text_file(path: str | Path, what: str) -> str:
    """A text file the user named (--prompt-file, eval.py's --text): a regular file of at most DOCUMENT_BYTES in
    UTF-8, or one error line naming `what`."""
    path = Path(path)
    try:
        return read_user_text(path, DOCUMENT_BYTES)
    except FileNotFoundError:
        message = f"{what} not found: {path}; pass an existing file"
    except UnicodeDecodeError as e:
        message = f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason}); pass a UTF-8 file"
    except (OSError, ValueError) as e:  # a directory, a device, a file over the bound
        message = f"cannot read {what} {path}: {first_line(e)}"
    raise UserError(message)
