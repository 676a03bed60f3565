"""Sampling speed with and without the KV cache.

    python benchmarks/bench_sampling.py                      # random 'small' model (6x6x384, block 256, vocab 65)
    python benchmarks/bench_sampling.py --ckpt out/RUN       # a trained checkpoint instead
    python benchmarks/bench_sampling.py --tokens 200 --json /tmp/s.json

Batch 1, float32, one warm-up run per mode, then `--tokens` new tokens from a one-token prompt (temperature
1, fixed seed).  Prints a markdown table and writes the same figures as JSON (default
benchmarks/results/sampling.json).  Generation longer than block_size is included on purpose: without the
cache each step then runs a full block_size context; with it the cache is re-filled every block_size/2 steps.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks.common import (
    common_parser,
    describe_machine,
    load_avg,
    machine_label,  # noqa: E402
    markdown_table,
    pick_device,
    synchronize,
    wait_for_quiet,
    write_json,
)
from minigpt.core.config import GPTConfig  # noqa: E402
from minigpt.core.generation import generate  # noqa: E402
from minigpt.core.model import GPT  # noqa: E402
from minigpt.loading import load_model  # noqa: E402

SHAPE = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=65, dropout=0.0)


def time_generate(model: GPT, tokens: int, use_kv_cache: bool, device: torch.device, seed: int) -> float:
    idx = torch.zeros(1, 1, dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    synchronize(device)
    t0 = time.perf_counter()
    out = generate(model, idx, tokens, temperature=1.0, top_k=None, use_kv_cache=use_kv_cache, generator=generator)
    synchronize(device)
    seconds = time.perf_counter() - t0
    assert out.shape == (1, 1 + tokens), out.shape
    return seconds


def main(argv: list[str] | None = None) -> dict:
    p = common_parser(__doc__.splitlines()[0], "sampling")
    p.add_argument("--ckpt", default=None, help="checkpoint file or run dir (default: random init of the shape)")
    p.add_argument("--arch", default="gpt", choices=["gpt", "llama"], help="for random init")
    p.add_argument("--attention", default=None, choices=["sdpa", "manual", "einops"])
    p.add_argument("--tokens", type=int, default=1000, help="new tokens per timed run (default 1000)")
    p.add_argument(
        "--warmup_tokens",
        type=int,
        default=300,
        help="tokens of the warm-up run per mode (default 300: past block_size, so every "
        "context length and a cache refill are warmed up)",
    )
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.warmup_tokens = 40, 10
    device = pick_device(args.device)

    if args.ckpt:
        model, _ = load_model(args.ckpt, device=str(device), attention=args.attention)
        source = str(args.ckpt)
    else:
        torch.manual_seed(args.seed)
        shape = dict(SHAPE, n_layer=1, n_embd=48, block_size=16) if args.quick else SHAPE
        cfg = GPTConfig(arch=args.arch, **shape, **({"attention": args.attention} if args.attention else {}))
        model = GPT(cfg).to(device).eval()
        source = "random init"
    model.float()
    cfg = model.config

    load_readings = wait_for_quiet(tries=args.wait_quiet)
    label = machine_label(device, "float32")
    rows = []
    for mode, use_cache in (("no KV cache", False), ("KV cache", True)):
        time_generate(model, args.warmup_tokens, use_cache, device, args.seed)  # warm-up
        seconds = time_generate(model, args.tokens, use_cache, device, args.seed)
        rows.append(
            dict(
                mode=mode,
                kv_cache=use_cache,
                tokens=args.tokens,
                seconds=round(seconds, 4),
                tokens_per_s=round(args.tokens / seconds, 2),
            )
        )
    for r in rows:
        r["speedup"] = round(r["tokens_per_s"] / rows[0]["tokens_per_s"], 2)

    model_desc = (
        f"{cfg.arch} {cfg.n_layer} layers x {cfg.n_head} heads, n_embd {cfg.n_embd}, block_size "
        f"{cfg.block_size}, vocab {cfg.vocab_size}, attention {cfg.attention} ({source})"
    )
    print(describe_machine(label))
    print(f"Model: {model_desc}; batch 1, {args.tokens} new tokens from a 1-token prompt\n")
    print(
        markdown_table(
            rows,
            [
                ("mode", "mode", ""),
                ("tokens_per_s", "tokens/s", ".1f"),
                ("seconds", "seconds", ".2f"),
                ("speedup", "speed-up", ".2f"),
            ],
        )
    )
    result = dict(
        benchmark="sampling",
        machine=label,
        load_avg_1m_before=load_readings,
        load_avg_1m_after=load_avg(),
        model=model_desc,
        model_config=cfg.to_dict(),
        batch_size=1,
        prompt_tokens=1,
        warmup_tokens=args.warmup_tokens,
        results=rows,
    )
    print(f"\nwrote {write_json(result, args.json)}")
    return result


if __name__ == "__main__":
    main()
