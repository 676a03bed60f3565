"""Recipe: Tiny Shakespeare (1.1 MB, nanoGPT's char-level benchmark) as data/tinyshakespeare.txt.

    python3 data/tinyshakespeare.py
    python3 train.py --data.source data/tinyshakespeare.txt            # char-level, as nanoGPT's shakespeare_char

train.py also takes the URL itself as --data.source (downloaded once into the data folder); this recipe keeps a
plain copy to read, edit or split.  Needs internet; fetched with minigpt's downloader (bounded waits, the whole
Content-Length or nothing, never an HTML page).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def fetch(out: Path, url: str = URL) -> Path:
    from minigpt.cli.errors import run_cli
    from minigpt.data.sources import download

    def copy() -> None:
        cached = download(url, out.parent)
        tmp = out.with_name(f".{out.name}.tmp")
        shutil.copyfile(cached, tmp)
        tmp.replace(out)
        cached.unlink()
        print(f"wrote {out} ({out.stat().st_size:,} bytes); train on it with:\n  python3 train.py --data.source {out}")

    run_cli(copy)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "tinyshakespeare.txt")
    p.add_argument("--url", default=URL)
    args = p.parse_args(argv)
    fetch(args.out, args.url)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
    main()
