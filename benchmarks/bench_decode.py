"""Greedy decoding per CPU kind: the whole sample.py command per speed flag, and the rates after warm-up (minigpt
float32 and int8, eager and compiled, against transformers' generate and the memory-bandwidth bound).

    python benchmarks/bench_decode.py --kinds native,avx2  # as this CPU is, and as an AVX2 one; GPT-2 and SmolLM2
    python benchmarks/bench_decode.py --quick              # tiny shapes: a smoke test
    python benchmarks/bench_decode.py --shapes smollm2 --threads 1 --no_commands
    python benchmarks/bench_decode.py --quality out/RUN --text FILE   # int8 against float32 on a trained model
    python benchmarks/bench_decode.py --device cuda        # a GPU: single-stream greedy and the serve engine
    python benchmarks/bench_decode.py --device cpu --quick --single_stream   # the same, tiny: its smoke test

--kinds: each kind in a process of its own, `avx2` with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (an
AVX-512 machine computing as an AVX2 one), each with empty caches of its own (decisions, compiled code).
Commands: `sample.py --ckpt FOLDER --max_new_tokens 128 --temperature 0` on the GPT-2-124M shape with each flag
combination, twice in a row (the first measures and compiles what it decides to, the second finds it cached): the
whole command's wall clock and the notes in which it said what it decided.
Rates: each shape as a Hugging Face folder with random weights (transformers' own init, no download) loaded as
minigpt float32 and int8 (load_model(quantize="int8"): the kernel chosen here, or float32 where int8 is slower)
and by transformers; 128 greedy tokens after 16: one untimed call, then the median of --repeats.  "eager" is
generate() as called without compile, "compiled step" generate(compile=True) whatever the compile costs.
Prefill: one call reading a 512-token prompt.  Bound: the read bandwidth (best `sum` over 1 GiB of float32, same
threads) over the bytes one decode step reads (every weight once; an untied table's and positions' one row).
On a GPU (--device cuda, or --single_stream): GPT-2-124M, float32: minigpt eager, compiled (CUDA graphs) and
transformers, and the serve engine's one-client rate (minigpt.serve.engine.Engine, no HTTP).
--quality CKPT --text FILE: perplexity in float32 and int8, and how often their most likely next tokens agree.
Writes benchmarks/results/decode.json (--json).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks.common import (
    common_parser,
    describe_machine,
    load_avg,
    machine_label,
    markdown_table,
    median,
    mib,
    pick_device,
    synchronize,
    wait_for_quiet,
    write_json,
)
from minigpt.core.generation import generate
from minigpt.core.model import GPT
from minigpt.core.quantize import Int8Embedding, Int8Linear, choose_int8, quantize_model
from minigpt.loading import load_model

GIB = 2**30
CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parent.parent
KINDS = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
FLAGS = {"none": [], "--quantize int8": ["--quantize", "int8"], "--compile": ["--compile"]}
FLAGS["--quantize int8 --compile"] = FLAGS["--quantize int8"] + FLAGS["--compile"]


# --------------------------------------------------------------------------------------------------
# The shapes, as transformers configs (no end-of-text id: every call generates all its tokens)


def hf_config(shape: str, quick: bool) -> Any:
    import transformers

    none = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if shape == "gpt2":
        size = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=1024) if quick else {}
        return transformers.GPT2Config(**size, **none)
    keys = "hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads vocab_size"
    size = dict(zip(keys.split(), (64, 160, 2, 4, 2, 512) if quick else (576, 1536, 30, 9, 3, 49152)))
    return transformers.LlamaConfig(
        **size, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, **none
    )


SHAPE_NAMES = {"gpt2": "GPT-2-124M", "smollm2": "SmolLM2-135M"}


def build_hf_folder(shape: str, quick: bool, folder: Path, seed: int) -> Path:
    """A Hugging Face model folder with transformers' random init and a byte tokenizer (no download)."""
    import transformers

    from minigpt.core.tokenizers import ByteTokenizer
    from minigpt.hf.tokenizer_files import save_hf_tokenizer

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(shape, quick))
    model.save_pretrained(folder)
    save_hf_tokenizer(ByteTokenizer(), folder)
    return folder


# --------------------------------------------------------------------------------------------------
# Bytes and bandwidth


def bytes_per_token(model: GPT) -> int:
    """Bytes of weights one decode step reads: each tensor of the state once (shared ones once), except the
    tables read a row at a time (an embedding that is not also the head, learned positions)."""
    head = {t.data_ptr() for t in model.lm_head.state_dict().values()}
    tables = [m for m in model.modules() if isinstance(m, (nn.Embedding, Int8Embedding))]
    rows_only = {t.data_ptr() for m in tables for t in m.state_dict().values()} - head
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    return sum(size for ptr, size in tensors.items() if ptr not in rows_only)


def read_bandwidth(nbytes: int = GIB, repeats: int = 10) -> float:
    """Bytes/s of the fastest of `repeats` sums over a float32 tensor of nbytes (read once each)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    return nbytes / min(timeit.repeat(x.sum, number=1, repeat=repeats))


# --------------------------------------------------------------------------------------------------
# Timing the three ways


def hf_generate(hf: Any, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    mask = torch.ones_like(prompt)
    with torch.inference_mode():
        return hf.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=tokens, pad_token_id=0)


def measure_shape(shape: str, args: Any, work: Path) -> list[dict[str, Any]]:
    import transformers

    src = build_hf_folder(shape, args.quick, work / shape, args.seed)
    fp32, _ = load_model(src)
    int8, _ = load_model(src, quantize="int8")  # float32 where int8 is measured slower here (a note says so)
    int8_kind = "int8" if isinstance(int8.lm_head, Int8Linear) else "int8 declined -> float32"
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    vocab = fp32.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, vocab, (1, args.prompt_tokens), generator=gen)
    long_prompt = torch.randint(0, vocab, (1, args.prefill_tokens), generator=gen)
    ways = {
        "minigpt float32, eager": (fp32, lambda p, n: generate(fp32, p, n, temperature=0.0)),
        "minigpt float32, compiled step": (fp32, lambda p, n: generate(fp32, p, n, temperature=0.0, compile=True)),
        f"minigpt {int8_kind}, eager": (int8, lambda p, n: generate(int8, p, n, temperature=0.0)),
        f"minigpt {int8_kind}, compiled step": (int8, lambda p, n: generate(int8, p, n, temperature=0.0, compile=True)),
        "transformers float32": (fp32, lambda p, n: hf_generate(hf, p, n)),
    }
    rows = []
    for way, (model, run) in ways.items():
        ids, first_s, seconds = synced_median(lambda run=run: run(prompt, args.tokens), CPU, args.repeats)
        _, _, prefill_s = synced_median(lambda run=run: run(long_prompt, 1), CPU, max(1, args.repeats - 1))
        row = dict(shape=SHAPE_NAMES[shape], way=way, ids=ids[0, args.prompt_tokens :].tolist(), first_call_s=first_s)
        row |= dict(tokens_per_s=args.tokens / seconds, prefill_tokens_per_s=args.prefill_tokens / prefill_s)
        rows.append(row | dict(weight_bytes=bytes_per_token(model), int8_decision=": ".join(choose_int8(fp32))))
        print(f"  {row['shape']}, {way}: {row['tokens_per_s']:.1f} tokens/s (first call {first_s:.1f} s)", flush=True)
    reference, own_fp32 = rows[-1], rows[0]
    for r in rows:
        r["vs_transformers"] = r["tokens_per_s"] / reference["tokens_per_s"]
        r["vs_own_float32_eager"] = r["tokens_per_s"] / own_fp32["tokens_per_s"]
        r["ids_equal_transformers"] = r["ids"] == reference["ids"]
        r["agreement_with_transformers"] = sum(a == b for a, b in zip(r["ids"], reference["ids"])) / len(r["ids"])
        r["weight_mib"] = mib(r["weight_bytes"])
    return rows


# --------------------------------------------------------------------------------------------------
# The whole command: sample.py per flag combination, first and second run


def time_commands(args: Any, work: Path) -> list[dict[str, Any]]:
    """sample.py's wall clock for each flag combination, twice each, with caches empty at the start (this kind's
    own, under `work`): the first run pays for what it measures or compiles, the second finds it cached."""
    src = build_hf_folder("gpt2", args.quick, work / "gpt2-command", args.seed)
    env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    rows = []
    for flags, extra in FLAGS.items():
        row: dict[str, Any] = dict(flags=flags)
        for run in ("first", "second")[: 1 if args.quick else 2]:
            cmd = [sys.executable, str(REPO / "sample.py"), "--ckpt", str(src), "--prompt", "Once upon a time"]
            cmd += ["--max_new_tokens", str(args.tokens), "--temperature", "0", "--no-stop", *extra]
            t0 = time.perf_counter()
            out = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
            row[f"{run}_s"] = time.perf_counter() - t0
            if out.returncode != 0:
                raise SystemExit(f"error: {' '.join(cmd)} failed: {out.stderr.strip()[-500:]}")
            notes = [line.removeprefix("note: ") for line in out.stderr.splitlines() if line.startswith("note:")]
            row[f"{run}_notes"] = " / ".join(notes) or "-"
        rows.append(row)
        print(f"  sample.py {flags}: " + ", ".join(f"{k} {v:.1f} s" for k, v in row.items() if k.endswith("_s")))
    for row in rows:
        row["vs_none_first"] = row["first_s"] / rows[0]["first_s"]
    return rows


# --------------------------------------------------------------------------------------------------
# Single stream on a GPU: eager, CUDA graphs, transformers, the serve engine


def synced_median(fn: Any, device: torch.device, repeats: int) -> tuple[Any, float, float]:
    """(result, seconds of the first call, median seconds of `repeats` more), the device synchronized."""
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return out, times[0], median(times[1:])


def engine_one_client(model: GPT, tokenizer: Any, prompt: list[int], tokens: int, repeats: int) -> float:
    """The serve engine's tokens/s for one client: greedy, `tokens` new tokens, from submit to the last update."""
    import threading

    from minigpt.serve.engine import Engine, Request

    engine = Engine(model, tokenizer, max_batch=8)
    engine.start()
    try:
        rates = []
        for _ in range(repeats + 1):  # the first captures the graph
            done, counted = threading.Event(), []

            def on_update(update: Any, done: threading.Event = done, counted: list = counted) -> None:
                if update.finish_reason is not None:
                    counted.append(update.completion_tokens)
                    done.set()

            t0 = time.perf_counter()
            engine.submit(Request(prompt=prompt, max_tokens=tokens, temperature=0), on_update)
            done.wait()
            rates.append(counted[0] / (time.perf_counter() - t0))
    finally:
        engine.stop()
    return median(rates[1:])


def measure_single_stream(args: Any, device: torch.device, work: Path) -> list[dict[str, Any]]:
    import transformers

    src = build_hf_folder("gpt2", args.quick, work / "gpt2", args.seed)
    model, tokenizer = load_model(src, device=device)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(device).eval()
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens), generator=gen).to(device)
    compiled_way = f"minigpt compiled{' (CUDA graphs)' if device.type == 'cuda' else ''}"
    ways = {
        "minigpt eager": lambda: generate(model, prompt, args.tokens, temperature=0.0),
        compiled_way: lambda: generate(model, prompt, args.tokens, temperature=0.0, compile=True),
        "transformers generate": lambda: hf_generate(hf, prompt, args.tokens),
    }
    rows = []
    for way, run in ways.items():
        ids, first_s, seconds = synced_median(run, device, args.repeats)
        ids = ids[0, args.prompt_tokens :].tolist()
        rows.append(dict(way=way, ids=ids, tokens_per_s=args.tokens / seconds, first_call_s=first_s))
        print(f"  {way}: {rows[-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    rate = engine_one_client(model, tokenizer, prompt[0].tolist(), args.tokens, max(1, args.repeats - 1))
    rows.append(dict(way="serve engine, one client", tokens_per_s=rate))
    print(f"  serve engine, one client: {rate:.1f} tokens/s", flush=True)
    reference = rows[2]
    for r in rows:
        r["vs_transformers"] = r["tokens_per_s"] / reference["tokens_per_s"]
        if "ids" in r:
            r["ids_equal_transformers"] = r["ids"] == reference["ids"]
    return rows


# --------------------------------------------------------------------------------------------------
# int8's quality on a trained model


@torch.inference_mode()
def next_token_agreement(a: GPT, b: GPT, ids: list[int], batch: int = 8) -> tuple[float, int]:
    """(fraction of positions where a's and b's most likely next token agree, positions) over consecutive
    block_size windows of ids."""
    T = a.config.block_size
    windows = [ids[i : i + T] for i in range(0, len(ids) - 1, T)]
    windows = [w for w in windows if len(w) == T] or [ids[:T]]
    same = total = 0
    for i in range(0, len(windows), batch):
        x = torch.tensor(windows[i : i + batch])
        same += int((a(x)[0].argmax(-1) == b(x)[0].argmax(-1)).sum())
        total += x.numel()
    return same / total, total


def quality(ckpt: str, text_path: str, max_tokens: int) -> dict[str, Any]:
    from minigpt.evaluation.loss import evaluate_tokens

    fp32, tokenizer = load_model(ckpt)
    int8 = quantize_model(load_model(ckpt)[0])  # int8 whether or not it is faster here: its quality is the question
    ids = tokenizer.encode(Path(text_path).read_text(encoding="utf-8"))[:max_tokens]
    nats32, n = evaluate_tokens(fp32, ids)
    nats8, _ = evaluate_tokens(int8, ids)
    agreement, positions = next_token_agreement(fp32, int8, ids)
    ppl32, ppl8 = math.exp(nats32 / n), math.exp(nats8 / n)
    found = dict(checkpoint=ckpt, text=text_path, tokens=n, params=fp32.num_params(), perplexity_float32=ppl32)
    found |= dict(perplexity_int8=ppl8, perplexity_change=ppl8 / ppl32 - 1, next_token_agreement=agreement)
    return found | dict(agreement_positions=positions)


# --------------------------------------------------------------------------------------------------


def columns(spec: str) -> list[tuple[str, ...]]:
    """'key:header:format, ...' -> markdown_table's columns (an empty format: text, left-aligned)."""
    return [tuple(c.strip().split(":")) for c in spec.split(",")]


FIRST_CALL = "first_call_s:first call s:.1f"
RATE_COLUMNS = columns(
    "shape:shape:, way:way:, tokens_per_s:tokens/s:.1f, vs_own_float32_eager:x own float32 eager:.2f, "
    "vs_transformers:x transformers:.2f, weight_mib:weights MiB:.0f, fraction_of_bound:of bound:.0%, "
    f"ids_equal_transformers:ids = transformers':, prefill_tokens_per_s:prefill tokens/s:.0f, {FIRST_CALL}"
)
COMMAND_COLUMNS = columns(
    "flags:flags:, first_s:first run s:.1f, second_s:second run s:.1f, vs_none_first:first x plain:.2f, "
    "first_notes:decisions (first run):, second_notes:decisions (second run):"
)


def measure_kind(args: Any, label: dict[str, Any]) -> dict[str, Any]:
    """This process's CPU kind: the commands' wall clocks and the rates after warm-up."""
    result: dict[str, Any] = dict(machine=label)
    with tempfile.TemporaryDirectory() as work:
        if not args.no_commands:
            result["commands"] = time_commands(args, Path(work))
        bandwidth = read_bandwidth(GIB // 16 if args.quick else GIB)
        print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s ({torch.get_num_threads()} threads)", flush=True)
        rows = [r for shape in args.shapes.split(",") for r in measure_shape(shape.strip(), args, Path(work))]
    for r in rows:
        r["bound_tokens_per_s"] = bandwidth / r["weight_bytes"]
        r["fraction_of_bound"] = r["tokens_per_s"] / r["bound_tokens_per_s"]
    return result | dict(read_bandwidth_bytes_per_s=bandwidth, rows=rows)


def print_kind(kind: str, result: dict[str, Any], args: Any) -> None:
    where = f"CPU kind {kind}: {describe_machine(result['machine'])}"
    if "commands" in result:
        print(f"\n{where}\nsample.py, {SHAPE_NAMES['gpt2']} shape, {args.tokens} tokens, --temperature 0: wall clock\n")
        print(markdown_table(result["commands"], COMMAND_COLUMNS))
    print(
        f"\n{where}\nGreedy decoding, batch 1, {args.tokens} new tokens after a {args.prompt_tokens}-token prompt "
        f"(median of {args.repeats}, after one untimed call); bound = "
        f"{result['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s / weight bytes\n"
    )
    print(markdown_table(result["rows"], RATE_COLUMNS))
    for shape in dict.fromkeys(r["shape"] for r in result["rows"]):
        print(f"int8 decision, {shape}: {next(r for r in result['rows'] if r['shape'] == shape)['int8_decision']}")


def run_kind_in_child(kind: str, argv: list[str], work: Path) -> dict[str, Any]:
    """This script again, as CPU kind `kind` (its environment set before torch starts); its JSON back."""
    keep, skip = [], False
    for a in argv:  # drop --kinds and --json: the child measures one kind and writes where it is told
        if not skip and a.split("=")[0] not in ("--kinds", "--json"):
            keep.append(a)
        skip = a in ("--kinds", "--json")
    out = work / f"{kind}.json"
    cmd = [sys.executable, __file__, *keep, "--kinds", kind, "--json", str(out)]
    subprocess.run(cmd, env={**os.environ, **KINDS[kind]}, check=True)
    return json.loads(out.read_text())["kinds"][kind]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    p = common_parser(__doc__.splitlines()[0], "decode")
    p.add_argument("--kinds", default="native", help="comma-separated CPU kinds to run as: native, avx2")
    p.add_argument("--no_commands", action="store_true", help="skip the sample.py wall clocks")
    p.add_argument("--shapes", default="gpt2,smollm2", help="comma-separated: gpt2, smollm2")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per timed call")
    p.add_argument("--prompt_tokens", type=int, default=16)
    p.add_argument("--prefill_tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per way (the median counts)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quality", default=None, metavar="CKPT", help="a trained checkpoint: int8's quality on --text")
    p.add_argument("--text", default=None, help="--quality: the text to score")
    p.add_argument("--quality_tokens", type=int, default=100_000, help="--quality: score at most this many tokens")
    p.add_argument(
        "--single_stream",
        action="store_true",
        help="single-stream greedy and the serve engine, GPT-2-124M shape: the default on a GPU",
    )
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",")]
    if unknown := [k for k in kinds if k not in KINDS]:
        p.error(f"--kinds: unknown kind {unknown[0]!r}; choose from {', '.join(KINDS)}")
    if args.quick:
        args.tokens, args.prefill_tokens, args.repeats = 8, 32, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    load_before = wait_for_quiet(tries=args.wait_quiet)
    label = machine_label(device, "float32")
    print(describe_machine(label), flush=True)
    result: dict[str, Any] = dict(benchmark="decode", machine=label, load_avg_1m_before=load_before)

    if args.single_stream or device.type == "cuda":
        with tempfile.TemporaryDirectory() as work:
            rows = measure_single_stream(args, device, Path(work))
        print(
            f"\nGreedy decoding, one stream, {SHAPE_NAMES['gpt2']} shape{' (tiny: --quick)' if args.quick else ''}, "
            f"float32, {args.tokens} new tokens after a {args.prompt_tokens}-token prompt (median of {args.repeats})\n"
        )
        spec = "way:way:, tokens_per_s:tokens/s:.1f, vs_transformers:x transformers:.2f, "
        print(markdown_table(rows, columns(f"{spec}ids_equal_transformers:ids = transformers':, {FIRST_CALL}")))
        result |= dict(single_stream=True, tokens=args.tokens, prompt_tokens=args.prompt_tokens, rows=rows)
    elif args.quality:
        if not args.text:
            p.error("--quality needs --text FILE")
        q = quality(args.quality, args.text, args.quality_tokens)
        print(
            f"\nint8 against float32 on {q['text']} ({q['tokens']:,} tokens, {q['params']:,} parameters): perplexity "
            f"{q['perplexity_float32']:.4f} -> {q['perplexity_int8']:.4f} ({100 * q['perplexity_change']:+.2f} %), "
            f"next-token agreement {100 * q['next_token_agreement']:.2f} % of {q['agreement_positions']:,} positions"
        )
        result["quality"] = q
    else:
        result |= dict(tokens=args.tokens, prompt_tokens=args.prompt_tokens, repeats=args.repeats, kinds={})
        with tempfile.TemporaryDirectory() as work:
            for kind in kinds:
                if len(kinds) == 1:  # this process runs as it was started (a child: as its kind)
                    result["kinds"][kind] = measure_kind(args, label)
                else:
                    result["kinds"][kind] = run_kind_in_child(kind, argv, Path(work))
        for kind, measured in result["kinds"].items():
            print_kind(kind, measured, args)
    result["load_avg_1m_after"] = load_avg()
    print(
        f"\nload average {load_before[-1]} before, {result['load_avg_1m_after']} after; "
        f"wrote {write_json(result, args.json)}"
    )
    return result


if __name__ == "__main__":
    main()
