"""Attention paths side by side: time and peak memory of sdpa, manual and einops, with and without GQA.

    python benchmarks/bench_attention.py                       # B=4, 8 heads x 64, T = 128 .. 2048, float32
    python benchmarks/bench_attention.py --quick               # tiny smoke run (seconds)
    python benchmarks/bench_attention.py --dtype bfloat16 --seq_lens 512 1024 2048 --json /tmp/a.json
    python benchmarks/bench_attention.py --scope layer         # the whole CausalSelfAttention layer

`--scope core` (the default) times one CausalSelfAttention's own `_sdpa` / `_manual` / `_einops` method with its
causal mask on leaf q (B, nh, T, hs) and k, v (B, nkv, T, hs) that require grad; `--scope layer` the whole layer
on x (B, T, nh*hs).  Forward (training mode) and forward + backward of a fixed output gradient, the median of
--repeats after --warmup; peak memory of one forward + backward above what was allocated before it (common.py's
peak_memory).  GQA "on" uses n_kv_head = n_head // 4.  Then each path's growth from the second-longest length to
the longest, and sdpa's speed-up over it there.  Results: docs/performance.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks.common import (
    DTYPES,
    common_parser,
    finish,
    median,
    mib,
    peak_memory,
    pick_device,
    print_table,
    start,
    time_fn,
)
from minigpt.core.config import GPTConfig
from minigpt.core.model import CausalSelfAttention, causal_mask

PATHS = ("sdpa", "manual", "einops")
COLUMNS = [("path", "path", ""), ("gqa", "GQA", ""), ("n_kv_head", "n_kv_head", "d"), ("seq_len", "T", "d")]
COLUMNS += [("fwd_ms", "fwd ms", ".2f"), ("fwd_bwd_ms", "fwd+bwd ms", ".2f"), ("peak_mib", "peak MiB (fwd+bwd)", ".1f")]
SCALING = [("path", "path", ""), ("gqa", "GQA", ""), ("fwd_bwd_ms", "fwd+bwd ms", ".2f")]
SCALING += [
    ("time_ratio", "time ratio", ".2f"),
    ("mem_ratio", "mem ratio", ".2f"),
    ("sdpa_speedup", "sdpa speed-up", ".2f"),
]


def build_case(path: str, n_kv_head: int, T: int, args: Any, dtype: torch.dtype, device: torch.device):
    """(forward, forward_backward) closures for one path / GQA setting / sequence length."""
    torch.manual_seed(0)
    B, nh, hs = args.batch, args.n_head, args.head_dim
    shape = dict(n_layer=1, n_head=nh, n_kv_head=n_kv_head, n_embd=nh * hs, block_size=max(args.seq_lens))
    layer = CausalSelfAttention(GPTConfig(**shape, vocab_size=1, attention=path, dropout=0.0))
    layer = layer.to(device=device, dtype=dtype)

    def rand(*shape: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)

    if args.scope == "core":
        core = getattr(layer, f"_{path}")
        q, k, v = rand(B, nh, T, hs), rand(B, n_kv_head, T, hs), rand(B, n_kv_head, T, hs)
        mask = causal_mask(T, T, device=device)
        grad_out, leaves = rand(B, nh, T, hs, grad=False), (q, k, v)

        def forward() -> torch.Tensor:
            return core(q, k, v, mask)[0]
    else:
        x = rand(B, T, nh * hs)
        grad_out, leaves = rand(B, T, nh * hs, grad=False), (x, *layer.parameters())

        def forward() -> torch.Tensor:
            return layer(x)

    def forward_backward() -> None:
        for t in leaves:
            t.grad = None
        forward().backward(grad_out)

    return forward, forward_backward


def scaling(rows: list[dict[str, Any]], seq_lens: list[int]) -> list[dict[str, Any]]:
    """Each path's time and memory growth from the second-longest length to the longest, and sdpa's speed-up
    there: memory linear in T grows T1/T0 (2x), quadratic (T1/T0)^2 (4x)."""
    T0, T1 = seq_lens[-2], seq_lens[-1]
    by = {(r["path"], r["gqa"], r["seq_len"]): r for r in rows}
    out = []
    for (path, gqa, T), hi in by.items():
        if T != T1:
            continue
        lo = by[(path, gqa, T0)]
        row = dict(path=path, gqa=gqa, T=T1, T_prev=T0, fwd_bwd_ms=hi["fwd_bwd_ms"])
        row["time_ratio"] = round(hi["fwd_bwd_ms"] / lo["fwd_bwd_ms"], 2)
        if hi["peak_bytes"] and lo["peak_bytes"]:
            row["mem_ratio"] = round(hi["peak_bytes"] / lo["peak_bytes"], 2)
        if ("sdpa", gqa, T1) in by:
            row["sdpa_speedup"] = round(hi["fwd_bwd_ms"] / by[("sdpa", gqa, T1)]["fwd_bwd_ms"], 2)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common_parser(__doc__, "attention")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--seq_lens", nargs="+", type=int, default=[128, 256, 512, 1024, 2048])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--n_head", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--gqa", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--scope", default="core", choices=["core", "layer"], help="attention given q/k/v, or the layer")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    p.add_argument("--no_memory", action="store_true", help="skip the peak-memory measurement")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_lens, args.batch, args.n_head, args.head_dim, args.repeats = [32, 64], 1, 4, 16, 1
    args.seq_lens = sorted(args.seq_lens)
    device, dtype = pick_device(args.device), DTYPES[args.dtype]
    kv_heads = {"off": args.n_head, "on": max(1, args.n_head // 4)}
    label = start(args, device, dtype)
    print(
        f"Settings: scope {args.scope}, B={args.batch}, n_head={args.n_head}, head_dim={args.head_dim}, GQA on: "
        f"n_kv_head={kv_heads['on']}; median of {args.repeats} after {args.warmup} warm-up\n",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    for T in args.seq_lens:  # paths interleaved at each length: load drifts hit them alike
        for gqa in args.gqa:
            for path in args.paths:
                forward, forward_backward = build_case(path, kv_heads[gqa], T, args, dtype, device)
                fwd = median(time_fn(forward, device, args.repeats, args.warmup))
                fwd_bwd = median(time_fn(forward_backward, device, args.repeats, args.warmup))
                peak = None if args.no_memory else peak_memory(forward_backward, device)
                row = dict(path=path, gqa=gqa, n_kv_head=kv_heads[gqa], seq_len=T, fwd_ms=round(fwd * 1e3, 3))
                row |= dict(fwd_bwd_ms=round(fwd_bwd * 1e3, 3), peak_bytes=peak)
                row["peak_mib"] = None if peak is None else round(mib(peak), 2)
                rows.append(row)
                print(
                    f"  T={T:5d} gqa={gqa:3s} {path:6s}: fwd {row['fwd_ms']:9.2f} ms, fwd+bwd "
                    f"{row['fwd_bwd_ms']:9.2f} ms, peak {row['peak_mib']} MiB",
                    flush=True,
                )
    print_table(sorted(rows, key=lambda r: (r["gqa"] != "off", r["seq_len"], args.paths.index(r["path"]))), COLUMNS)
    summary = scaling(rows, args.seq_lens) if len(args.seq_lens) >= 2 else []
    if summary:
        T0, T1 = args.seq_lens[-2:]
        print_table(summary, SCALING, f"Scaling T={T0} -> T={T1} (ratios) and sdpa's fwd+bwd speed-up at T={T1}:")
    settings = {k: getattr(args, k) for k in ("scope", "batch", "n_head", "head_dim", "seq_lens", "paths", "dtype")}
    settings |= dict(gqa_kv_heads=kv_heads["on"], repeats=args.repeats, warmup=args.warmup, quick=args.quick)
    result = dict(benchmark="attention", machine=label, settings=settings, results=rows, scaling=summary)
    return finish(result, args)


if __name__ == "__main__":
    main()
