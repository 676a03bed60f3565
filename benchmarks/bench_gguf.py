"""GGUF export: file size and decode speed in llama.cpp (through xllamacpp) next to minigpt's own sampler, on the
same model, and each weight type's agreement with f32.

    python benchmarks/bench_gguf.py              # GPT-2 124M and SmolLM2-135M shapes, random weights (minutes)

Method and results: docs/gguf.md#speed-and-size.
"""

import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "export"))  # the GGUF tests' helpers

from gguf_models import trained_model, words_text
from llamacpp_server import LlamaCpp

from benchmarks import common
from minigpt.core.config import GPTConfig
from minigpt.core.generation import generate
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer
from minigpt.export.gguf import export_gguf

SHAPES = {
    "gpt2-124M": dict(arch="gpt", n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257),
    "smollm2-135M": dict(arch="llama", n_layer=30, n_head=9, n_kv_head=3, n_embd=576, mlp_hidden=1536),
}
SHAPES["smollm2-135M"] |= dict(block_size=2048, vocab_size=49152, rope_base=100000.0)
QUICK = {
    "gpt-tiny": dict(arch="gpt", n_layer=2, n_head=4, n_embd=64, block_size=128, vocab_size=300),
    "llama-tiny": dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=128, vocab_size=300),
}
TYPES = ("f32", "f16", "q8_0", "q4_0")
COLUMNS = common.columns(
    "shape:shape:, runtime:runtime:, weights:weights:, file_mib:file MiB:.1f, export_s:export s:.2f, "
    "decode_tok_s:decode tokens/s:.1f"
)
AGREEMENT_COLUMNS = common.columns(
    "model:model:, weights:weights:, positions:positions:d, agreement_pct:greedy = f32 %:.1f, ppl:perplexity:.4f, "
    "ppl_ratio:ppl / f32:.4f, minigpt_ppl:minigpt ppl:.4f"
)
PROMPT = list(range(32, 48))  # 16 tokens


def llama_cpp_decode(path: Path, tokens: int, repeats: int, threads: int) -> float:
    """llama.cpp's decode tokens/s (median of `repeats` runs, each from an empty cache), its default KV cache."""
    with LlamaCpp(path, n_ctx=len(PROMPT) + tokens + 16, threads=threads, f32_cache=False) as llama:
        llama.completion(PROMPT, 4, ignore_eos=True)  # warm-up
        rates = []
        for _ in range(repeats):
            result = llama.completion(PROMPT, tokens, ignore_eos=True, cache_prompt=False)
            assert result["tokens_predicted"] == tokens, result["tokens_predicted"]
            rates.append(result["timings"]["predicted_per_second"])
    return statistics.median(rates)


def agreement(root: Path, steps: int) -> list[dict]:
    """Each type's greedy agreement with f32 and perplexity ratio, on the two small trained models of the tests."""
    text, rows = words_text(), []
    for kind, tokenizer, config in (
        ("char-llama", CharTokenizer(text), dict(arch="llama", n_kv_head=2)),
        ("byte-gpt", ByteTokenizer(), dict(arch="gpt", tie_embeddings=False)),
    ):
        model = trained_model(tokenizer.encode(text), tokenizer.vocab_size, steps=steps, **config)
        held_out = tokenizer.encode(words_text(n_lines=20, seed=1))[: model.config.block_size]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([held_out]))[0][0].double(), -1)
        minigpt_nll = -sum(logp[t - 1, held_out[t]].item() for t in range(33, len(held_out)))
        runs = {}
        for gguf_type in ("f32", "f16", "bf16", "q8_0", "q4_0"):
            path = export_gguf(model, tokenizer, root / f"{kind}-{gguf_type}.gguf", gguf_type).path
            with LlamaCpp(path) as llama:
                runs[gguf_type] = llama.scores(held_out, 33, tokenizer.vocab_size)
        (f32_choices, f32_lp) = runs["f32"]
        for gguf_type, (choices, lp) in runs.items():
            same = sum(a == b for a, b in zip(choices, f32_choices)) / len(choices)
            row = dict(model=kind, weights=gguf_type, positions=len(choices), agreement_pct=100 * same)
            row |= dict(ppl=math.exp(-sum(lp) / len(lp)), ppl_ratio=math.exp((sum(f32_lp) - sum(lp)) / len(lp)))
            rows.append(row | dict(minigpt_ppl=math.exp(minigpt_nll / len(lp))))
    return rows


def minigpt_decode(model: GPT, tokens: int, repeats: int) -> float:
    """minigpt's decode tokens/s: generate() as sample.py runs it, the prompt's share taken out."""
    prompt = torch.tensor([PROMPT])

    def seconds(n: int) -> float:
        return common.time_fn(lambda: generate(model, prompt, max_new_tokens=n, temperature=0), "cpu", 1, warmup=0)[0]

    seconds(4)  # warm-up
    return statistics.median((tokens - 1) / (seconds(tokens) - seconds(1)) for _ in range(repeats))


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(common.summary(__doc__), "gguf", device=False)  # on the CPU
    p.add_argument("--tokens", type=common.at_least(2), default=128, help="new tokens per decode run")
    p.add_argument(
        "--repeats", type=common.positive_int, default=3, help="runs per measurement (the median is reported)"
    )
    p.add_argument(
        "--threads",
        type=common.positive_int,
        default=torch.get_num_threads(),
        help="for both runtimes (default: torch's)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes, tokens, repeats = (QUICK, 8, 1) if args.quick else (SHAPES, args.tokens, args.repeats)
    label = common.start(args)
    print(f"threads {args.threads} (torch and llama.cpp)", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-gguf-") as tmp:
        for shape, config in shapes.items():
            torch.manual_seed(0)
            model = GPT(GPTConfig(**config)).eval()
            with torch.inference_mode():
                rate = minigpt_decode(model, tokens, repeats)
            rows.append(dict(shape=shape, runtime="minigpt generate (sample.py)", weights="float32", decode_tok_s=rate))
            common.print_row(rows[-1], COLUMNS)
            for gguf_type in TYPES:
                path = Path(tmp) / f"{shape}-{gguf_type}.gguf"
                started = time.perf_counter()
                export_gguf(model, ByteTokenizer(), path, gguf_type)
                export_s = time.perf_counter() - started
                row = dict(shape=shape, runtime="llama.cpp (xllamacpp)", weights=gguf_type, export_s=export_s)
                row["file_mib"] = common.mib(path.stat().st_size)
                rows.append(row | dict(decode_tok_s=llama_cpp_decode(path, tokens, repeats, args.threads)))
                common.print_row(rows[-1], COLUMNS)
                path.unlink()
            del model
        agreed = agreement(Path(tmp), steps=20 if args.quick else 150)
    common.print_table(rows, COLUMNS)
    common.print_table(agreed, AGREEMENT_COLUMNS)
    settings = dict(tokens=tokens, repeats=repeats, prompt_tokens=len(PROMPT), threads=args.threads, shapes=shapes)
    return common.finish(dict(benchmark="gguf", machine=label, settings=settings, results=rows, agreement=agreed), args)


if __name__ == "__main__":
    main()
