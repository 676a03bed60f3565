"""`minigpt COMMAND [FLAGS]`: the installed console script, one subcommand per top-level script.

    minigpt train --config configs/X.yaml     # = python train.py --config configs/X.yaml
    minigpt sample --ckpt out/RUN --prompt "ROMEO:"
    minigpt serve --ckpt out/RUN              # OpenAI-compatible server and chat page on 127.0.0.1:8000
    minigpt eval | export | attention ...     # `minigpt COMMAND --help` lists a command's flags

Only the chosen command's module is imported, so `minigpt sample` starts without Lightning (train's import).
The scripts (`python train.py`, ...) run their command through run_command too.
"""

from __future__ import annotations

import gc
import importlib
import sys
from types import ModuleType

from minigpt.cli.errors import fail, ignore_interrupts_until_exit, run_cli
from minigpt.core import __version__

# command -> (module, what it does); each module has main(argv) taking the flags after the command's name
COMMANDS = {
    "train": ("minigpt.cli.train", "train a GPT (configs/default.yaml unless --config)"),
    "sample": ("minigpt.cli.sample", "generate text from a checkpoint"),
    "eval": ("minigpt.cli.eval", "evaluate a checkpoint on a text file (nats/token, bits/char)"),
    "export": ("minigpt.cli.export", "write a checkpoint as a Hugging Face model directory or a GGUF file"),
    "attention": ("minigpt.cli.attention", "look at every attention head on one prompt (attention lab)"),
    "serve": ("minigpt.cli.serve", "serve a model over OpenAI's API, with a chat page (needs the serve extra)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        f"usage: minigpt {{{','.join(COMMANDS)}}} [FLAGS]",
        "",
        "A small, readable, fast GPT trainer.",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    lines += [
        "",
        "options:",
        "  -h, --help     show this message (also `minigpt help`)",
        "  --version      show the version",
        "",
        "`minigpt COMMAND --help` (or `minigpt help COMMAND`) lists a command's flags.",
    ]
    return "\n".join(lines)


def load_command(name: str) -> ModuleType:
    """The module of command `name` (one of COMMANDS), imported."""
    if name == "train":
        from minigpt.cli.cuda_start import start_cuda_early

        start_cuda_early()  # one GPU: its context made in a thread while the line below imports Lightning
    return importlib.import_module(COMMANDS[name][0])


def run_command(name: str, flags: list[str] | None = None) -> None:
    """Run command `name` as this process's own job: `python NAME.py` (flags None: the process's arguments) and
    `minigpt NAME FLAGS`. Its module is imported with the garbage collector paused, and what the imports made is
    then frozen out of every later collection (gc.freeze) before collection resumes.

    The imports make objects that live as long as the process, ~750,000 of them for train.py (torch's, Lightning's,
    torch._dynamo's, sympy's), and CPython walks all of them at each full collection, one every time their number
    grows by a quarter: a quarter of train.py's imports on a 2-core CPU (docs/performance.md#start-up), and every
    later full collection (compiling, the exit) would walk them again. The cost: the imports' few cyclic garbage
    objects (~15,000, ~12 MiB) are never freed. The scripts pause the collector on their first line, so torch's own
    import is covered too, and so is `minigpt NAME`'s (`import minigpt` imports nothing heavy). Ctrl-C while they
    load is the same one `error: interrupted` line as later."""
    gc.disable()
    try:
        command = load_command(name)
    except KeyboardInterrupt:  # while torch and the command's modules load: the same one line as later
        fail("interrupted", code=130)
    finally:
        gc.freeze()
        gc.enable()
    try:
        run_cli(lambda: command.main(flags))
    finally:
        # a finished export or training run (a Ctrl-C stop's second press, say) exits without Ctrl-C's noise
        # (export.main does it for its argv)
        if name in ("export", "train"):
            ignore_interrupts_until_exit()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["help"] and len(args) > 1:  # `minigpt help train` = `minigpt train --help`
        args = [args[1], "--help"]
    # run_cli and flush: a reader that stops reading (`minigpt --help | head -1`) ends it as SIGPIPE does, silently
    if not args or args[0] in ("-h", "--help", "help"):
        run_cli(lambda: print(usage(), flush=True))
        return
    if args[0] == "--version":
        # the running code's own version: a source tree has no installed metadata, or another install's
        run_cli(lambda: print(f"minigpt {__version__}", flush=True))
        return
    name, flags = args[0], args[1:]
    if name not in COMMANDS:
        what = "option" if name.startswith("-") else "command"
        fail(f"unknown {what} {name!r}; choose one of {', '.join(COMMANDS)} (see `minigpt --help`)")
    # flags passed on, sys.argv left as it is: a multi-device train relaunches `minigpt train ...` from it
    if argv is None:
        run_command(name, flags)
    else:  # a caller's, in its process: its garbage collector is left as it is
        command = load_command(name)
        run_cli(lambda: command.main(flags))


if __name__ == "__main__":
    main()
