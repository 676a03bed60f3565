"""Preparation speed and memory next to the bare encoder's, on the same text with the same threads.

    python benchmarks/bench_prepare.py --corpus ../shared/data/tinyshakespeare.txt --mb 100
    python benchmarks/bench_prepare.py --mb 1000 --repeat 1              # the peak-RSS figure at 1 GB
    python benchmarks/bench_prepare.py --quick                           # 2 MB, a smoke test

The text: --corpus repeated up to --mb megabytes (default: this Python's standard library sources).  A byte-level
BPE of --vocab tokens is trained on it first (bpe:VOCAB, timed), then each tokenizer prepares the whole text in a
fresh interpreter (its wall time and peak RSS) and the bare encoder encodes the same text in memory, in the same
batches, with the same threads: `tokenizers` encode_batch_fast for the BPE, tiktoken encode_ordinary_batch for
gpt2 (or, offline, for a tiktoken encoding built from the trained BPE's merges: the same tokens, tiktoken's code).
Goal: preparation at >= GOAL of the bare encoder's rate.  Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks.common import (
    common_parser,
    describe_machine,
    machine_label,
    markdown_table,
    wait_for_quiet,
    write_json,
)

GOAL = 0.85
# The child reports its own peak from VmHWM: the high-water mark of its own address space.  Its ru_maxrss would not
# do: Linux carries the parent's peak across fork and exec, and this parent holds the whole text in memory.
PREPARE = (
    "import resource, sys, time\nfrom minigpt.data.prepare import prepare_data\nt = time.perf_counter()\n"
    "prepare_data(sys.argv[1], sys.argv[2], data_root=sys.argv[3], force=True)\n"
    "print('SECONDS', time.perf_counter() - t)\n"
    "try:\n    status = open('/proc/self/status').read()\n"
    "    print('PEAK_KB', next(l.split()[1] for l in status.splitlines() if l.startswith('VmHWM:')))\n"
    "except OSError:\n    print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
)


def make_text(corpus: Path | None, mb: float, out: Path) -> Path:
    """--corpus (or the standard library's .py files) repeated to `mb` megabytes, cut at a line end."""
    if corpus is not None:
        seed = corpus.read_bytes()
    else:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        seed = b"".join(p.read_bytes() for p in sorted(stdlib.glob("*.py"))[:200])
    target = int(mb * 1e6)
    with open(out, "wb") as f:
        written = 0
        while written < target:
            piece = seed[: target - written]
            piece = piece[: piece.rfind(b"\n") + 1] or piece
            f.write(piece)
            written += len(piece)
    return out


def prepare_in_child(text: Path, tokenizer: str, data_root: Path) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of prepare_data in a fresh interpreter, as that interpreter measures them."""
    done = subprocess.run(
        [sys.executable, "-c", PREPARE, str(text), tokenizer, str(data_root)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    if done.returncode != 0:
        raise SystemExit(f"preparation failed:\n{done.stderr[-2000:]}")
    said = dict(line.split(maxsplit=1) for line in done.stdout.splitlines() if line.startswith(("SECONDS", "PEAK_KB")))
    return float(said["SECONDS"]), int(said["PEAK_KB"]) / 1024


def best_of(repeat: int, bare, prepare) -> tuple[float, int, float, float]:
    """(bare seconds, tokens, preparation seconds, peak RSS MB): the bare encoder and the preparation in turns,
    `repeat` times, the fastest of each (this VM's speed drifts by 10-20% over minutes: turns see the same drift)."""
    bare_runs, prep_runs = [], []
    for _ in range(repeat):
        bare_runs.append(bare())
        prep_runs.append(prepare())
    (bare_s, tokens), (prep_s, _) = min(bare_runs), min(prep_runs)
    return bare_s, tokens, prep_s, max(rss for _, rss in prep_runs)


def batches(text: Path) -> list[list[str]]:
    """The text as preparation hands it to the encoder: pieces of a read chunk, BATCH_CHARS per call."""
    from minigpt.data.encoding import BATCH_CHARS
    from minigpt.data.sources import CHUNK_BYTES

    data = text.read_text(encoding="utf-8", errors="replace")
    pieces = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
    per_batch = max(1, BATCH_CHARS // CHUNK_BYTES)
    return [pieces[i : i + per_batch] for i in range(0, len(pieces), per_batch)]


def time_bare(encode_batch, text_batches: list[list[str]]) -> tuple[float, int]:
    t = time.perf_counter()
    tokens = sum(len(ids) for batch in text_batches for ids in encode_batch(batch))
    return time.perf_counter() - t, tokens


def tiktoken_twin(tokenizer_json: str):
    """A tiktoken Encoding with the trained byte-level BPE's tokens as ranks (merge order) and GPT-2's pattern:
    what the gpt2 row measures when gpt2's files cannot be downloaded."""
    import tiktoken

    from minigpt.core.hf_tokenizer import tokenizers_library

    backend = tokenizers_library().Tokenizer.from_str(tokenizer_json)
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    specials = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
    ranks = {bytes(byte_of[c] for c in token): i for token, i in backend.get_vocab().items() if token not in specials}
    pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding("bpe-twin", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE's alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def main(argv: list[str] | None = None) -> dict:
    p = common_parser(__doc__.split("\n\n")[0], "prepare")
    p.add_argument("--corpus", type=Path, help="a text file to repeat (default: the standard library's sources)")
    p.add_argument("--mb", type=float, default=100.0, help="megabytes of text (default 100)")
    p.add_argument("--vocab", type=int, default=8192, help="the trained BPE's vocabulary (default 8192)")
    p.add_argument(
        "--tokenizers", default="bpe,gpt2", help="which rows beside the training one: bpe, gpt2 (default both), none"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="turns of bare encoder and preparation; the fastest of each is reported (default 2)",
    )
    p.add_argument(
        "--tiktoken",
        default="gpt2",
        help="the tiktoken encoding of the gpt2 row (default gpt2; "
        "r50k_base has the same ranks, for a cache seeded by hand)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.mb, args.vocab, args.repeat = 2.0, 1024, 1
    wait_for_quiet(tries=args.wait_quiet)
    label = machine_label("cpu")
    threads = os.cpu_count()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = make_text(args.corpus, args.mb, tmp / "text.txt")
        mb = text.stat().st_size / 1e6
        text_batches = batches(text) if args.tokenizers != "none" else []
        spec = f"bpe:{args.vocab}"
        t = time.perf_counter()
        prepared = prepare_in_child(text, spec, tmp / "trained")  # trains on 90 %, then encodes everything
        train_s = prepared[0]
        tokenizer_file = next((tmp / "trained").glob("*/tokenizer.json"))
        tokenizer_json = json.loads(tokenizer_file.read_text())["tokenizer_json"]
        (tmp / "bpe.json").write_text(tokenizer_json)
        print(f"{spec}: trained and prepared in {train_s:.1f}s ({time.perf_counter() - t:.1f}s with start-up)")
        rows.append(
            {
                "tokenizer": f"{spec} trained on the text, then preparing it",
                "tokens": None,
                "bare_mb_s": None,
                "prepare_mb_s": mb / train_s,
                "ratio": None,
                "peak_rss_mb": prepared[1],
            }
        )

        from minigpt.core.hf_tokenizer import tokenizers_library

        if "bpe" in args.tokenizers:
            backend = tokenizers_library().Tokenizer.from_str(tokenizer_json)
            bare_s, tokens, prep_s, rss = best_of(
                args.repeat,
                lambda: time_bare(lambda b: [e.ids for e in backend.encode_batch_fast(b)], text_batches),
                lambda: prepare_in_child(text, str(tmp / "bpe.json"), tmp / "data-bpe"),
            )
            rows.append(
                {
                    "tokenizer": f"{spec} (tokenizers)",
                    "tokens": tokens,
                    "bare_mb_s": mb / bare_s,
                    "prepare_mb_s": mb / prep_s,
                    "ratio": bare_s / prep_s,
                    "peak_rss_mb": rss,
                }
            )
        if "gpt2" in args.tokenizers:
            import tiktoken

            try:
                encoding, setting = tiktoken.get_encoding(args.tiktoken), args.tiktoken
                name = f"{setting} (tiktoken)"
            except OSError:  # offline: the same merges as the trained BPE, through tiktoken's code
                encoding, name = tiktoken_twin(tokenizer_json), f"{spec}'s merges (tiktoken, gpt2 offline)"
                setting = None
            if setting is not None:
                bare_s, tokens, prep_s, rss = best_of(
                    args.repeat,
                    lambda: time_bare(lambda b: encoding.encode_ordinary_batch(b, num_threads=threads), text_batches),
                    lambda: prepare_in_child(text, setting, tmp / "data-gpt2"),
                )
                rows.append(
                    {
                        "tokenizer": name,
                        "tokens": tokens,
                        "bare_mb_s": mb / bare_s,
                        "prepare_mb_s": mb / prep_s,
                        "ratio": bare_s / prep_s,
                        "peak_rss_mb": rss,
                    }
                )
            else:
                bare_s, tokens = time_bare(
                    lambda b: encoding.encode_ordinary_batch(b, num_threads=threads), text_batches
                )
                rows.append(
                    {
                        "tokenizer": name,
                        "tokens": tokens,
                        "bare_mb_s": mb / bare_s,
                        "prepare_mb_s": None,
                        "ratio": None,
                        "peak_rss_mb": None,
                    }
                )  # minigpt takes no twin
    print(describe_machine(label))
    print(f"{mb:.1f} MB of text, {threads} threads; goal: preparation at >= {GOAL:.0%} of the bare encoder")
    print(
        markdown_table(
            rows,
            [
                ("tokenizer", "tokenizer", ""),
                ("tokens", "tokens", ",d"),
                ("bare_mb_s", "bare encoder MB/s", ".2f"),
                ("prepare_mb_s", "preparation MB/s", ".2f"),
                ("ratio", "preparation / bare", ".0%"),
                ("peak_rss_mb", "peak RSS MB", ".0f"),
            ],
        )
    )
    result = {"machine": label, "mb": mb, "threads": threads, "train_and_prepare_s": train_s, "rows": rows}
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
