"""Greedy decoding speed against the memory-bandwidth bound: minigpt float32, minigpt int8, transformers' generate.

    python benchmarks/bench_decode.py                      # GPT-2-124M and SmolLM2-135M shapes, random weights
    python benchmarks/bench_decode.py --quick              # tiny shapes: a smoke test in seconds
    python benchmarks/bench_decode.py --shapes smollm2 --threads 1
    python benchmarks/bench_decode.py --quality out/RUN --text FILE   # int8 against float32 on a trained model
    python benchmarks/bench_decode.py --profile            # where a decode step's time goes, per way
    python benchmarks/bench_decode.py --device cuda        # a GPU: single-stream greedy and the serve engine, < 60 s
    python benchmarks/bench_decode.py --device cpu --quick --single_stream   # the same, tiny: its smoke test

Generating a token reads every weight once, so on a CPU decoding is bound by memory bandwidth: tokens/s <= read
bandwidth / bytes of weights read per token.  For each shape a Hugging Face folder with random weights is built
locally (transformers' own init, no download) and loaded three ways in this process: minigpt float32 and int8
(load_model, quantize="int8"), both decoding with the compiled step (generate(compile=True)), and transformers'
AutoModelForCausalLM with its `generate`; minigpt float32 without compile (the plain loop) is a fourth row.
Each generates 128 tokens greedily after a 16-token prompt: one untimed call (it compiles), then the median of
--repeats timed calls.  tokens/s counts the new tokens over the whole call (the prompt's prefill included).
Prefill is the time of one call that reads a 512-token prompt and generates one token.

The bound: the read bandwidth measured here (the best `sum` over a 1 GiB float32 tensor, larger than any
cache, with the same threads) over the bytes one decode step reads: every weight once (a tied embedding as the
head; an untied embedding table and learned positions one row each, so not counted).  The KV cache's reads are
left out of the bound (a few MiB at 144 positions).  A model whose weights fit in the CPU's last-level cache can
beat the DRAM bound.

On a GPU (--device cuda, or --single_stream anywhere) the GPT-2-124M shape only, float32, random weights:
single-stream greedy tokens/s of minigpt eager, minigpt compiled (generate(compile=True): on CUDA the decode step
replayed from CUDA graphs, minigpt.core.decode_graphs) and transformers' generate (GPT2LMHeadModel, the same weights
and prompt, the ids compared), each the median of --repeats calls of --tokens new tokens; and the serve engine's
one-client rate (minigpt.serve.engine.Engine, no HTTP: tokens over the time from submit to the last update).

--quality CKPT --text FILE: the exact loss (perplexity) of a trained checkpoint on the text in float32 and int8,
and next-token agreement: how often int8's most likely next token is float32's, over every position.
Writes benchmarks/results/decode.json (--json).
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
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
from minigpt.core.quantize import Int8Embedding
from minigpt.loading import load_model

GIB = 2**30


# --------------------------------------------------------------------------------------------------
# The shapes, as transformers configs (no end-of-text id: every call generates all its tokens)


def hf_config(shape: str, quick: bool) -> Any:
    import transformers

    none = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if shape == "gpt2":
        size = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=1024) if quick else {}
        return transformers.GPT2Config(**size, **none)
    size = (
        dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
        )
        if quick
        else dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
        )
    )
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
    rows_only = {
        t.data_ptr()
        for m in model.modules()
        if isinstance(m, (nn.Embedding, Int8Embedding))
        for t in m.state_dict().values()
    } - head
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    return sum(size for ptr, size in tensors.items() if ptr not in rows_only)


def read_bandwidth(nbytes: int = GIB, repeats: int = 10) -> float:
    """Bytes/s of the fastest of `repeats` sums over a float32 tensor of nbytes (read once each)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


# --------------------------------------------------------------------------------------------------
# Timing the three ways


def timed(fn: Any, repeats: int) -> tuple[Any, float, float]:
    """(result, seconds of the first call, median seconds of `repeats` further calls)."""
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return out, first, median(times)


def hf_generate(hf: Any, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        return hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=tokens, pad_token_id=0
        )


def measure_shape(shape: str, args: Any, work: Path) -> list[dict[str, Any]]:
    import transformers

    src = build_hf_folder(shape, args.quick, work / shape, args.seed)
    fp32, _ = load_model(src)
    int8, _ = load_model(src, quantize="int8")
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    vocab = fp32.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, vocab, (1, args.prompt_tokens), generator=gen)
    long_prompt = torch.randint(0, vocab, (1, args.prefill_tokens), generator=gen)
    ways = {
        "minigpt float32, compiled step": (fp32, lambda p, n: generate(fp32, p, n, temperature=0.0, compile=True)),
        "minigpt float32, eager": (fp32, lambda p, n: generate(fp32, p, n, temperature=0.0)),
        "minigpt int8, compiled step": (int8, lambda p, n: generate(int8, p, n, temperature=0.0, compile=True)),
        "transformers float32": (fp32, lambda p, n: hf_generate(hf, p, n)),
    }
    rows = []
    for way, (model, run) in ways.items():
        ids, first_s, seconds = timed(lambda run=run: run(prompt, args.tokens), args.repeats)
        _, _, prefill_s = timed(lambda run=run: run(long_prompt, 1), max(1, args.repeats - 1))
        rows.append(
            dict(
                shape=SHAPE_NAMES[shape],
                way=way,
                ids=ids[0, args.prompt_tokens :].tolist(),
                tokens_per_s=args.tokens / seconds,
                first_call_s=first_s,
                prefill_tokens_per_s=args.prefill_tokens / prefill_s,
                weight_bytes=bytes_per_token(model),
            )
        )
        print(
            f"  {SHAPE_NAMES[shape]}, {way}: {rows[-1]['tokens_per_s']:.1f} tokens/s "
            f"(first call {first_s:.1f} s), prefill {rows[-1]['prefill_tokens_per_s']:.0f} tokens/s",
            flush=True,
        )
    reference = rows[-1]
    for r in rows:
        r["vs_transformers"] = r["tokens_per_s"] / reference["tokens_per_s"]
        r["ids_equal_transformers"] = r["ids"] == reference["ids"]
        r["agreement_with_transformers"] = sum(a == b for a, b in zip(r["ids"], reference["ids"])) / len(r["ids"])
        r["weight_mib"] = mib(r["weight_bytes"])
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
    ways = {
        "minigpt eager": lambda: generate(model, prompt, args.tokens, temperature=0.0),
        f"minigpt compiled{' (CUDA graphs)' if device.type == 'cuda' else ''}": lambda: generate(
            model, prompt, args.tokens, temperature=0.0, compile=True
        ),
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
# Where a decode step's time goes (--profile)

CATEGORIES = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
    "KV cache writes and growth": ("aten::cat", "aten::index_put_", "aten::copy_", "aten::zeros", "aten::new_zeros"),
}


def profile_steps(run: Any, steps: int) -> dict[str, float]:
    """ms per decode step by kind: ATen ops' own time (matmul, attention, KV cache, other ops), the compiled
    graphs' own C++ code, and the rest of the wall time (Python, dispatch, the profiler itself)."""
    from torch.profiler import ProfilerActivity, profile

    run(steps)  # warm: compiled, and the cache allocated
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run(steps)
        wall = time.perf_counter() - t0
    out = dict.fromkeys([*CATEGORIES, "other ATen ops", "compiled C++ kernels"], 0.0)
    for e in prof.key_averages():
        kind = next((k for k, names in CATEGORIES.items() if e.key in names), None)
        if kind is None:
            kind = "compiled C++ kernels" if "CompiledFxGraph" in e.key else "other ATen ops"
        out[kind] += e.self_cpu_time_total / 1e3 / steps
    out = {k: v for k, v in out.items() if v > 0.005}
    out["Python and the rest"] = max(0.0, wall * 1e3 / steps - sum(out.values()))
    out["wall"] = wall * 1e3 / steps
    return out


def profile_shape(shape: str, args: Any, work: Path) -> dict[str, dict[str, float]]:
    """Each way's profile over one generate call of --profile_steps tokens (its one prefill pass of the short
    prompt included: about one more step's weight reads)."""
    import transformers

    src = build_hf_folder(shape, args.quick, work / shape, args.seed)
    fp32, _ = load_model(src)
    int8, _ = load_model(src, quantize="int8")
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    prompt = torch.randint(0, fp32.config.vocab_size, (1, args.prompt_tokens), generator=torch.Generator())
    ways = {
        "minigpt float32, eager": lambda n: generate(fp32, prompt, n, temperature=0.0),
        "minigpt float32, compiled step": lambda n: generate(fp32, prompt, n, temperature=0.0, compile=True),
        "minigpt int8, compiled step": lambda n: generate(int8, prompt, n, temperature=0.0, compile=True),
        "transformers float32": lambda n: hf_generate(hf, prompt, n),
    }
    return {way: profile_steps(run, args.profile_steps) for way, run in ways.items()}


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
    int8, _ = load_model(ckpt, quantize="int8")
    ids = tokenizer.encode(Path(text_path).read_text(encoding="utf-8"))[:max_tokens]
    nats32, n = evaluate_tokens(fp32, ids)
    nats8, _ = evaluate_tokens(int8, ids)
    agreement, positions = next_token_agreement(fp32, int8, ids)
    ppl32, ppl8 = math.exp(nats32 / n), math.exp(nats8 / n)
    return dict(
        checkpoint=ckpt,
        text=text_path,
        tokens=n,
        params=fp32.num_params(),
        perplexity_float32=ppl32,
        perplexity_int8=ppl8,
        perplexity_change=ppl8 / ppl32 - 1,
        next_token_agreement=agreement,
        agreement_positions=positions,
    )


# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common_parser(__doc__.splitlines()[0], "decode")
    p.add_argument("--shapes", default="gpt2,smollm2", help="comma-separated: gpt2, smollm2")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per timed call")
    p.add_argument("--prompt_tokens", type=int, default=16)
    p.add_argument("--prefill_tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per way (the median counts)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="where one decode step's time goes, per way")
    p.add_argument("--profile_steps", type=int, default=32, help="--profile: decode steps profiled")
    p.add_argument("--quality", default=None, metavar="CKPT", help="a trained checkpoint: int8's quality on --text")
    p.add_argument("--text", default=None, help="--quality: the text to score")
    p.add_argument("--quality_tokens", type=int, default=100_000, help="--quality: score at most this many tokens")
    p.add_argument(
        "--single_stream",
        action="store_true",
        help="single-stream greedy (eager, compiled, transformers) and the serve engine, GPT-2-124M shape: "
        "the default on a GPU",
    )
    args = p.parse_args(argv)
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
        columns = [
            ("way", "way", ""),
            ("tokens_per_s", "tokens/s", ".1f"),
            ("vs_transformers", "x transformers", ".2f"),
        ]
        columns += [("ids_equal_transformers", "ids = transformers'", ""), ("first_call_s", "first call s", ".1f")]
        print(markdown_table(rows, columns))
        result |= dict(single_stream=True, tokens=args.tokens, prompt_tokens=args.prompt_tokens, rows=rows)
    elif args.profile:
        profiles = {}
        with tempfile.TemporaryDirectory() as work:
            for shape in args.shapes.split(","):
                profiles[SHAPE_NAMES[shape]] = profile_shape(shape.strip(), args, Path(work))
        for shape, ways in profiles.items():
            kinds = list(dict.fromkeys(k for way in ways.values() for k in way))
            print(
                f"\n{shape}: ms per token over {args.profile_steps} greedy tokens (after a "
                f"{args.prompt_tokens}-token prompt; the profiler adds its own cost to every op)\n"
            )
            print(
                markdown_table(
                    [dict(way=w, **v) for w, v in ways.items()], [("way", "way", "")] + [(k, k, ".2f") for k in kinds]
                )
            )
        result["profile"] = profiles
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
        bandwidth = read_bandwidth(GIB // 16 if args.quick else GIB)
        print(
            f"read bandwidth: {bandwidth / 1e9:.1f} GB/s (sum over a float32 tensor, {torch.get_num_threads()} "
            f"threads)",
            flush=True,
        )
        rows = []
        with tempfile.TemporaryDirectory() as work:
            for shape in args.shapes.split(","):
                rows += measure_shape(shape.strip(), args, Path(work))
        for r in rows:
            r["bound_tokens_per_s"] = bandwidth / r["weight_bytes"]
            r["fraction_of_bound"] = r["tokens_per_s"] / r["bound_tokens_per_s"]
        print(
            f"\nGreedy decoding, batch 1, {args.tokens} new tokens after a {args.prompt_tokens}-token prompt; "
            f"prefill of {args.prefill_tokens} tokens; {torch.get_num_threads()} threads; bound = "
            f"{bandwidth / 1e9:.1f} GB/s / weight bytes\n"
        )
        print(
            markdown_table(
                rows,
                [
                    ("shape", "shape", ""),
                    ("way", "way", ""),
                    ("tokens_per_s", "tokens/s", ".1f"),
                    ("vs_transformers", "x transformers", ".2f"),
                    ("weight_mib", "weights MiB", ".0f"),
                    ("bound_tokens_per_s", "bound tokens/s", ".1f"),
                    ("fraction_of_bound", "of bound", ".0%"),
                    ("ids_equal_transformers", "ids = transformers'", ""),
                    ("prefill_tokens_per_s", "prefill tokens/s", ".0f"),
                    ("first_call_s", "first call s", ".1f"),
                ],
            )
        )
        result |= dict(
            read_bandwidth_bytes_per_s=bandwidth,
            tokens=args.tokens,
            prompt_tokens=args.prompt_tokens,
            prefill_tokens=args.prefill_tokens,
            repeats=args.repeats,
            rows=rows,
        )
    result["load_avg_1m_after"] = load_avg()
    print(
        f"\nload average {load_before[-1]} before, {result['load_avg_1m_after']} after; "
        f"wrote {write_json(result, args.json)}"
    )
    return result


if __name__ == "__main__":
    main()
