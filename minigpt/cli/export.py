"""The `export.py` command line: load a checkpoint, write it as a Hugging Face model directory (--format hf, the
default) or as one GGUF file for llama.cpp, Ollama and LM Studio (--format gguf), print one line.

    python export.py --ckpt out/RUN --out hf/my-model          # then AutoModelForCausalLM.from_pretrained(...)
    python export.py --ckpt out/RUN --out hf/my-model --overwrite
    python export.py --ckpt out/RUN --format gguf --out my-model.gguf --gguf_type q8_0   # then llama-cli -m ...

The exports are minigpt.export.hf.export_hf and minigpt.export.gguf.export_gguf; loading is
minigpt.loading.load_model.  Every user mistake (a bad flag, checkpoint, an option the format cannot express, an
--out that is taken or lies below a file, a full disk) ends in one `error:` line and exit code 2.  Ctrl-C ends in
one line saying whether the export was complete (it came after the final rename: the new export is in place,
verified by its own SHA-256 record) or not (a previous export is as it was), and exit code 130; once the command
is done, a Ctrl-C while the process exits is ignored.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from minigpt.cli.errors import ignore_interrupts_until_exit, run_cli
from minigpt.cli.parsing import CommandParser, add_source_argument, checkpoint_lines, show_checkpoint_lines
from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.errors import UserError
from minigpt.export.folder import FolderState, check_previous_export, folder_state
from minigpt.export.gguf import GGUFType, export_gguf
from minigpt.export.gguf_file import FileState, check_out_file, check_previous_gguf, file_state
from minigpt.export.hf import check_exportable, check_out_dir, export_hf
from minigpt.hf.families import family_of
from minigpt.loading import is_hf_source, load_chat_model, load_model

# a path the export writes, its state as approved before writing, and whether it is a file (GGUF) or a folder
Replaced = tuple[Path, FileState | FolderState, bool]


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


def model_name(source: str | None) -> str:
    """general.name, what llama.cpp's front ends show: the run's folder for one of its checkpoints, not last.ckpt."""
    path = Path(str(source or "minigpt"))
    if path.suffix == ".ckpt":
        return path.parent.parent.name if path.parent.name == "checkpoints" and path.parent.parent.name else path.stem
    return path.name


def run_gguf(args, out: Path, replacing: list[Replaced]) -> Path:
    checked = check_out_file(out, args.overwrite)  # before loading: a mistake in --out costs no load time
    replacing.append((out, checked, True))
    model, tokenizer = load_model(args.ckpt)
    template = None
    if is_hf_source(args.ckpt) and not isinstance(tokenizer, ChatTokenizer):  # an imported model's own template
        from minigpt.hf.chat_files import read_chat_template
        from minigpt.hf.load import resolve_hf_source

        template = read_chat_template(resolve_hf_source(args.ckpt)[0])
    name = model_name(args.ckpt)
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
    vocab = result.vocab
    # a char vocabulary is not a BPE: llama.cpp only needs a pre-tokenizer's name for it, and gpt-2's splits no char
    tokens = (
        f"char vocabulary (llama.cpp pre-tokenizer {vocab.pre})" if vocab.kind == "char" else f"tokenizer {vocab.pre}"
    )
    print(
        f"wrote {result.arch} GGUF ({result.n_params:,} parameters, {args.gguf_type}{kept}, {tokens}"
        f"{' + chat template' if vocab.chat_template else ''}) to {out}: {out.stat().st_size / 2**20:.1f} MiB",
        flush=True,
    )
    for note in result.notes:
        print(f"note: {note}", flush=True)
    return out


def run_peft(args, out: Path, replacing: list[Replaced]) -> Path:
    from minigpt.export.peft import check_out_dirs, export_peft
    from minigpt.loading import load_lora_run

    base_out = Path(args.base_out or f"{str(out).rstrip('/')}-base")
    checked = check_out_dirs(out, base_out, args.overwrite)  # before loading: a mistake costs no load time
    replacing += [(base_out, checked[1], False), (out, checked[0], False)]  # the base is written first
    model, tokenizer, lora = load_lora_run(args.ckpt)
    export_peft(model, tokenizer, lora, out, base_out, overwrite=args.overwrite, checked=checked)
    n = safetensors_params(out / "adapter_model.safetensors")
    # a fused module (GPT-2's c_attn, Phi-3's qkv_proj) holds its projections' adapters stacked: a rank of its own
    fused = json.loads((out / "adapter_config.json").read_text())["rank_pattern"]
    ranks = f"rank {lora.rank}" + "".join(f"; {rank} in {name}" for name, rank in sorted(fused.items()))
    ranks += ", whose fused projections stack theirs" if fused else ""
    show_checkpoint_lines()
    print(
        f"wrote PEFT LoRA adapters ({n:,} parameters, {ranks}) to {out} and their base, "
        f"{family_of(model.config).hf_class}, to {base_out}",
        flush=True,
    )
    return out


def problems(args) -> Iterator[str]:
    """What is wrong with the flags together, one message each."""
    if not args.out.strip():  # an unset shell variable: never the current directory
        yield "--out is empty; give the folder (or .gguf file) to write, e.g. --out hf/my-model"
    if args.format != "gguf" and args.gguf_type != "f32":
        yield "--gguf_type is a setting of --format gguf; add --format gguf, or drop --gguf_type"
    if args.format != "peft" and args.base_out is not None:
        yield "--base_out is a setting of --format peft; add --format peft, or drop --base_out"
    if args.format != "gguf" and args.out.rstrip("/").lower().endswith(".gguf"):  # a forgotten --format gguf
        yield f"--out {args.out} names a .gguf file but --format is {args.format}; add --format gguf"


def run(argv: list[str] | None = None, replacing: list[Replaced] | None = None) -> Path:
    """export.py without the one-line error handling: exports, prints the result line, returns the output path.
    `replacing` gets each path the export writes, with its state as approved, once it is checked."""
    replacing = [] if replacing is None else replacing
    args = build_parser().parse_args(argv)
    if problem := next(problems(args), None):
        raise UserError(problem)
    out = Path(args.out)
    if args.format == "gguf":
        return run_gguf(args, out, replacing)
    if args.format == "peft":
        return run_peft(args, out, replacing)
    checked = check_out_dir(out, args.overwrite)  # before loading: a mistake in --out costs no load time
    replacing.append((out, checked, False))
    model, tokenizer = load_chat_model(args.ckpt)  # an imported model keeps its own chat template
    check_exportable(model.config)
    export_hf(model, tokenizer, out, overwrite=args.overwrite, checked=checked)
    n = safetensors_params(out / "model.safetensors")
    show_checkpoint_lines()
    family = family_of(model.config)
    print(
        f"wrote {family.hf_class} ({n:,} parameters) to {out}: {', '.join(sorted(p.name for p in out.iterdir()))}",
        flush=True,
    )
    if tokenizer is not None:
        for note in family.tokenizer_notes(json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))):
            print(f"note: {note}", flush=True)
    return out


# ------------------------------------------------------------------------------------------------- Ctrl-C


def holds_new_export(path: Path, approved: FileState | FolderState, is_file: bool) -> bool:
    """Whether `path` holds a whole export other than what was there when it was approved: the final rename was
    done (its state changed) and the export's own SHA-256 record (the GGUF file's key, the folder's manifest)
    holds for every byte."""
    if (file_state(path) if is_file else folder_state(path) or frozenset()) == approved:
        return False
    try:
        check_previous_gguf(path) if is_file else check_previous_export(path)
    except (UserError, OSError):
        return False
    return True


def interrupted(replacing: list[Replaced]) -> str:
    """The line for a Ctrl-C: whether the export was complete when it came (after the final rename, while the
    result line was printed) or not (then every path is as it was, or, for peft, only the base is new)."""
    new = [path for path, approved, is_file in replacing if holds_new_export(path, approved, is_file)]
    if replacing and len(new) == len(replacing):
        return f"interrupted after the export was complete: it is in {' and '.join(map(str, new))}"
    if new:  # peft: the base folder was written, the adapters' not
        return (
            f"error: interrupted before the export was complete: {new[0]} holds the new base, "
            f"{replacing[-1][0]} is as it was; run the export again (with --overwrite)"
        )
    where = f"; {' and '.join(str(path) for path, *_ in replacing)} as it was" if replacing else ""
    return f"error: interrupted before the export was complete{where}"


def main(argv: list[str] | None = None) -> None:
    """export.py: user mistakes end in one 'error:' line and exit code 2; Ctrl-C in one line saying whether the
    export is complete, and exit code 130."""
    replacing: list[Replaced] = []

    def export() -> None:
        try:
            run(argv, replacing)
        except KeyboardInterrupt:
            print(interrupted(replacing), file=sys.stderr)
            raise SystemExit(130) from None

    try:
        with checkpoint_lines():
            run_cli(export)
    finally:
        if argv is None:  # the process's own command line: it exits next, and a Ctrl-C then changes nothing
            ignore_interrupts_until_exit()
