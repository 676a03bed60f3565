"""Attention paths side by side: time and peak memory of sdpa, manual and einops, with and without GQA.

    python benchmarks/bench_attention.py                       # B=4, 8 heads x 64, T = 128 .. 2048, float32

Method and results: docs/performance.md#attention-paths.
"""

import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks import common
from minigpt.core.config import GPTConfig
from minigpt.core.model import CausalSelfAttention, causal_mask

PATHS = ("sdpa", "manual", "einops")
COLUMNS = common.columns(
    "path:path:, gqa:GQA:, n_kv_head:n_kv_head:d, seq_len:T:d, fwd_ms:fwd ms:.2f, fwd_bwd_ms:fwd+bwd ms:.2f, "
    "peak_mib:peak MiB (fwd+bwd):.1f"
)
SCALING = common.columns(
    "path:path:, gqa:GQA:, fwd_bwd_ms:fwd+bwd ms:.2f, time_ratio:time ratio:.2f, mem_ratio:mem ratio:.2f, "
    "sdpa_speedup:sdpa speed-up:.2f"
)


def build_case(path: str, n_kv_head: int, T: int, args: Any, dtype: torch.dtype, device: torch.device):
    """(forward, forward_backward) closures of one attention path on leaf q, k, v: docs/performance.md."""
    torch.manual_seed(0)
    B, nh, hs = args.batch, args.n_head, args.head_dim
    shape = dict(n_layer=1, n_head=nh, n_kv_head=n_kv_head, n_embd=nh * hs, block_size=max(args.seq_lens))
    layer = CausalSelfAttention(GPTConfig(**shape, vocab_size=1, attention=path, dropout=0.0)).to(device, dtype)
    q, k, v = (
        torch.randn(B, h, T, hs, device=device, dtype=dtype, requires_grad=True) for h in (nh, n_kv_head, n_kv_head)
    )
    mask, grad_out = causal_mask(T, T, device=device), torch.randn(B, nh, T, hs, device=device, dtype=dtype)

    # the mask each path gets in training: sdpa none (is_causal, as the model calls it), the others the causal one
    mask = None if path == "sdpa" else mask

    def forward() -> torch.Tensor:
        return getattr(layer, f"_{path}")(q, k, v, mask)[0]

    def forward_backward() -> None:
        q.grad = k.grad = v.grad = None
        forward().backward(grad_out)

    return forward, forward_backward


def peak_memory(fn: Callable[[], Any], device: torch.device) -> int:
    """Bytes allocated by fn() at its peak, above what was allocated when it started (on the CPU from the raw kineto
    events, which keep every "[memory]" record; prof.events() folds those inside an op into one)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        return torch.cuda.max_memory_allocated(device) - before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    kinds = {torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.MKLDNN, torch.autograd.DeviceType.IDEEP}
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() in kinds]
    records = sorted((e.start_ns(), e.nbytes()) for e in events)  # in time order: the running sum's peak
    return max(itertools.accumulate((nbytes for _, nbytes in records), initial=0))


def scaling(rows: list[dict[str, Any]], seq_lens: list[int]) -> list[dict[str, Any]]:
    """Each path's growth from the second-longest length to the longest, and sdpa's speed-up there."""
    T0, T1 = seq_lens[-2], seq_lens[-1]
    by = {(r["path"], r["gqa"], r["seq_len"]): r for r in rows}
    out = []
    for (path, gqa, T), hi in by.items():
        if T == T1:
            lo, sdpa = by[(path, gqa, T0)], by[("sdpa", gqa, T1)]
            row = dict(path=path, gqa=gqa, T=T1, T_prev=T0, fwd_bwd_ms=hi["fwd_bwd_ms"])
            row["time_ratio"] = round(hi["fwd_bwd_ms"] / lo["fwd_bwd_ms"], 2)
            row["mem_ratio"] = round(hi["peak_bytes"] / lo["peak_bytes"], 2)
            out.append(row | dict(sdpa_speedup=round(hi["fwd_bwd_ms"] / sdpa["fwd_bwd_ms"], 2)))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__, "attention")
    p.add_argument("--seq_lens", nargs="+", type=common.positive_int, default=[128, 256, 512, 1024, 2048])
    p.add_argument("--batch", type=common.positive_int, default=4)
    p.add_argument("--n_head", type=common.positive_int, default=8)
    p.add_argument("--head_dim", type=common.positive_int, default=64)
    p.add_argument("--dtype", default="float32", choices=sorted(common.DTYPES))
    p.add_argument(
        "--repeats", type=common.positive_int, default=3, help="timed calls per measurement (median reported)"
    )
    p.add_argument("--warmup", type=common.non_negative_int, default=1, help="untimed calls before timing")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_lens, args.batch, args.n_head, args.head_dim, args.repeats = [32, 64], 1, 4, 16, 1
    args.seq_lens = sorted(args.seq_lens)
    device, dtype = common.pick_device(args.device), getattr(torch, args.dtype)
    kv_heads = {"off": args.n_head, "on": max(1, args.n_head // 4)}
    label = common.start(args, device, dtype)
    print(
        f"Settings: the attention core, B={args.batch}, n_head={args.n_head}, head_dim={args.head_dim}, GQA on: "
        f"n_kv_head={kv_heads['on']}; median of {args.repeats} after {args.warmup} warm-up\n",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    for T in args.seq_lens:  # paths interleaved at each length: load drifts hit them alike
        for gqa in ("off", "on"):
            for path in PATHS:
                forward, forward_backward = build_case(path, kv_heads[gqa], T, args, dtype, device)
                fwd = common.median(common.time_fn(forward, device, args.repeats, args.warmup))
                fwd_bwd = common.median(common.time_fn(forward_backward, device, args.repeats, args.warmup))
                peak = peak_memory(forward_backward, device)
                row = dict(path=path, gqa=gqa, n_kv_head=kv_heads[gqa], seq_len=T, fwd_ms=round(fwd * 1e3, 3))
                row |= dict(fwd_bwd_ms=round(fwd_bwd * 1e3, 3), peak_bytes=peak, peak_mib=round(common.mib(peak), 2))
                rows.append(row)
                common.print_row(rows[-1], COLUMNS)
    rows.sort(key=lambda r: (r["gqa"] != "off", r["seq_len"], PATHS.index(r["path"])))
    common.print_table(rows, COLUMNS)
    summary = scaling(rows, args.seq_lens) if len(args.seq_lens) >= 2 else []
    if summary:
        T0, T1 = args.seq_lens[-2:]
        title = f"Scaling T={T0} -> T={T1} (ratios) and sdpa's fwd+bwd speed-up at T={T1}:"
        common.print_table(summary, SCALING, title)
    settings = {k: getattr(args, k) for k in ("batch", "n_head", "head_dim", "seq_lens", "dtype")}
    settings |= dict(gqa_kv_heads=kv_heads["on"], repeats=args.repeats, warmup=args.warmup, quick=args.quick)
    result = dict(benchmark="attention", machine=label, settings=settings, results=rows, scaling=summary)
    return common.finish(result, args)


if __name__ == "__main__":
    main()
