"""Recipe: a sample of FineWeb-Edu (educational web pages, English) as a local JSONL corpus, streamed with
`datasets` so only the sampled rows are downloaded (the sample-10BT config alone is ~27 GB).

    python3 data/fineweb_edu.py --docs 20000                  # -> data/fineweb-edu-20000.jsonl (~100 MB)
    python3 train.py --data.source data/fineweb-edu-20000.jsonl --data.tokenizer bpe:8192

Needs internet.  The file is written whole or not at all (a temporary file renamed into place), so an
interrupted download never passes for a complete corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DATASET, CONFIG = "HuggingFaceFW/fineweb-edu", "sample-10BT"


def sample(
    docs: int, out: Path, dataset: str = DATASET, config: str | None = CONFIG, data_files: str | None = None
) -> Path:
    """The first `docs` rows' text of the dataset's train split, streamed, as JSONL {"text": ...} at `out`."""
    from datasets import load_dataset

    from minigpt.core.errors import DataError
    from minigpt.core.fsutil import write_errors
    from minigpt.data.sources import check_hub_reachable, hub_retries_quiet
    from minigpt.data.tables import dataset_failure

    if docs < 1:
        raise DataError(f"--docs must be >= 1, got {docs}")
    if not data_files:  # offline, datasets retries for ~25 s, then a traceback: one line at once instead
        check_hub_reachable(dataset)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    written = 0
    with write_errors(out, "pass --out a path in a writable folder with room"):  # (under a file, read-only)
        out.parent.mkdir(parents=True, exist_ok=True)
        f = open(tmp, "w", encoding="utf-8")  # (closed by the with below)
    try:
        with f, hub_retries_quiet():
            try:  # rows are streamed: the network can fail at any row, not only when the dataset opens
                rows = (
                    load_dataset(dataset, data_files=data_files, split="train", streaming=True)
                    if data_files
                    else load_dataset(dataset, config, split="train", streaming=True)
                )
                for row in rows:
                    if written == docs:
                        break
                    if isinstance(row.get("text"), str) and row["text"].strip():
                        f.write(json.dumps({"text": row["text"]}, ensure_ascii=False) + "\n")
                        written += 1
            except (TypeError, AttributeError, NameError, AssertionError, ImportError):
                raise  # a bug: its traceback
            except Exception as e:  # datasets raises many types (hub, network, parsing): one line for any
                raise DataError(
                    f"could not read {dataset} ({dataset_failure(e)}) after {written} row(s); check your network "
                    "(and --dataset/--config), then run again: nothing was written"
                ) from None
        if written < docs:
            print(f"note: the dataset has only {written} rows with text; wrote them all", file=sys.stderr)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    print(
        f"wrote {written} documents ({out.stat().st_size / 1e6:.1f} MB) to {out}; train on it with:\n"
        f"  python3 train.py --data.source {out} --data.tokenizer bpe:8192"
    )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--docs", type=int, default=20000, help="how many documents (default 20000, ~100 MB)")
    p.add_argument("--out", type=Path, help="the JSONL file (default data/fineweb-edu-DOCS.jsonl)")
    p.add_argument(
        "--dataset", default=DATASET, help=f"a hub dataset name or a builder such as json (default {DATASET})"
    )
    p.add_argument("--config", default=CONFIG, help=f"the dataset's config (default {CONFIG})")
    p.add_argument("--data_files", help="local files for a builder dataset (json, parquet): a stand-in for tests")
    args = p.parse_args(argv)
    out = args.out or Path(__file__).parent / f"fineweb-edu-{args.docs}.jsonl"
    from minigpt.cli.errors import run_cli

    run_cli(lambda: sample(args.docs, out, args.dataset, args.config, args.data_files))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
    main()
