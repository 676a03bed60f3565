"""Tokens per character of each tokenizer on each corpus: the figure that compares runs across tokenizers.

    python benchmarks/tokens_per_char.py --text english=../shared/data/tinyshakespeare.txt --text russian=ru.txt

Method and results: docs/tokenizers.md#tokens-per-character.
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks import common
from minigpt.core.errors import UserError
from minigpt.data.prepare import load_prepared, prepare_data


def tokens_per_char(source: str, tokenizer: str, data_root: Path) -> float:
    """Validation tokens / validation characters of `source` prepared with `tokenizer`; end-of-text tokens are
    counted as tokens (the model predicts them) but stand for no character."""
    data = load_prepared(prepare_data(source, tokenizer, data_root=data_root))
    ids = data.val.tolist()
    return len(ids) / len(data.tokenizer.decode([i for i in ids if i != data.tokenizer.eot_id]))


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__, "tokens_per_char", device=False)  # on the CPU
    p.add_argument("--text", action="append", required=True, metavar="NAME=FILE", help="a corpus (repeatable)")
    p.add_argument("--tokenizers", default="char,byte,gpt2,bpe:4096,bpe:8192")
    args = p.parse_args(argv)
    if args.quick:
        args.tokenizers = "char,byte,bpe:300"
    if bad := [item for item in args.text if "=" not in item]:
        p.error(f"--text {bad[0]}: give NAME=FILE, e.g. --text english=tinyshakespeare.txt")
    corpora = dict(item.split("=", 1) for item in args.text)
    if missing := [path for path in corpora.values() if not Path(path).is_file()]:
        p.error(f"--text: {missing[0]} is not a file; give NAME=FILE with a text file")
    label = common.start(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tokenizer in args.tokenizers.split(","):
            row = {"tokenizer": tokenizer}
            for name, path in corpora.items():
                try:
                    row[name] = tokens_per_char(path, tokenizer, Path(tmp))
                except UserError as e:  # gpt2 offline, a BPE larger than a small corpus can fill
                    print(f"{tokenizer} on {name}: {e}", file=sys.stderr)
            rows.append(row)
    table = [("tokenizer", "tokenizer", ""), *((name, name, ".3f") for name in corpora)]
    common.print_table(rows, table, "Tokens per character:")
    return common.finish({"machine": label, "corpora": corpora, "tokens_per_char": rows}, args)


if __name__ == "__main__":
    main()
