"""Preparation speed and memory next to the bare encoder's, on the same text with the same threads.

    python benchmarks/bench_prepare.py --corpus ../shared/data/tinyshakespeare.txt --mb 100

Method and results: docs/tokenizers.md#preparation-speed-and-memory.
"""

import json
import os
import sys
import sysconfig
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

import tiktoken

from benchmarks import common
from minigpt.core.hf_tokenizer import tokenizers_library
from minigpt.data.encoding import BATCH_CHARS
from minigpt.data.sources import CHUNK_BYTES

GOAL = 0.85
# The child reports its own peak, VmHWM: ru_maxrss would carry over this parent's, which holds the whole text
PREPARE = """import json, sys, time
from benchmarks.common import peak_rss_bytes
from minigpt.data.prepare import prepare_data
t = time.perf_counter()
prepare_data(sys.argv[1], sys.argv[2], data_root=sys.argv[3], force=True)
print('RESULT', json.dumps(dict(seconds=time.perf_counter() - t, peak_rss_mb=peak_rss_bytes() / 2**20)))
"""
COLUMNS = [("tokenizer", "tokenizer", ""), ("tokens", "tokens", ",d"), ("bare_mb_s", "bare encoder MB/s", ".2f")]
COLUMNS += [("prepare_mb_s", "preparation MB/s", ".2f"), ("ratio", "preparation / bare", ".0%")]
COLUMNS += [("peak_rss_mb", "peak RSS MB", ".0f")]


def make_text(corpus: Path | None, mb: float, out: Path) -> Path:
    """--corpus (or the standard library's .py files) repeated to `mb` megabytes, cut at a line end."""
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]
    seed = corpus.read_bytes() if corpus else b"".join(p.read_bytes() for p in stdlib)
    target = int(mb * 1e6)
    with open(out, "wb") as f:
        for _ in range(target // len(seed)):
            f.write(seed)
        rest = seed[: target % len(seed)]
        f.write(rest[: rest.rfind(b"\n") + 1])
    return out


def prepare_in_child(text: Path, tokenizer: str, data_root: Path) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of prepare_data in a fresh interpreter, as that interpreter measures them."""
    ran = common.child_json([sys.executable, "-c", PREPARE, str(text), tokenizer, str(data_root)])
    return ran["seconds"], ran["peak_rss_mb"]


def batches(text: Path) -> list[list[str]]:
    """The text as preparation hands it to the encoder: pieces of a read chunk, BATCH_CHARS per call."""
    data = text.read_text(encoding="utf-8", errors="replace")
    pieces = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
    per_batch = max(1, BATCH_CHARS // CHUNK_BYTES)
    return [pieces[i : i + per_batch] for i in range(0, len(pieces), per_batch)]


def compare(name: str, encode_batch, text_batches, text: Path, tokenizer: str, data_root: Path, repeat: int) -> dict:
    """The bare encoder and the preparation in turns, `repeat` times, the fastest of each (this VM's speed drifts by
    10-20% over minutes: turns see the same drift), and the largest peak RSS."""
    bare_runs, prep_runs = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        tokens = sum(len(ids) for batch in text_batches for ids in encode_batch(batch))
        bare_runs.append(time.perf_counter() - t)
        prep_runs.append(prepare_in_child(text, tokenizer, data_root))
    bare_s, prep_s = min(bare_runs), min(s for s, _ in prep_runs)
    mb = text.stat().st_size / 1e6
    row = dict(tokenizer=name, tokens=tokens, bare_mb_s=mb / bare_s, prepare_mb_s=mb / prep_s, ratio=bare_s / prep_s)
    return row | dict(peak_rss_mb=max(rss for _, rss in prep_runs))


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__, "prepare", device=False)  # on the CPU
    p.add_argument("--corpus", type=Path, help="a text file to repeat (default: the standard library's sources)")
    p.add_argument("--mb", type=common.positive_float, default=100.0, help="megabytes of text (default 100)")
    p.add_argument(
        "--vocab", type=common.positive_int, default=8192, help="the trained BPE's vocabulary (default 8192)"
    )
    p.add_argument(
        "--repeat", type=common.positive_int, default=2, help="turns of bare encoder and preparation (default 2)"
    )
    p.add_argument("--tiktoken", default="gpt2", help="the gpt2 row's encoding (r50k_base: the same ranks)")
    args = p.parse_args(argv)
    if args.quick:
        args.mb, args.vocab, args.repeat = 2.0, 1024, 1
    if args.corpus and not args.corpus.is_file():
        p.error(f"--corpus {args.corpus}: no such file")
    label = common.start(args)
    threads = os.cpu_count()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = make_text(args.corpus, args.mb, tmp / "text.txt")
        mb = text.stat().st_size / 1e6
        text_batches = batches(text)
        spec = f"bpe:{args.vocab}"
        train_s, rss = prepare_in_child(text, spec, tmp / "trained")  # trains on 90 %, then encodes everything
        trained = dict(tokenizer=f"{spec} trained on the text, then preparing it", prepare_mb_s=mb / train_s)
        rows = [trained | dict(peak_rss_mb=rss)]
        tokenizer_json = json.loads(next((tmp / "trained").glob("*/tokenizer.json")).read_text())["tokenizer_json"]
        (tmp / "bpe.json").write_text(tokenizer_json)
        print(f"{spec}: trained and prepared in {train_s:.1f}s")
        backend = tokenizers_library().Tokenizer.from_str(tokenizer_json)
        bpe = (str(tmp / "bpe.json"), tmp / "data-bpe", args.repeat)
        ids = lambda batch: [e.ids for e in backend.encode_batch_fast(batch)]  # noqa: E731  (lists, as preparation's)
        rows.append(compare(f"{spec} (tokenizers)", ids, text_batches, text, *bpe))
        try:
            encoding = tiktoken.get_encoding(args.tiktoken)
        except OSError as e:  # offline, and no TIKTOKEN_CACHE_DIR holding its file
            print(f"{args.tiktoken}: skipped, its files cannot be read ({type(e).__name__})")
        else:
            encode = partial(encoding.encode_ordinary_batch, num_threads=threads)
            gpt2 = (args.tiktoken, tmp / "data-gpt2", args.repeat)
            rows.append(compare(f"{args.tiktoken} (tiktoken)", encode, text_batches, text, *gpt2))
    print(f"{mb:.1f} MB of text, {threads} threads; goal: preparation at >= {GOAL:.0%} of the bare encoder")
    common.print_table(rows, COLUMNS)
    return common.finish(dict(machine=label, mb=mb, threads=threads, train_and_prepare_s=train_s, rows=rows), args)


if __name__ == "__main__":
    main()
