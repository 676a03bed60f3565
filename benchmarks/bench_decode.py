"""Greedy decoding per CPU kind: the whole sample.py command per speed flag, and the rates after warm-up (minigpt
float32 and int8, eager and compiled, against transformers' generate and the memory-bandwidth bound).

    python benchmarks/bench_decode.py --kinds native,avx2  # as this CPU is, and as an AVX2 one; GPT-2 and SmolLM2
    python benchmarks/bench_decode.py --device cpu --quick --single_stream   # the GPU measurement, tiny, on a CPU

Method and results: docs/performance.md#decode.
"""

import json
import math
import os
import queue
import subprocess
import sys
import tempfile
import time
import timeit
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks import common
from minigpt.core.generation import generate
from minigpt.core.model import GPT
from minigpt.core.quantize import Int8Embedding, Int8Linear, choose_int8, quantize_model
from minigpt.evaluation.loss import evaluate_tokens
from minigpt.loading import load_model

GIB = 2**30
CPU = torch.device("cpu")
PROMPT_TOKENS = 16
PREFILL_TOKENS = 512
KINDS = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
KIND_VARIABLES = {k for env in KINDS.values() for k in env} | {"DNNL_MAX_CPU_ISA"}  # oneDNN's older name


def runs_here(kinds: list[str], env: dict[str, str]) -> bool:
    """Whether this process measures the one kind asked for itself: only where its environment already is that
    kind's (a child started for it, or a shell that set it); a `--kinds avx2` run from a native shell would
    measure the native kind under the avx2 label."""
    return len(kinds) == 1 and {k: env[k] for k in KIND_VARIABLES if k in env} == KINDS[kinds[0]]


def kind_environment(kind: str, env: dict[str, str]) -> dict[str, str]:
    """env as the kind's child runs it: the other kinds' variables out, the kind's in."""
    return {k: v for k, v in env.items() if k not in KIND_VARIABLES} | KINDS[kind]


FLAGS = {"none": [], "--quantize int8": ["--quantize", "int8"], "--compile": ["--compile"]}
FLAGS["--quantize int8 --compile"] = FLAGS["--quantize int8"] + FLAGS["--compile"]
SHAPE_NAMES = {"gpt2": "GPT-2-124M", "smollm2": "SmolLM2-135M"}
RATE_COLUMNS = common.columns(
    "shape:shape:, way:way:, tokens_per_s:tokens/s:.1f, vs_own_float32_eager:x own float32 eager:.2f, "
    "vs_transformers:x transformers:.2f, weight_mib:weights MiB:.0f, fraction_of_bound:of bound:.0%, "
    "ids_equal_transformers:ids = transformers':, prefill_tokens_per_s:prefill tokens/s:.0f, "
    "first_call_s:first call s:.1f"
)
COMMAND_COLUMNS = common.columns(
    "flags:flags:, first_s:first run s:.1f, second_s:second run s:.1f, vs_none_first:first x plain:.2f, "
    "first_notes:decisions (first run):, second_notes:decisions (second run):"
)


def hf_config(shape: str, quick: bool) -> Any:
    """The shape as a transformers config (no end-of-text id: every call generates all its tokens)."""
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


def bytes_per_token(model: GPT) -> int:
    """Bytes of weights one decode step reads: each tensor once, but the tables read a row at a time (the docs)."""
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


def hf_generate(hf: Any, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    mask = torch.ones_like(prompt)
    with torch.inference_mode():
        return hf.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=tokens, pad_token_id=0)


def measure_shape(shape: str, args: Any, work: Path, device: torch.device = CPU) -> list[dict[str, Any]]:
    """Each way's greedy tokens/s, prefill and first call (docs/performance.md#decode); one stream: the serve engine."""
    import transformers

    src = common.hf_folder(hf_config(shape, args.quick), work / shape)
    fp32, tokenizer = load_model(src, device=device)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(device).eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, fp32.config.vocab_size, (1, PROMPT_TOKENS), generator=gen).to(device)
    long_prompt = torch.randint(0, fp32.config.vocab_size, (1, PREFILL_TOKENS), generator=gen).to(device)
    models = {"float32": fp32}
    if not args.one_stream:
        int8, _ = load_model(src, quantize="int8")  # float32 where int8 is measured slower here (a note says so)
        models["int8" if isinstance(int8.lm_head, Int8Linear) else "int8 declined -> float32"] = int8
    ways: dict[str, tuple[GPT, Any]] = {}
    for kind, model in models.items():
        compiled = "compiled (CUDA graphs)" if device.type == "cuda" else "compiled step"
        for name, compile in (("eager", False), (compiled, True)):
            ways[f"minigpt {kind}, {name}"] = (model, partial(generate, model, temperature=0.0, compile=compile))
    ways["transformers float32"] = (fp32, partial(hf_generate, hf))
    rows = []
    for way, (model, run) in ways.items():
        ids, first_s, seconds = synced_median(lambda run=run: run(prompt, args.tokens), device, args.repeats)
        _, _, prefill_s = synced_median(lambda run=run: run(long_prompt, 1), device, max(1, args.repeats - 1))
        row = dict(shape=SHAPE_NAMES[shape], way=way, ids=ids[0, PROMPT_TOKENS:].tolist(), first_call_s=first_s)
        row |= dict(tokens_per_s=args.tokens / seconds, prefill_tokens_per_s=PREFILL_TOKENS / prefill_s)
        rows.append(row | dict(weight_bytes=bytes_per_token(model), weight_mib=common.mib(bytes_per_token(model))))
        print(f"  {row['shape']}, {way}: {row['tokens_per_s']:.1f} tokens/s (first call {first_s:.1f} s)", flush=True)
    if args.one_stream:  # the server's default (compiled where its graphs are), and its --compile false
        for compile, kind in ((None, "default"), (False, "--compile false")):
            rate, way = engine_one_client(
                fp32, tokenizer, prompt[0].tolist(), args.tokens, max(1, args.repeats - 1), compile
            )
            rows.append(
                dict(shape=SHAPE_NAMES[shape], way=f"serve engine, one client, {way} ({kind})", tokens_per_s=rate)
            )
            print(f"  {SHAPE_NAMES[shape]}, {rows[-1]['way']}: {rate:.1f} tokens/s", flush=True)
    else:
        rows[0]["int8_decision"] = ": ".join(choose_int8(fp32))
    reference, own_fp32 = next(r for r in rows if r["way"] == "transformers float32"), rows[0]
    for r in rows:
        r["vs_transformers"] = r["tokens_per_s"] / reference["tokens_per_s"]
        r["vs_own_float32_eager"] = r["tokens_per_s"] / own_fp32["tokens_per_s"]
        if "ids" in r and r is not reference:  # the reference's own row would compare it with itself
            r["ids_equal_transformers"] = r["ids"] == reference["ids"]
    return rows


def time_commands(args: Any, work: Path) -> list[dict[str, Any]]:
    """sample.py's wall clock for each flag combination, twice each, with this kind's own caches empty at the start."""
    src = common.hf_folder(hf_config("gpt2", args.quick), work / "gpt2-command")
    env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    sample_py = [sys.executable, str(common.REPO_ROOT / "sample.py"), "--ckpt", str(src), "--temperature", "0"]
    sample_py += ["--prompt", "Once upon a time", "--max_new_tokens", str(args.tokens), "--no-stop"]
    rows = []
    for flags, extra in FLAGS.items():
        row: dict[str, Any] = dict(flags=flags)
        for run in ("first", "second")[: 1 if args.quick else 2]:
            t0 = time.perf_counter()
            out = common.run_child([*sample_py, *extra], cwd=work, env=env)
            row[f"{run}_s"] = time.perf_counter() - t0
            notes = [line.removeprefix("note: ") for line in out.stderr.splitlines() if line.startswith("note:")]
            row[f"{run}_notes"] = " / ".join(notes) or "-"
        rows.append(row)
        print(f"  sample.py {flags}: " + ", ".join(f"{k} {v:.1f} s" for k, v in row.items() if k.endswith("_s")))
    for row in rows:
        row["vs_none_first"] = row["first_s"] / rows[0]["first_s"]
    return rows


def synced_median(fn: Any, device: torch.device, repeats: int) -> tuple[Any, float, float]:
    """(result, seconds of the first call, median seconds of `repeats` more), the device synchronized."""
    out = []
    times = common.time_fn(lambda: out.append(fn()), device, repeats + 1, warmup=0)
    return out[-1], times[0], common.median(times[1:])


def engine_one_client(
    model: GPT, tokenizer: Any, prompt: list[int], tokens: int, repeats: int, compile: bool | None
) -> tuple[float, str]:
    """The serve engine's tokens/s for one client (greedy, `tokens` new tokens, from submit to the last update,
    warmed up as the server does), and how its step ran."""
    from minigpt.serve.engine import Engine, Request

    engine, finished = Engine(model, tokenizer, max_batch=8, compile=compile), queue.Queue()

    def on_update(update: Any) -> None:  # a request's last update carries its count
        if update.finish_reason is not None:
            finished.put(update.completion_tokens)

    engine.start()  # compiles and captures its step first, as the server's
    way = "compiled" if engine.compile else "eager"
    way = f"{way} step{', CUDA graphs' if engine.use_graphs and engine.device.type == 'cuda' else ''}"
    try:
        rates = []
        for _ in range(repeats + 1):  # the first untimed
            t0 = time.perf_counter()
            engine.submit(Request(prompt=prompt, max_tokens=tokens, temperature=0), on_update)
            rates.append(finished.get() / (time.perf_counter() - t0))
    finally:
        engine.stop()
    return common.median(rates[1:]), way


@torch.inference_mode()
def next_token_agreement(a: GPT, b: GPT, ids: list[int], batch: int = 8) -> tuple[float, int]:
    """(fraction of positions where a's and b's most likely next tokens agree, positions) over block_size windows."""
    T = a.config.block_size
    windows = [ids[i : i + T] for i in range(0, len(ids) - 1, T)]
    windows = [w for w in windows if len(w) == T] or [ids[:T]]
    same = total = 0
    for i in range(0, len(windows), batch):
        x = torch.tensor(windows[i : i + batch])
        same += int((a(x)[0].argmax(-1) == b(x)[0].argmax(-1)).sum())
        total += x.numel()
    return same / total, total


def quality(ckpt: str, text_path: str, max_tokens: int = 100_000) -> dict[str, Any]:
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
    where = f"CPU kind {kind}: {common.describe_machine(result['machine'])}"
    if "commands" in result:
        title = f"{where}\nsample.py, {SHAPE_NAMES['gpt2']} shape, {args.tokens} tokens, --temperature 0: wall clock"
        common.print_table(result["commands"], COMMAND_COLUMNS, title)
    bound = f"bound = {result['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s / weight bytes"
    title = f"{where}\nGreedy, {args.tokens} new tokens after {PROMPT_TOKENS}, median of {args.repeats}; {bound}"
    common.print_table(result["rows"], RATE_COLUMNS, title)
    for r in result["rows"]:
        if "int8_decision" in r:
            print(f"int8 decision, {r['shape']}: {r['int8_decision']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    p = common.parser(__doc__, "decode")
    p.add_argument("--kinds", default="native", help="comma-separated CPU kinds to run as: native, avx2")
    p.add_argument("--no_commands", action="store_true", help="skip the sample.py wall clocks")
    p.add_argument("--shapes", default="gpt2,smollm2", help="comma-separated: gpt2, smollm2")
    p.add_argument("--tokens", type=common.positive_int, default=128, help="new tokens per timed call")
    p.add_argument("--repeats", type=common.positive_int, default=3, help="timed calls per way (the median counts)")
    p.add_argument("--threads", type=common.positive_int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--quality", default=None, metavar="CKPT", help="a trained checkpoint: int8's quality on --text")
    p.add_argument("--text", default=None, help="--quality: the text to score")
    p.add_argument("--single_stream", action="store_true", help="one stream and the serve engine: the default on a GPU")
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",")]
    if unknown := [k for k in kinds if k not in KINDS]:
        p.error(f"--kinds: unknown kind {unknown[0]!r}; choose from {', '.join(KINDS)}")
    if args.quality and not args.text:
        p.error("--quality needs --text FILE")
    if args.quick:
        args.tokens, args.repeats = 8, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = common.pick_device(args.device)
    args.one_stream = args.single_stream or device.type == "cuda"
    result: dict[str, Any] = dict(benchmark="decode", machine=common.start(args, device), tokens=args.tokens)
    if args.one_stream:
        with tempfile.TemporaryDirectory() as work:
            result["rows"] = measure_shape("gpt2", args, Path(work), device)
        title = f"Greedy decoding, one stream, {SHAPE_NAMES['gpt2']} shape, float32, {args.tokens} new tokens"
        common.print_table(result["rows"], RATE_COLUMNS, title)
    elif args.quality:
        q = result["quality"] = quality(args.quality, args.text)
        print(
            f"\nint8 against float32 on {q['text']} ({q['tokens']:,} tokens, {q['params']:,} parameters): perplexity "
            f"{q['perplexity_float32']:.4f} -> {q['perplexity_int8']:.4f} ({100 * q['perplexity_change']:+.2f} %), "
            f"next-token agreement {100 * q['next_token_agreement']:.2f} % of {q['agreement_positions']:,} positions"
        )
    else:
        result |= dict(repeats=args.repeats, kinds={})
        with tempfile.TemporaryDirectory() as work:
            for kind in kinds:
                if runs_here(kinds, dict(os.environ)):  # started as that kind (a child)
                    result["kinds"][kind] = measure_kind(args, result["machine"])
                else:  # this script again, as that kind (its environment set before torch starts); its JSON back
                    out = Path(work) / f"{kind}.json"  # the last --kinds and --json given are the ones argparse keeps
                    cmd = [sys.executable, __file__, *argv, "--kinds", kind, "--json", str(out)]
                    subprocess.run(cmd, env=kind_environment(kind, dict(os.environ)), check=True)
                    result["kinds"][kind] = json.loads(out.read_text())["kinds"][kind]
        for kind, measured in result["kinds"].items():
            print_kind(kind, measured, args)
    return common.finish(result, args)


if __name__ == "__main__":
    main()
