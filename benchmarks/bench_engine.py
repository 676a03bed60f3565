"""The serve engine's one-client token, in process, each way its decode step can run, beside that step alone.

    python benchmarks/bench_engine.py                    # the GPT-2-124M shape and a small char model, on the CPU
    python benchmarks/bench_engine.py --device cuda      # on a GPU: + the GPU kernels' time and count per token

The ways: "growing, eager" is the model over a cache that grows (a CPU server's step); "static, eager" is the step
over the static cache that CUDA graphs capture (a GPU server with --compile false; on a CPU run eagerly); "static,
compiled" is torch.compile's static step (a GPU server's default; on a CPU it needs a C++ compiler, and the
engine keeps it only where it measures faster at warm-up: "dropped" says it did not).  For each:
ms per token through the engine (greedy, one client, submit to the last update, the fastest of --repeat runs after
one untimed), the step alone (the engine's bucket-1 step run back to back: on a GPU its graph replayed), and the
engine's own cost, their difference.  On a GPU, torch.profiler's kernel time and count per token say whether a
token is the GPU's time or the host's.  The models are random, float32, and read tinyshakespeare's 65 characters
(the 124M shape's head stays 50,257 wide); --int8 quantizes them as --quantize int8 does.  Results: docs/serve.md.
"""

import cProfile
import pstats
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]  # run from anywhere

from benchmarks import common
from minigpt.core.config import GPTConfig
from minigpt.core.decode_graphs import DecodeGraphs
from minigpt.core.model import GPT
from minigpt.core.quantize import quantize_model
from minigpt.core.tokenizers import CharTokenizer
from minigpt.serve.engine import Engine, Request, Update, in_passing

CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # tinyshakespeare's 65
SHAPES = {
    "124m": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257),
    "char": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=65),
}
QUICK = dict(n_layer=1, n_head=2, n_embd=32, block_size=64)
WAYS = {"growing, eager": (False, False), "static, eager": (True, False), "static, compiled": (True, True)}
COLUMNS = common.columns(
    "shape:shape:, way:step:, warm_up_s:warm-up s:.1f, engine_ms:engine ms/token:.3f, "
    "tokens_per_s:engine tokens/s:.1f, step_ms:step alone ms:.3f, engine_own_ms:engine's own ms/token:.3f, "
    "kernel_ms:GPU kernels ms/token:.3f, kernels:kernels/token:.0f"
)


@torch.inference_mode()
def step_ms(engine: Engine, batch: int, prompt_tokens: int, steps: int = 8) -> float:
    """ms of one decode step of `batch` rows at different positions, the fastest of `steps`, as the engine runs it:
    its static step (on a GPU the CUDA graph of it, compiled or not) over a static cache of the engine's max_batch
    rows, else the model over a cache that grows."""
    model, device = engine.model, engine.device
    tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
    positions = iter([torch.arange(batch, device=device) % 4 + prompt_tokens + i for i in range(steps + 2)])
    if engine.use_graphs:
        graphs = DecodeGraphs(model, engine.max_batch, model.config.block_size, engine.graphs.forward)
        graphs(tokens, next(positions))  # captures this bucket's graph
        return 1000 * min(common.time_fn(lambda: graphs(tokens, next(positions)), device, steps))
    cache = model.new_kv_cache(batch)
    model(torch.zeros(batch, prompt_tokens, dtype=torch.long, device=device), kv_cache=cache, input_pos=0)
    return 1000 * min(common.time_fn(lambda: model(tokens, kv_cache=cache, input_pos=next(positions)), device, steps))


def one_request(engine: Engine, prompt: list[int], tokens: int) -> float:
    """Seconds from submitting a greedy request of `tokens` new tokens to its last update; a request that ends
    without all of them (an error) ends the benchmark with one line."""
    done, last = threading.Event(), []

    def on_update(update: Update) -> None:
        if update.finish_reason:
            last.append(update)
            done.set()

    t0 = time.perf_counter()
    engine.submit(Request(prompt=prompt, max_tokens=tokens, temperature=0), on_update)
    done.wait()
    seconds, (update,) = time.perf_counter() - t0, last
    if update.finish_reason == "error" or update.completion_tokens != tokens:
        why = update.error or f"finish_reason {update.finish_reason}"
        raise SystemExit(f"error: a request of {tokens} tokens made {update.completion_tokens}: {why}")
    return seconds


def kernels_per_token(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(GPU kernels' ms, their count) per token of one request, as torch.profiler sees them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one_request(engine, prompt, tokens)
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    return sum(e.self_device_time_total for e in events) / 1e3 / tokens, sum(e.count for e in events) / tokens


class ProfiledEngine(Engine):
    """The engine with its thread's Python under cProfile (--cprofile): where the host's time per token goes."""

    def _loop(self) -> None:
        self.profile = cProfile.Profile()
        self.profile.enable()
        try:
            super()._loop()
        finally:
            self.profile.disable()


def measure(model: GPT, tokenizer: CharTokenizer, way: str, prompt: list[int], tokens: int, args) -> dict | None:
    static, compile = WAYS[way]
    kind = ProfiledEngine if args.cprofile else Engine
    engine = kind(model, tokenizer, max_batch=1, decode_graphs=static, compile=compile)  # one bucket: one compile
    if compile and not engine.compile:  # no compiler here (a note said so)
        return None
    t0 = time.perf_counter()
    engine.start()  # as the server's: returns once its thread has compiled and captured the step
    row = dict(way=way, warm_up_s=time.perf_counter() - t0)
    if compile and not engine.compile:  # on a CPU, measured slower than uncompiled at warm-up (a note says so)
        row["way"] += " -> dropped: growing, eager"
    try:
        one_request(engine, prompt, min(8, tokens))  # untimed
        engine_ms = 1000 * min(one_request(engine, prompt, tokens) for _ in range(args.repeat)) / tokens
        if engine.device.type == "cuda":
            row["kernel_ms"], row["kernels"] = kernels_per_token(engine, prompt, tokens)
    finally:
        engine.stop()
    if args.cprofile:  # every request's, the untimed one's included
        print(f"{way}: the engine thread under cProfile, by own time", flush=True)
        pstats.Stats(engine.profile, stream=sys.stdout).sort_stats("tottime").print_stats(12)
    steps = min(50, model.config.block_size - len(prompt) - 6)
    step = in_passing(step_ms, engine, 1, len(prompt), steps)  # as the engine's: the process's one OpenMP team
    return row | dict(engine_ms=engine_ms, tokens_per_s=1000 / engine_ms, step_ms=step, engine_own_ms=engine_ms - step)


def random_model(shape: str, args, device: torch.device) -> GPT:
    torch.manual_seed(1337)
    model = GPT(GPTConfig(**(dict(SHAPES[shape], **QUICK) if args.quick else SHAPES[shape]))).to(device).eval()
    return quantize_model(model) if getattr(args, "int8", False) else model


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(common.summary(__doc__), "engine")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument(
        "--ways",
        nargs="+",
        default=list(WAYS),
        choices=list(WAYS),
        metavar="WAY",
        help=f"the ways to time, each quoted (its name has a comma and a space): {', '.join(map(repr, WAYS))} "
        "(default: all)",
    )
    p.add_argument(
        "--tokens",
        type=common.positive_int,
        default=128,
        help="new tokens per request (default 128; at most what the block holds after the prompt)",
    )
    p.add_argument(
        "--repeat", type=common.positive_int, default=3, help="timed requests per way; the fastest counts (default 3)"
    )
    p.add_argument("--int8", action="store_true", help="int8 weights (sample.py/serve --quantize int8's)")
    p.add_argument(
        "--cprofile",
        action="store_true",
        help="print where the engine thread's Python time goes (its timings then include cProfile's cost)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.repeat = 8, 1
    device = common.pick_device(args.device)
    label = in_passing(common.start, args, device)  # its matmul probe too: the engine's the one OpenMP team
    tokenizer = CharTokenizer(CHARS)
    prompt = tokenizer.encode("ROMEO: what light through yonder window breaks")[:32]
    rows = []
    for name in args.shapes:
        model = in_passing(random_model, name, args, device)  # as the server loads it (in_passing)
        tokens = min(args.tokens, model.config.block_size - len(prompt))  # the engine's limit, as bench_serve's
        if tokens < args.tokens:
            print(f"{name}: {tokens} new tokens, all that block_size {model.config.block_size} holds after the prompt")
        for way in args.ways:
            row = measure(model, tokenizer, way, prompt, tokens, args)
            if row is not None:
                rows.append(dict(shape=name, **row, tokens=tokens))
                common.print_row(rows[-1], COLUMNS)
    weights = "int8" if args.int8 else "float32"
    counts = "/".join(str(n) for n in sorted({r["tokens"] for r in rows})) or args.tokens  # each shape's
    title = f"One client, {counts} new tokens after a {len(prompt)}-token prompt, {weights} weights"
    common.print_table(rows, COLUMNS, title)
    result = dict(benchmark="engine", machine=label, tokens=args.tokens, prompt_tokens=len(prompt), weights=weights)
    result["results"] = rows
    return common.finish(result, args)


if __name__ == "__main__":
    main()
