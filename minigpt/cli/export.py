"""The `export.py` command line: load a checkpoint, write it as a Hugging Face model directory, print one line.

    python export.py --ckpt out/RUN --out hf/my-model          # then AutoModelForCausalLM.from_pretrained(...)
    python export.py --ckpt out/RUN --out hf/my-model --overwrite

The export itself is minigpt.export.hf.export_hf; loading is minigpt.loading.load_model.  Every user mistake
(a bad flag, checkpoint, an option Hugging Face cannot express, an --out that holds files or lies below a file, a
full disk) ends in one `error:` line and exit code 2; Ctrl-C in one `error: interrupted` line and exit code 130,
leaving a previous export as it was.
"""

from __future__ import annotations

import math
from pathlib import Path

from minigpt.loading import load_model
from minigpt.cli.parsing import CommandParser, add_source_argument
from minigpt.core.errors import UserError
from minigpt.cli.errors import run_cli
from minigpt.export.hf import HF_CLASS, check_exportable, check_out_dir, export_hf


def build_parser() -> CommandParser:
    p = CommandParser(prog="export.py", description="Write a minigpt checkpoint as a Hugging Face model directory "
                      "(config.json, model.safetensors, tokenizer) that transformers loads with from_pretrained.")
    add_source_argument(p)
    p.add_argument("--out", type=str, required=True, help="folder to write; must not hold files yet")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it holds a previous export, unchanged "
                   "(its minigpt_export.json lists every file in it)")
    return p


def safetensors_params(path: Path) -> int:
    """Parameters in a .safetensors file, read from its header (what a loader will find)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def run(argv: list[str] | None = None) -> Path:
    """export.py without the one-line error handling: exports, prints the result line, returns the folder."""
    args = build_parser().parse_args(argv)
    if not args.out.strip():  # an unset shell variable: never the current directory
        raise UserError("--out is empty; give the folder to write, e.g. --out hf/my-model")
    out = Path(args.out)
    checked = check_out_dir(out, args.overwrite)  # before loading: a mistake in --out costs no load time
    model, tokenizer = load_model(args.ckpt)
    check_exportable(model.config)
    export_hf(model, tokenizer, out, overwrite=args.overwrite, checked=checked)
    n = safetensors_params(out / "model.safetensors")
    print(f"wrote {HF_CLASS[model.config.arch]} ({n:,} parameters) to {out}: "
          f"{', '.join(sorted(p.name for p in out.iterdir()))}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    """export.py: user mistakes end in one 'error:' line and exit code 2."""
    run_cli(lambda: run(argv))
