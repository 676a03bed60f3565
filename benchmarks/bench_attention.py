"""Attention paths side by side: time and peak memory of sdpa, manual and einops, with and without GQA.

    python benchmarks/bench_attention.py                       # B=4, 8 heads x 64, T = 128 .. 2048, float32
    python benchmarks/bench_attention.py --quick               # tiny smoke run (seconds)
    python benchmarks/bench_attention.py --dtype bfloat16 --seq_lens 512 1024 2048 --json /tmp/a.json
    python benchmarks/bench_attention.py --scope layer         # the whole CausalSelfAttention layer

What is measured (default `--scope core`): the core attention computation of one `CausalSelfAttention`
given q, k and v -- the layer's own `_sdpa` / `_manual` / `_einops` method, with the layer's causal mask --
on q (B, nh, T, hs) and k, v (B, nkv, T, hs) leaf tensors that require grad.  `--scope layer` times the
whole layer instead (qkv projection, attention, output projection) on x (B, T, nh*hs).

* forward: one training-mode forward (autograd records the graph, as in training), median of --repeats
  calls after --warmup calls;
* forward+backward: forward, then backward of a fixed random output gradient; median likewise;
* peak memory: bytes allocated at the peak of one forward+backward above what was allocated before it
  (inputs not counted, their gradients counted): torch.cuda.max_memory_allocated on a GPU, the peak of the
  running sum of the profiler's allocation/free events (torch.profiler, profile_memory=True) on the CPU.

GQA "on" uses n_kv_head = n_head // 4 (--gqa_kv_heads).  Prints a markdown table and writes the same figures
as JSON (default benchmarks/results/attention.json).
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
    describe_machine,
    load_avg,
    machine_label,
    markdown_table,
    median,
    mib,
    peak_memory,
    pick_device,
    time_fn,
    wait_for_quiet,
    write_json,
)
from minigpt.core.config import GPTConfig
from minigpt.core.model import CausalSelfAttention, causal_mask

PATHS = ("sdpa", "manual", "einops")


def build_case(
    path: str,
    batch: int,
    n_head: int,
    n_kv_head: int,
    head_dim: int,
    seq_len: int,
    max_len: int,
    scope: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
):
    """(forward, forward_backward) closures for one path / GQA setting / sequence length."""
    torch.manual_seed(seed)
    cfg = GPTConfig(
        n_layer=1,
        n_head=n_head,
        n_kv_head=n_kv_head,
        n_embd=n_head * head_dim,
        block_size=max_len,
        vocab_size=1,
        attention=path,
        dropout=0.0,
    )
    layer = CausalSelfAttention(cfg).to(device=device, dtype=dtype)
    B, T = batch, seq_len

    def rand(*shape: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)

    if scope == "core":
        core = getattr(layer, f"_{path}")
        q, k, v = rand(B, n_head, T, head_dim), rand(B, n_kv_head, T, head_dim), rand(B, n_kv_head, T, head_dim)
        mask = causal_mask(T, T, device=device)
        grad_out = rand(B, n_head, T, head_dim, grad=False)
        leaves = (q, k, v)

        def forward() -> torch.Tensor:
            return core(q, k, v, mask)[0]
    else:
        x = rand(B, T, n_head * head_dim)
        grad_out = rand(B, T, n_head * head_dim, grad=False)
        leaves = (x, *layer.parameters())

        def forward() -> torch.Tensor:
            return layer(x)

    def forward_backward() -> None:
        for t in leaves:
            t.grad = None
        forward().backward(grad_out)

    return forward, forward_backward


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common_parser(__doc__.splitlines()[0], "attention")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--seq_lens", nargs="+", type=int, default=[128, 256, 512, 1024, 2048])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--n_head", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--gqa_kv_heads", type=int, default=None, help="n_kv_head with GQA on (default n_head // 4)")
    p.add_argument("--gqa", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument(
        "--scope",
        default="core",
        choices=["core", "layer"],
        help="core: attention given q/k/v (default); layer: the whole CausalSelfAttention",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    p.add_argument("--no_memory", action="store_true", help="skip the peak-memory measurement")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_lens, args.batch, args.n_head, args.head_dim = [32, 64], 1, 4, 16
        args.repeats, args.warmup = 1, 1

    device = pick_device(args.device)
    dtype = DTYPES[args.dtype]
    kv_on = args.gqa_kv_heads or max(1, args.n_head // 4)
    gqa_settings = [(g, args.n_head if g == "off" else kv_on) for g in args.gqa]
    seq_lens = sorted(args.seq_lens)
    load_readings = wait_for_quiet(tries=args.wait_quiet)
    label = machine_label(device, dtype)

    settings = dict(
        scope=args.scope,
        batch=args.batch,
        n_head=args.n_head,
        head_dim=args.head_dim,
        gqa_kv_heads=kv_on,
        seq_lens=seq_lens,
        paths=args.paths,
        dtype=str(dtype).removeprefix("torch."),
        repeats=args.repeats,
        warmup=args.warmup,
        statistic="median",
        quick=args.quick,
    )
    print(describe_machine(label))
    print(
        f"Settings: scope {args.scope} ({'attention given q/k/v' if args.scope == 'core' else 'whole layer'}), "
        f"B={args.batch}, n_head={args.n_head}, head_dim={args.head_dim}, GQA on: n_kv_head={kv_on}, "
        f"dtype {settings['dtype']}; median of {args.repeats} after {args.warmup} warm-up\n",
        flush=True,
    )

    rows: list[dict[str, Any]] = []
    for T in seq_lens:  # paths interleaved at each length: load drifts hit them alike
        for gqa, n_kv in gqa_settings:
            for path in args.paths:
                forward, forward_backward = build_case(
                    path, args.batch, args.n_head, n_kv, args.head_dim, T, max(seq_lens), args.scope, dtype, device
                )
                fwd = median(time_fn(forward, device, args.repeats, args.warmup))
                fwd_bwd = median(time_fn(forward_backward, device, args.repeats, args.warmup))
                peak = None if args.no_memory else peak_memory(forward_backward, device)
                row = dict(
                    path=path,
                    gqa=gqa,
                    n_kv_head=n_kv,
                    seq_len=T,
                    fwd_ms=round(fwd * 1e3, 3),
                    fwd_bwd_ms=round(fwd_bwd * 1e3, 3),
                    peak_mib=None if peak is None else round(mib(peak), 2),
                    peak_bytes=peak,
                )
                rows.append(row)
                print(
                    f"  T={T:5d} gqa={gqa:3s} {path:6s}: fwd {row['fwd_ms']:9.2f} ms, fwd+bwd "
                    f"{row['fwd_bwd_ms']:9.2f} ms, peak {row['peak_mib']} MiB",
                    flush=True,
                )
                del forward, forward_backward

    # Scaling from the second-longest to the longest length, and sdpa's speed-up at the longest
    summary: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    if len(seq_lens) >= 2:
        T1, T0 = seq_lens[-1], seq_lens[-2]
        by = {(r["path"], r["gqa"], r["seq_len"]): r for r in rows}
        for gqa, _ in gqa_settings:
            for path in args.paths:
                hi, lo = by[(path, gqa, T1)], by[(path, gqa, T0)]
                s = dict(
                    path=path,
                    gqa=gqa,
                    T=T1,
                    T_prev=T0,
                    fwd_bwd_ms=hi["fwd_bwd_ms"],
                    time_ratio=round(hi["fwd_bwd_ms"] / lo["fwd_bwd_ms"], 2),
                    mem_ratio=(
                        round(hi["peak_bytes"] / lo["peak_bytes"], 2) if hi["peak_bytes"] and lo["peak_bytes"] else None
                    ),
                )
                if "sdpa" in args.paths:
                    s["sdpa_speedup"] = round(hi["fwd_bwd_ms"] / by[("sdpa", gqa, T1)]["fwd_bwd_ms"], 2)
                summary.append(s)
            if "sdpa" in args.paths and len(args.paths) > 1:
                others = [s for s in summary if s["gqa"] == gqa and s["path"] != "sdpa"]
                sd = next(s for s in summary if s["gqa"] == gqa and s["path"] == "sdpa")
                checks[f"sdpa_fastest_fwd_bwd_at_T{T1}_gqa_{gqa}"] = all(s["sdpa_speedup"] > 1 for s in others)
                if sd["mem_ratio"] is not None:
                    # memory linear in T: ratio ~ T1/T0 (2); quadratic: ~ (T1/T0)^2 (4)
                    linear = (T1 / T0) * 1.25
                    checks[f"sdpa_memory_linear_gqa_{gqa}"] = sd["mem_ratio"] <= linear
                    for s in others:
                        if s["path"] == "manual" and s["mem_ratio"] is not None:
                            checks[f"manual_memory_superlinear_gqa_{gqa}"] = s["mem_ratio"] > linear

    columns = [
        ("path", "path", ""),
        ("gqa", "GQA", ""),
        ("n_kv_head", "n_kv_head", "d"),
        ("seq_len", "T", "d"),
        ("fwd_ms", "fwd ms", ".2f"),
        ("fwd_bwd_ms", "fwd+bwd ms", ".2f"),
        ("peak_mib", "peak MiB (fwd+bwd)", ".1f"),
    ]
    ordered = sorted(rows, key=lambda r: (r["gqa"] != "off", r["seq_len"], args.paths.index(r["path"])))
    print("\n" + markdown_table(ordered, columns))
    if summary:
        print(
            f"\nScaling T={summary[0]['T_prev']} -> T={summary[0]['T']} (ratios) and sdpa's fwd+bwd speed-up "
            f"over each path at T={summary[0]['T']}:\n"
        )
        print(
            markdown_table(
                summary,
                [
                    ("path", "path", ""),
                    ("gqa", "GQA", ""),
                    ("fwd_bwd_ms", "fwd+bwd ms", ".2f"),
                    ("time_ratio", "time ratio", ".2f"),
                    ("mem_ratio", "mem ratio", ".2f"),
                    ("sdpa_speedup", "sdpa speed-up", ".2f"),
                ],
            )
        )
    if checks:
        print("\nChecks: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in checks.items()))

    result = dict(
        benchmark="attention",
        machine=label,
        load_avg_1m_before=load_readings,
        load_avg_1m_after=load_avg(),
        settings=settings,
        results=rows,
        scaling=summary,
        checks=checks,
    )
    out = write_json(result, args.json)
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
