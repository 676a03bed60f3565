"""The `sample.py` command line: load a checkpoint, read the prompt, generate, print (streamed for one sample).

    python sample.py --ckpt out/RUN --prompt "ROMEO:" --max_new_tokens 300
    python sample.py --prompt - < prompt.txt --num_samples 3 --temperature 0.9 --top_p 0.95
    python sample.py --temperature 0 --no-kv-cache        # greedy, recomputing the context every step
    python sample.py --config sample.yaml                 # the same options from YAML (see --print_config)
    python sample.py --ckpt out/sft --chat --system "Answer briefly."   # talk to a chat model, turn by turn
    python sample.py --quantize int8 --compile            # faster decoding on a CPU (docs/performance.md#decode)

The generation itself is minigpt.core.generation; loading is minigpt.loading.load_model.  Every user mistake
(a bad flag, checkpoint or prompt) ends in one `error:` line and exit code 2.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence
from typing import Any, TextIO, get_args

import torch

from minigpt.cli.errors import run_cli
from minigpt.cli.parsing import (
    QUANTIZE_CHOICES,
    CommandParser,
    add_prompt_arguments,
    add_quantize_argument,
    add_source_argument,
    checkpoint_lines,
    is_terminal,
    misplaced_setting,
    read_prompt,
    show_checkpoint_lines,
    typed,
    utf8_stdin,
)
from minigpt.core.chat import ChatSession
from minigpt.core.config import Attention
from minigpt.core.devices import resolve_device
from minigpt.core.errors import UserError, first_line
from minigpt.core.generation import Sampling, generate, prompt_ids
from minigpt.core.limits import check_sampling_size
from minigpt.core.seed import check_seed
from minigpt.core.tokenizer_base import IncrementalDecoder, Tokenizer, decode_after
from minigpt.loading import load_chat_model, load_model

# ---------------------------------------------------------------------------------------------------
# Terminal output


class TextStreamer:
    """Prints a completion's tokens as they arrive, as the text they add to the prompt's (IncrementalDecoder: a
    SentencePiece space at the start is kept, a character split across tokens waits for its last one)."""

    def __init__(
        self, tokenizer: Tokenizer, out: TextIO, stop_ids: Collection[int] = (), context: Sequence[int] = ()
    ) -> None:
        # every token's text, special ones too: a raw continuation (--no-stop shows where a document ended)
        self.decoder = IncrementalDecoder(tokenizer, context, keep_special=True)
        self.out, self.stop_ids = out, stop_ids
        self.stopped = False

    def push(self, ids: list[int]) -> None:
        for i in ids:
            if self.stopped or i in self.stop_ids:
                self.stopped = True
                return
            if piece := self.decoder.push(i):
                self.out.write(piece)
                self.out.flush()

    def flush(self) -> None:
        self.out.write(self.decoder.finish())
        self.out.flush()


def decode_generated(tokenizer: Tokenizer, prompt: list[int], ids: list[int], stop_ids: Collection[int]) -> str:
    """Generated ids -> the text they add to the prompt's, cut at the first stop token."""
    ids = ids[: next((k for k, i in enumerate(ids) if i in stop_ids), len(ids))]
    return decode_after(tokenizer, prompt, ids)


# ---------------------------------------------------------------------------------------------------
# Flags


class TopK:
    """The --top_k type: an integer, or none/off/null for no top-k filtering."""

    __name__ = "top_k"  # argparse names the type in its error: "invalid top_k value: 'x'"

    def __repr__(self) -> str:  # what --help shows as the type
        return "int | none"

    def __call__(self, value: Any) -> int | None:
        if value is None or isinstance(value, str) and value.strip().lower() in ("none", "off", "null"):
            return None
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected an integer or none, got {value!r}") from None


def build_parser() -> CommandParser:
    p = CommandParser(
        prog="sample.py", description="Generate text from a minigpt checkpoint.", minimums={"num_samples": 1}
    )
    add_source_argument(p)
    add_prompt_arguments(p, "text to continue")
    p.add_argument(
        "--num_samples",
        "--num-samples",
        type=int,
        default=1,
        help="samples to draw, generated together as one batch (refused up front if the batch's memory "
        "would pass this machine's)",
    )
    p.add_argument(
        "--max_new_tokens",
        "--max-new-tokens",
        type=int,
        default=500,
        help="tokens to generate per sample (BPE models may stop earlier at end-of-text). Past the "
        "model's block_size the context rolls: every block_size/2 tokens the last block_size/2 are "
        "read again, about one extra token of work per token, the same however long it runs",
    )
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument(
        "--top_k", "--top-k", type=TopK(), default=200, help="sample from the k most likely tokens only ('none' = all)"
    )
    p.add_argument("--top_p", "--top-p", type=float | None, default=None, help="nucleus sampling, in (0, 1]")
    p.add_argument("--seed", type=int, default=1337, help="fixes sampling")
    p.add_argument("--device", type=str, default="cpu", help="cpu, cuda, cuda:N, mps, or auto")
    p.add_argument(
        "--attention",
        type=Attention,
        default=None,
        help="attention implementation (default: the checkpoint's); all give the same output",
    )
    add_quantize_argument(p)
    p.add_argument(
        "--compile",
        action="store_true",
        help="decode through a step compiled with torch.compile: tens of seconds once (then seconds, from "
        "the cache), then faster tokens; the same output. On a CPU it compiles only where the tokens asked for "
        "pay for the compile, as measured on this machine (else a note, and no compile). Needs a C++ compiler "
        "(else a note); on a GPU the step is replayed from CUDA graphs. Not used by --chat. In YAML: compile: true",
    )
    p.add_argument(
        "--no-kv-cache",
        "--no_kv_cache",
        dest="kv_cache",
        action="store_false",
        help="recompute the whole context every step (slow; for comparison: the same text within block_size; past it "
        "the cache keeps the last block_size/2 tokens at each refill, this path a sliding block_size window). In "
        "YAML: kv_cache: false",
    )
    p.add_argument(
        "--no-stop",
        "--no_stop",
        dest="stop",
        action="store_false",
        help="do not stop at end-of-text (BPE models stop there by default). In YAML: stop: false",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="talk to a chat model: your turns from the terminal (or one per line from stdin), each reply "
        "streamed until its end-of-turn token; earlier turns stay in the KV cache",
    )
    p.add_argument("--system", type=str | None, default=None, help="--chat: the system prompt")
    return p


# ---------------------------------------------------------------------------------------------------
# Chat


# what --chat cannot honour (flag, set?): they were accepted and did nothing; 0 tokens gave empty replies as turns
CHAT_IGNORES = [
    ("--num_samples", lambda args: args.num_samples != 1),
    ("--no-stop", lambda args: not args.stop),
    ("--max_new_tokens 0", lambda args: args.max_new_tokens == 0),
]


def run_chat(args: Any, device: str, stdout: TextIO, stdin: TextIO) -> None:
    """One reply per user line, streamed; a terminal gets a `> ` prompt, stdin read as lines gets none."""
    model, tokenizer = load_chat_model(args.ckpt, device, args.attention, args.quantize)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    session = ChatSession(
        model,
        tokenizer,
        args.system,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.top_p,
        generator,
        use_kv_cache=args.kv_cache,
    )
    show_checkpoint_lines()
    interactive = is_terminal(stdin)
    skipped = UserError if interactive else ()  # a turn the model cannot read: skipped on a terminal, the end if piped

    def write(text: str) -> None:
        stdout.write(text)
        stdout.flush()

    # --prompt TEXT (or --prompt-file) is the first turn; stdin holds the turns anyway, so --prompt - adds none
    first = read_prompt(args, stdin) if args.prompt_file or args.prompt not in ("", "-") else None
    while True:
        if first is not None:
            line, first = first, None
        else:
            if interactive:
                write("> ")
            line = typed(stdin, line=True)
            if not line:  # end of input (or standard input closed)
                break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        held = len(session.messages)
        try:
            session.reply(line, on_text=write)
        except skipped as e:
            print(f"error: {first_line(e, 2000)}", file=sys.stderr, flush=True)
            continue
        finally:  # an error or Ctrl-C mid-reply still ends the line
            write("\n")
        if (dropped := held + 2 - len(session.messages)) > 0:  # the turn's two messages came, older ones went
            print(
                f"note: the conversation outgrew the model's context of {model.config.block_size} tokens: its "
                f"{dropped} oldest message(s) are left out from here on (a system prompt is kept)",
                file=sys.stderr,
                flush=True,
            )


# ---------------------------------------------------------------------------------------------------
# The command


def _main(argv: list[str] | None, stdout: TextIO, stdin: TextIO) -> None:
    parser = build_parser()
    choices = {"attention": get_args(Attention), **QUANTIZE_CHOICES}
    if problem := misplaced_setting(sys.argv[1:] if argv is None else argv, choices):
        parser.error(problem)
    args = parser.parse_args(argv)
    if args.system is not None and not args.chat:
        parser.error("--system is the system prompt of --chat: add --chat, or drop --system")
    if args.chat and (unread := [flag for flag, off in CHAT_IGNORES if off(args)]):
        parser.error(f"--chat replies once per turn and stops at the end of it: drop {' and '.join(unread)}")
    if args.compile and not args.kv_cache:
        parser.error("--compile compiles the KV-cache decode step, which --no-kv-cache turns off; drop one of them")
    Sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens)  # checked here: names like the flags
    check_seed(args.seed)
    device = resolve_device(args.device)
    if args.chat:
        run_chat(args, device, stdout, stdin)
        return
    prompt = read_prompt(args, stdin)

    generating = (args.num_samples, args.max_new_tokens)  # --quantize: only where int8 pays within this generation
    model, tokenizer = load_model(args.ckpt, device, args.attention, args.quantize, generating)
    ids = prompt_ids(tokenizer, prompt)
    check_sampling_size(model.config, args.num_samples, len(ids), args.max_new_tokens, args.kv_cache, model)
    show_checkpoint_lines()
    stop_ids = tokenizer.stop_ids if args.stop else frozenset()  # end-of-text, and every end a folder lists
    idx = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    settings = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        use_kv_cache=args.kv_cache,
        stop_token=stop_ids,
        generator=generator,
        vocab_size=tokenizer.vocab_size,
        compile="auto" if args.compile else False,  # a speed flag: compiles only where that pays
    )

    if args.num_samples == 1:
        stream = TextStreamer(tokenizer, stdout, stop_ids, ids)
        stdout.write(prompt)
        stdout.flush()
        try:
            generate(model, idx, args.max_new_tokens, on_token=lambda t: stream.push(t.tolist()), **settings)
        finally:  # an error or Ctrl-C mid-stream still ends the line, so the message starts on its own line
            stream.flush()
            stdout.write("\n")
            stdout.flush()
        return
    out = generate(model, idx, args.max_new_tokens, **settings)
    for i, row in enumerate(out.tolist()):
        stdout.write(f"---------- sample {i + 1}/{args.num_samples} ----------\n")
        stdout.write(prompt + decode_generated(tokenizer, ids, row[len(ids) :], stop_ids) + "\n")
    stdout.flush()


def main(argv: list[str] | None = None, stdout: TextIO | None = None, stdin: TextIO | None = None) -> None:
    """sample.py: user mistakes (bad flags, bad checkpoint, bad prompt) end in one 'error:' line, exit code 2."""
    out = stdout if stdout is not None else sys.stdout
    if stdout is None and hasattr(out, "reconfigure"):
        out.reconfigure(errors="replace")  # a model can emit characters the console cannot show
    with checkpoint_lines():
        run_cli(lambda: _main(argv, out, stdin if stdin is not None else utf8_stdin()))
