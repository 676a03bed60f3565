"""The `export.py` command line: load a checkpoint, write it as a Hugging Face model directory (--format hf, the
default) or as one GGUF file for llama.cpp, Ollama and LM Studio (--format gguf), print one line.

    python export.py --ckpt out/RUN --out hf/my-model          # then AutoModelForCausalLM.from_pretrained(...)
    python export.py --ckpt out/RUN --out hf/my-model --overwrite
    python export.py --ckpt out/RUN --format gguf --out my-model.gguf --gguf_type q8_0   # then llama-cli -m ...

The exports are minigpt.export.hf.export_hf and minigpt.export.gguf.export_gguf; loading is
minigpt.loading.load_model.  Every user mistake (a bad flag, checkpoint, an option the format cannot express, an
--out that is taken or lies below a file, a full disk) ends in one `error:` line and exit code 2; Ctrl-C in one
`error: interrupted` line and exit code 130, leaving a previous export as it was.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from minigpt.cli.errors import run_cli
from minigpt.cli.parsing import CommandParser, add_source_argument, checkpoint_lines, show_checkpoint_lines
from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.errors import UserError
from minigpt.export.gguf import GGUFType, export_gguf
from minigpt.export.gguf_file import check_out_file
from minigpt.export.hf import HF_CLASS, check_exportable, check_out_dir, export_hf
from minigpt.loading import is_hf_source, load_model


def build_parser() -> CommandParser:
    p = CommandParser(
        prog="export.py",
        description="Write a minigpt checkpoint as a Hugging Face model directory "
        "(config.json, model.safetensors, tokenizer) that transformers loads with from_pretrained, or "
        "as one GGUF file that llama.cpp, Ollama and LM Studio run.",
    )
    add_source_argument(p)
    p.add_argument(
        "--out",
        type=str,
        required=True,
        help="folder to write (hf; must not hold files yet) or .gguf file to write (gguf; must not exist)",
    )
    p.add_argument(
        "--format",
        type=Literal["hf", "gguf", "peft"],
        default="hf",
        help="hf: a Hugging Face model directory; gguf: one GGUF file (llama.cpp); peft: a LoRA run's "
        "adapters alone, in PEFT's files, beside a Hugging Face export of their base (--base_out)",
    )
    p.add_argument(
        "--base_out",
        type=str | None,
        default=None,
        help="peft: the folder for the base the adapters apply to (default: --out with -base appended)",
    )
    p.add_argument(
        "--gguf_type",
        type=GGUFType,
        default="f32",
        help="GGUF weight type: f32, f16, bf16, q8_0 or q4_0 (norms and biases stay f32)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --out if it holds a previous export, unchanged "
        "(a folder's minigpt_export.json lists every file in it; a GGUF file carries its own SHA-256)",
    )
    return p


def safetensors_params(path: Path) -> int:
    """Parameters in a .safetensors file, read from its header (what a loader will find)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def run_gguf(args, out: Path) -> Path:
    checked = check_out_file(out, args.overwrite)  # before loading: a mistake in --out costs no load time
    model, tokenizer = load_model(args.ckpt)
    template = None
    if is_hf_source(args.ckpt) and not isinstance(tokenizer, ChatTokenizer):  # an imported model's own template
        from minigpt.hf.chat_files import read_chat_template
        from minigpt.hf.load import resolve_hf_source

        template = read_chat_template(resolve_hf_source(args.ckpt)[0])
    name = Path(str(args.ckpt or "minigpt")).name
    result = export_gguf(
        model,
        tokenizer,
        out,
        args.gguf_type,
        overwrite=args.overwrite,
        checked=checked,
        chat_template=template,
        name=name,
    )
    kept = f"; {result.kept_f16} matrices kept in f16 (rows not a multiple of 32)" if result.kept_f16 else ""
    show_checkpoint_lines()
    print(
        f"wrote {result.arch} GGUF ({result.n_params:,} parameters, {args.gguf_type}{kept}, tokenizer "
        f"{result.vocab.pre}{' + chat template' if result.vocab.chat_template else ''}) to {out}: "
        f"{out.stat().st_size / 2**20:.1f} MiB",
        flush=True,
    )
    for note in result.notes:
        print(f"note: {note}", flush=True)
    return out


def run_peft(args, out: Path) -> Path:
    from minigpt.export.peft import export_peft
    from minigpt.loading import load_lora_run

    base_out = Path(args.base_out or f"{str(out).rstrip('/')}-base")
    checked = check_out_dir(out, args.overwrite), check_out_dir(base_out, args.overwrite)  # before loading
    model, tokenizer, lora = load_lora_run(args.ckpt)
    export_peft(model, tokenizer, lora, out, base_out, overwrite=args.overwrite, checked=checked)
    n = safetensors_params(out / "adapter_model.safetensors")
    show_checkpoint_lines()
    print(
        f"wrote PEFT LoRA adapters ({n:,} parameters, rank {lora.rank}) to {out} and their base, "
        f"{HF_CLASS[model.config.arch]}, to {base_out}",
        flush=True,
    )
    return out


def problems(args) -> Iterator[str]:
    """What is wrong with the flags together, one message each."""
    if not args.out.strip():  # an unset shell variable: never the current directory
        yield "--out is empty; give the folder (or .gguf file) to write, e.g. --out hf/my-model"
    if args.format != "gguf" and args.gguf_type != "f32":
        yield "--gguf_type is a setting of --format gguf; add --format gguf, or drop --gguf_type"


def run(argv: list[str] | None = None) -> Path:
    """export.py without the one-line error handling: exports, prints the result line, returns the output path."""
    args = build_parser().parse_args(argv)
    if problem := next(problems(args), None):
        raise UserError(problem)
    out = Path(args.out)
    if args.format == "gguf":
        return run_gguf(args, out)
    if args.format == "peft":
        return run_peft(args, out)
    checked = check_out_dir(out, args.overwrite)  # before loading: a mistake in --out costs no load time
    model, tokenizer = load_model(args.ckpt)
    check_exportable(model.config)
    export_hf(model, tokenizer, out, overwrite=args.overwrite, checked=checked)
    n = safetensors_params(out / "model.safetensors")
    show_checkpoint_lines()
    print(
        f"wrote {HF_CLASS[model.config.arch]} ({n:,} parameters) to {out}: "
        f"{', '.join(sorted(p.name for p in out.iterdir()))}",
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> None:
    """export.py: user mistakes end in one 'error:' line and exit code 2."""
    with checkpoint_lines():
        run_cli(lambda: run(argv))
