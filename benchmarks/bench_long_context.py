"""What a token costs with and without the KV cache, once the context is full (sampling far past block_size), and in
a chat of many turns.

    python benchmarks/bench_long_context.py                       # gpt and llama (learned positions, RoPE)
    python benchmarks/bench_long_context.py --quick --json /tmp/lc.json

Sampling: generate() with the KV cache from a one-token prompt for 8 x block_size tokens (temperature 1, fixed
seed), each token's time taken in on_token.  The cache holds block_size positions; when it is full it is refilled
with the last block_size/2 tokens at positions 0.. (learned positions and RoPE angles are baked into the cached
keys, so they cannot be shifted in place).  A refill is a prefill of block_size/2 tokens every block_size/2 steps:
about one extra prefilled token per generated one, the same whatever the length.  Printed per window of
block_size/2 tokens: ms per token, so a cost that grew with the length would show as a rising row; and the worst
single token (the refill's pause).  Without the cache: generate(use_kv_cache=False) for block_size tokens from the
same prompt, each step a forward pass over the whole context so far; its ms per token against the cached run's over
the same context lengths (before the context is full).

Chat: ChatSession with the KV cache, `--turns` piped-in turns (max_new_tokens 32, temperature 1, fixed seed) on
a random byte-level ChatML model: ms per turn and tokens run through the model per turn (prefilled), per
window of turns.  Random weights reply with random bytes, so its replies are as long as allowed and re-encode to
other ids (the cache is refilled from there): a harsher case than a trained model's.

Prints markdown tables and writes JSON (default benchmarks/results/long_context.json).  float32, batch 1.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks.common import (
    common_parser,
    describe_machine,
    load_avg,
    machine_label,
    markdown_table,
    pick_device,
    synchronize,
    wait_for_quiet,
    write_json,
)
from minigpt.core.chat import ChatSession
from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.config import GPTConfig
from minigpt.core.generation import generate
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer

SHAPE = dict(n_layer=4, n_head=4, n_embd=128, dropout=0.0)


def per_token_ms(model: GPT, tokens: int, device: torch.device, seed: int, kv_cache: bool = True) -> list[float]:
    """Milliseconds of each generated token (the first includes the one-token prefill)."""
    times: list[float] = []
    last = [time.perf_counter()]

    def tick(_: torch.Tensor) -> None:
        synchronize(device)
        now = time.perf_counter()
        times.append(1e3 * (now - last[0]))
        last[0] = now

    generate(
        model,
        torch.zeros(1, 1, dtype=torch.long, device=device),
        tokens,
        temperature=1.0,
        generator=torch.Generator(device=device).manual_seed(seed),
        on_token=tick,
        use_kv_cache=kv_cache,
    )
    return times


def sampling_rows(arch: str, block_size: int, device: torch.device, seed: int, blocks: int) -> dict:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(arch=arch, block_size=block_size, vocab_size=256, **SHAPE)).to(device).eval()
    per_token_ms(model, block_size, device, seed)  # warm-up: every context length and one refill
    times = per_token_ms(model, blocks * block_size, device, seed)
    half = block_size // 2
    windows = [statistics.fmean(times[i : i + half]) for i in range(0, len(times), half)]
    full = times[block_size:]  # once the context is full
    per_token_ms(model, block_size, device, seed, kv_cache=False)  # warm-up without the cache
    no_cache = statistics.fmean(per_token_ms(model, block_size, device, seed, kv_cache=False)[1:])
    return dict(
        arch=arch,
        block_size=block_size,
        tokens=len(times),
        window_tokens=half,
        ms_per_token_windows=[round(w, 3) for w in windows],
        ms_before_full=round(statistics.fmean(times[1:block_size]), 3),
        ms_no_cache=round(no_cache, 3),
        kv_cache_speedup=round(no_cache / statistics.fmean(times[1:block_size]), 2),
        ms_once_full=round(statistics.fmean(full), 3),
        ms_median_once_full=round(statistics.median(full), 3),
        ms_worst_token=round(max(full), 2),
        last_over_first_full_window=round(windows[-1] / windows[2], 3),
    )


def chat_rows(block_size: int, turns: int, window: int, device: torch.device, seed: int) -> dict:
    torch.manual_seed(seed)
    tokenizer = ChatTokenizer.for_base(ByteTokenizer())
    model = GPT(GPTConfig(block_size=block_size, vocab_size=tokenizer.vocab_size, **SHAPE)).to(device).eval()
    session = ChatSession(
        model,
        tokenizer,
        system="Answer briefly.",
        max_new_tokens=32,
        temperature=1.0,
        generator=torch.Generator(device=device).manual_seed(seed),
    )
    rows, started, prefilled = [], time.perf_counter(), 0
    for turn in range(1, turns + 1):
        session.reply(f"What is {turn} plus {turn + 1}? Tell me more about it, please.")
        if turn % window == 0:
            synchronize(device)
            now = time.perf_counter()
            rows.append(
                dict(
                    turns=f"{turn - window + 1}-{turn}",
                    ms_per_turn=round(1e3 * (now - started) / window, 1),
                    prefilled_per_turn=round((session.prefilled - prefilled) / window, 1),
                )
            )
            started, prefilled = now, session.prefilled
    return dict(block_size=block_size, turns=turns, max_new_tokens=32, windows=rows)


def main(argv: list[str] | None = None) -> dict:
    p = common_parser(__doc__.splitlines()[0], "long_context")
    p.add_argument("--block_sizes", type=int, nargs="+", default=[64, 256])
    p.add_argument("--blocks", type=int, default=8, help="tokens sampled, in block sizes (default 8)")
    p.add_argument("--turns", type=int, default=200)
    p.add_argument("--chat_block_size", type=int, default=512)
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args(argv)
    if args.quick:
        args.block_sizes, args.blocks, args.turns, args.chat_block_size = [16], 4, 8, 128
    device = pick_device(args.device)
    torch.set_grad_enabled(False)
    load_readings = wait_for_quiet(tries=args.wait_quiet)
    label = machine_label(device, "float32")
    print(describe_machine(label))
    sampling = [
        sampling_rows(arch, bs, device, args.seed, args.blocks) for arch in ("gpt", "llama") for bs in args.block_sizes
    ]
    print(
        f"\nSampling {args.blocks} x block_size tokens, {SHAPE['n_layer']} layers x {SHAPE['n_head']} heads, n_embd "
        f"{SHAPE['n_embd']}; ms per token in windows of block_size/2 tokens:\n"
    )
    for r in sampling:
        windows = " ".join(f"{w:.2f}" for w in r["ms_per_token_windows"])
        print(f"  {r['arch']:5s} block {r['block_size']:4d}: {windows}")
    print()
    print(
        markdown_table(
            sampling,
            [
                ("arch", "block", ""),
                ("block_size", "block_size", "d"),
                ("ms_no_cache", "ms/token, no KV cache", ".3f"),
                ("ms_before_full", "ms/token before full", ".3f"),
                ("kv_cache_speedup", "KV cache speed-up", ".2f"),
                ("ms_once_full", "ms/token once full", ".3f"),
                ("last_over_first_full_window", "last / first full window", ".3f"),
                ("ms_worst_token", "worst token (refill), ms", ".2f"),
            ],
        )
    )
    window = max(1, args.turns // 8)
    chat = chat_rows(args.chat_block_size, args.turns, window, device, args.seed)
    print(f"\nChat: {args.turns} turns, block_size {args.chat_block_size}, replies of up to 32 tokens:\n")
    print(
        markdown_table(
            chat["windows"],
            [
                ("turns", "turns", ""),
                ("ms_per_turn", "ms/turn", ".1f"),
                ("prefilled_per_turn", "tokens run per turn", ".1f"),
            ],
        )
    )
    result = dict(
        benchmark="long_context",
        machine=label,
        load_avg_1m_before=load_readings,
        load_avg_1m_after=load_avg(),
        shape=SHAPE,
        sampling=sampling,
        chat=chat,
    )
    print(f"\nwrote {write_json(result, args.json)}")
    return result


if __name__ == "__main__":
    main()
