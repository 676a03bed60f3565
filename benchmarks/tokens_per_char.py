"""Tokens per character of each tokenizer on each corpus, and the CPU recipe's bits per character with char vs a
BPE trained on the corpus: the figures that compare runs across tokenizers.

    python benchmarks/tokens_per_char.py --text english=../shared/data/tinyshakespeare.txt --text russian=ru.txt
    python benchmarks/tokens_per_char.py --text english=... --recipe         # + the 114 s recipe, char vs bpe:4096
    python benchmarks/tokens_per_char.py --quick --text english=...         # char, byte, bpe:300; no recipe

Counted on each corpus's validation split as train.py prepares it (the BPEs are trained on the training split
only, so the figure is what a new text of the same kind costs).  gpt2 needs tiktoken's download: offline its
row says so.  --recipe runs benchmarks/time_to_loss.py's recipe variant (configs/shakespeare_char_cpu.yaml,
--budget seconds) per corpus with each of --recipe_tokenizers, and turns its final validation loss (nats per
token) into bits per character: loss x validation tokens / validation characters / ln 2.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks.common import common_parser, describe_machine, machine_label, markdown_table, write_json
from minigpt.core.errors import UserError
from minigpt.data.prepare import load_prepared, prepare_data


def val_counts(source: str, tokenizer: str, data_root: Path) -> tuple[int, int]:
    """(validation tokens, validation characters) of `source` prepared with `tokenizer`; end-of-text tokens are
    counted as tokens (the model predicts them) but stand for no character."""
    data = load_prepared(prepare_data(source, tokenizer, data_root=data_root))
    ids = data.val.tolist()
    eot = data.tokenizer.eot_id
    return len(ids), len(data.tokenizer.decode([i for i in ids if i != eot]))


def main(argv: list[str] | None = None) -> dict:
    p = common_parser(__doc__.split("\n\n")[0], "tokens_per_char")
    p.add_argument("--text", action="append", required=True, metavar="NAME=FILE", help="a corpus (repeatable)")
    p.add_argument("--tokenizers", default="char,byte,gpt2,bpe:4096,bpe:8192")
    p.add_argument("--recipe", action="store_true", help="also train the CPU recipe per corpus and tokenizer")
    p.add_argument("--recipe_tokenizers", default="char,bpe:4096")
    p.add_argument("--budget", type=float, default=114.0, help="training seconds per recipe run (default 114)")
    p.add_argument("--data_root", help="where to keep the prepared data (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.quick:
        args.tokenizers, args.recipe = "char,byte,bpe:300", False
    corpora = dict(item.split("=", 1) for item in args.text)
    label = machine_label("cpu")
    rows, recipe_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        data_root = Path(args.data_root or tmp)
        counts: dict[tuple[str, str], tuple[int, int]] = {}
        for tokenizer in args.tokenizers.split(","):
            row = {"tokenizer": tokenizer}
            for name, path in corpora.items():
                try:
                    counts[name, tokenizer] = tokens, chars = val_counts(path, tokenizer, data_root)
                    row[name] = tokens / chars
                except UserError as e:  # gpt2 offline, a BPE larger than a small corpus can fill
                    print(f"{tokenizer} on {name}: {e}", file=sys.stderr)
                    row[name] = None
            rows.append(row)
        if args.recipe:
            from benchmarks import time_to_loss

            for name, path in corpora.items():
                for tokenizer in args.recipe_tokenizers.split(","):
                    result = time_to_loss.main(
                        [
                            "--corpus",
                            path,
                            "--variants",
                            "recipe",
                            "--budget",
                            str(args.budget),
                            "--json",
                            str(Path(tmp) / "ttl.json"),
                            f"--extra=--data.tokenizer={tokenizer}",
                        ]
                    )
                    loss = result["results"][0]["full_val_loss"]
                    tokens, chars = counts.get((name, tokenizer)) or val_counts(path, tokenizer, data_root)
                    recipe_rows.append(
                        {
                            "corpus": name,
                            "tokenizer": tokenizer,
                            "nats_per_token": loss,
                            "tokens_per_char": tokens / chars,
                            "bits_per_char": loss * tokens / chars / math.log(2),
                            "steps": result["results"][0]["steps"],
                        }
                    )
    print(describe_machine(label))
    print("Tokens per character (validation split):")
    print(markdown_table(rows, [("tokenizer", "tokenizer", ""), *((n, n, ".3f") for n in corpora)]))
    if recipe_rows:
        print(f"\nThe CPU recipe ({args.budget:g} s of training) per tokenizer:")
        print(
            markdown_table(
                recipe_rows,
                [
                    ("corpus", "corpus", ""),
                    ("tokenizer", "tokenizer", ""),
                    ("steps", "steps", "d"),
                    ("nats_per_token", "val nats/token", ".4f"),
                    ("tokens_per_char", "tokens/char", ".3f"),
                    ("bits_per_char", "val bits/char", ".4f"),
                ],
            )
        )
    result = {"machine": label, "corpora": corpora, "tokens_per_char": rows, "recipe": recipe_rows}
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
