"""Attention lab figures: capture time, page size and time until the page has rendered in headless Chromium.

    python benchmarks/bench_attention_lab.py                   # GPT-2 124M shape (12 layers x 12 heads), 256 tokens

Method and results: docs/performance.md#the-attention-lab.
"""

import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
# run from anywhere without installing; tests/browser.py drives headless Chromium
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from benchmarks import common
from browser import chromium_path, open_page
from minigpt.core.config import GPTConfig
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.lab.capture import capture_attention
from minigpt.lab.html import write_html
from minigpt.loading import load_model

TEXT = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "  # ASCII: a byte, a token


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__, "attention_lab")
    p.add_argument("--ckpt", default=None, help="a checkpoint instead of the random GPT-2-shaped model")
    p.add_argument("--tokens", type=common.positive_int, default=256, help="prompt length in tokens")
    p.add_argument("--repeats", type=common.positive_int, default=3)
    args = p.parse_args(argv)
    device = common.pick_device(args.device)
    if args.ckpt:
        model, tokenizer = load_model(args.ckpt, device=device)
    else:
        torch.manual_seed(0)
        shape = dict(n_layer=2, n_head=2, n_embd=32, block_size=64) if args.quick else {}
        model = GPT(GPTConfig.from_name("gpt2", **shape)).to(device).eval()
        tokenizer = ByteTokenizer()
    tokens = 32 if args.quick else args.tokens
    text = TEXT * (tokens // len(TEXT) + 1)
    ids = tokenizer.encode(text)[:tokens]
    prompt = tokenizer.decode(ids)

    label = common.start(args, device)
    cfg = model.config
    print(f"Model: {cfg.n_layer} layers x {cfg.n_head} heads, {model.num_params():,} parameters; {len(ids)} tokens")

    capture_s = common.time_fn(lambda: capture_attention(model, tokenizer, prompt), device, args.repeats, warmup=0)
    render_ms, errors = [], "chromium not installed (apt-get install chromium): no render time"
    with tempfile.TemporaryDirectory() as tmp:
        page = write_html(capture_attention(model, tokenizer, prompt), Path(tmp) / "attention.html")
        html_bytes = page.stat().st_size
        for _ in range(args.repeats if chromium_path() else 0):
            state = open_page(page, budget_ms=60000, timeout=300)
            if not state.ready:
                raise SystemExit(f"the page did not finish building its views: {state.errors}")
            render_ms.append(state.render_ms)
            errors = state.errors

    result = dict(machine=label, n_layer=cfg.n_layer, n_head=cfg.n_head, tokens=len(ids), html_bytes=html_bytes)
    result |= dict(capture_s=round(common.median(capture_s), 3), script_errors=errors)
    result["render_ms"] = round(common.median(render_ms), 1) if render_ms else None
    print(f"capture (prompt + induction probe, median of {args.repeats}): {result['capture_s']:.3f} s")
    print(f"attention.html: {html_bytes / 2**20:.2f} MiB ({html_bytes:,} bytes)")
    print(f"rendered in headless Chromium (to all views built, median): {result['render_ms']} ms; errors: {errors}")
    return common.finish(result, args)


if __name__ == "__main__":
    main()
