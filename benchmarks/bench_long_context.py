"""What a token costs with and without the KV cache, once the context is full (sampling far past block_size), and in
a chat of many turns.

    python benchmarks/bench_long_context.py                       # gpt and llama (learned positions, RoPE)

Method and results: docs/performance.md#past-the-context.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks import common
from minigpt.core.chat import ChatSession
from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.config import GPTConfig
from minigpt.core.generation import generate
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer

SHAPE = dict(n_layer=4, n_head=4, n_embd=128, dropout=0.0)
SEED = 1337
COLUMNS = common.columns(
    "arch:block:, block_size:block_size:d, ms_no_cache:ms/token no KV cache:.3f, ms_before_full:before full:.3f, "
    "kv_cache_speedup:KV cache speed-up:.2f, ms_once_full:ms/token once full:.3f, "
    "last_over_first_full_window:last / first full:.3f, ms_worst_token:worst token (refill) ms:.2f"
)
CHAT = [("turns", "turns", ""), ("ms_per_turn", "ms/turn", ".1f"), ("prefilled_per_turn", "tokens run per turn", ".1f")]


def per_token_ms(model: GPT, tokens: int, device: torch.device, kv_cache: bool = True) -> list[float]:
    """Milliseconds of each generated token (the first includes the one-token prefill)."""
    stamps = [time.perf_counter()]

    def tick(_: torch.Tensor) -> None:
        common.synchronize(device)
        stamps.append(time.perf_counter())

    prompt, gen = torch.zeros(1, 1, dtype=torch.long, device=device), torch.Generator(device=device).manual_seed(SEED)
    generate(model, prompt, tokens, temperature=1.0, generator=gen, on_token=tick, use_kv_cache=kv_cache)
    return [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]


@torch.inference_mode()
def sampling_rows(arch: str, block_size: int, device: torch.device, blocks: int) -> dict:
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(arch=arch, block_size=block_size, vocab_size=256, **SHAPE)).to(device).eval()
    per_token_ms(model, block_size, device)  # warm-up: every context length and one refill
    times = per_token_ms(model, blocks * block_size, device)
    half = block_size // 2
    windows = [statistics.fmean(times[i : i + half]) for i in range(0, len(times), half)]
    full = times[block_size:]  # once the context is full
    per_token_ms(model, block_size, device, kv_cache=False)  # warm-up without the cache
    no_cache = statistics.fmean(per_token_ms(model, block_size, device, kv_cache=False)[1:])
    before_full = statistics.fmean(times[1:block_size])
    row = dict(arch=arch, block_size=block_size, tokens=len(times), window_tokens=half)
    row |= dict(ms_per_token_windows=[round(w, 3) for w in windows], ms_before_full=round(before_full, 3))
    row |= dict(ms_no_cache=round(no_cache, 3), kv_cache_speedup=round(no_cache / before_full, 2))
    row |= dict(ms_once_full=round(statistics.fmean(full), 3), ms_median_once_full=round(statistics.median(full), 3))
    row |= dict(ms_worst_token=round(max(full), 2), last_over_first_full_window=round(windows[-1] / windows[2], 3))
    return row


@torch.inference_mode()
def chat_rows(block_size: int, turns: int, window: int, device: torch.device) -> dict:
    torch.manual_seed(SEED)
    tokenizer = ChatTokenizer.for_base(ByteTokenizer())
    model = GPT(GPTConfig(block_size=block_size, vocab_size=tokenizer.vocab_size, **SHAPE)).to(device).eval()
    gen = torch.Generator(device=device).manual_seed(SEED)
    session = ChatSession(model, tokenizer, "Answer briefly.", max_new_tokens=32, temperature=1.0, generator=gen)
    rows, started, prefilled = [], time.perf_counter(), 0
    for turn in range(1, turns + 1):
        session.reply(f"What is {turn} plus {turn + 1}? Tell me more about it, please.")
        if turn % window == 0:
            common.synchronize(device)
            now = time.perf_counter()
            per_turn = dict(ms_per_turn=round(1e3 * (now - started) / window, 1))
            per_turn["prefilled_per_turn"] = round((session.prefilled - prefilled) / window, 1)
            rows.append(dict(turns=f"{turn - window + 1}-{turn}", **per_turn))
            started, prefilled = now, session.prefilled
    return dict(block_size=block_size, turns=turns, max_new_tokens=32, windows=rows)


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(common.summary(__doc__), "long_context")
    p.add_argument("--block_sizes", type=common.at_least(2), nargs="+", default=[64, 256])
    p.add_argument(
        "--blocks",
        type=common.at_least(2),
        default=8,
        help="tokens sampled, in block sizes (default 8; at least 2: the context fills, then slides)",
    )
    p.add_argument("--turns", type=common.positive_int, default=200)
    p.add_argument(
        "--chat_block_size",
        type=common.at_least(128),
        default=512,
        help="the chat model's block_size (default 512; at least 128: a turn's message is ~100 tokens with its markup)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.block_sizes, args.blocks, args.turns, args.chat_block_size = [16], 4, 8, 128
    device = common.pick_device(args.device)
    label = common.start(args, device)
    sampling = [sampling_rows(arch, bs, device, args.blocks) for arch in ("gpt", "llama") for bs in args.block_sizes]
    print(
        f"\nSampling {args.blocks} x block_size tokens, {SHAPE['n_layer']} layers x {SHAPE['n_head']} heads, n_embd "
        f"{SHAPE['n_embd']}; ms per token in windows of block_size/2 tokens:\n"
    )
    for r in sampling:
        windows = " ".join(f"{w:.2f}" for w in r["ms_per_token_windows"])
        print(f"  {r['arch']:5s} block {r['block_size']:4d}: {windows}")
    common.print_table(sampling, COLUMNS)
    chat = chat_rows(args.chat_block_size, args.turns, max(1, args.turns // 8), device)
    title = f"Chat: {args.turns} turns, block_size {args.chat_block_size}, replies of up to 32 tokens:"
    common.print_table(chat["windows"], CHAT, title)
    return common.finish(dict(benchmark="long_context", machine=label, shape=SHAPE, sampling=sampling, chat=chat), args)


if __name__ == "__main__":
    main()
