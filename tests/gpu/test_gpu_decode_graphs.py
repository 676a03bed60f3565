"""Decoding from CUDA graphs on a GPU (minigpt.core.decode_graphs): generate(compile=True) and the serve engine
replay a captured static step and give the eager loop's greedy ids; one graph per batch bucket serves every
position and is reused by the next generation.  Skipped without CUDA (tests/core/test_decode_graphs.py and
tests/serve/test_engine_buckets.py run the same static step eagerly on the CPU)."""

from __future__ import annotations

import threading

import pytest
import torch

import minigpt.core.compiled as compiled
from minigpt.core.tokenizers import CharTokenizer
from minigpt.serve.engine import Engine, Request
from support import random_ids, varied_gpt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU"),
]
PATHS = ["sdpa", "manual", "einops"]
BLOCK = 32  # varied_gpt's block_size


def cuda_gpt(arch: str, n_kv_head: int, attention: str = "sdpa", **config) -> torch.nn.Module:
    return varied_gpt(arch, n_kv_head, attention, **config).cuda()


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("arch,n_kv_head", [("gpt", 4), ("llama", 2)])
def test_graph_replays_give_the_eager_loops_greedy_ids(monkeypatch, arch, n_kv_head, attention):
    """The eager step captured (no compile: one capture per path is quick), past block_size (refills)."""
    monkeypatch.setattr(compiled, "compiler_available", lambda device_type="cpu": False)
    model = cuda_gpt(arch, n_kv_head, attention)
    idx = random_ids().cuda()
    n = 2 * BLOCK
    eager = generate_ids(model, idx, n)
    assert len(set(eager[0, 5:].tolist())) > 4  # varied output, so the comparison means something
    assert torch.equal(generate_ids(model, idx, n, compile=True), eager)
    graphs = compiled.decode_graphs(model, 2, BLOCK)
    assert list(graphs.graphs) == [2] and graphs.bucket_steps[2] == n - 4  # one graph, every step but the prefills
    graph = graphs.graphs[2][0]
    assert torch.equal(generate_ids(model, idx, 20, compile=True), eager[:, :25])  # 25 positions: a cache of 32
    assert compiled.decode_graphs(model, 2, BLOCK).graphs[2][0] is graph  # the next generation replays it


def test_compiled_graph_gives_the_eager_loops_greedy_ids():
    """With Triton, the captured step is torch.compile's (fused kernels): the same ids for a llama GQA model."""
    if not compiled.compiler_available("cuda"):
        pytest.skip("Triton is not installed")
    model = cuda_gpt("llama", 2)
    idx = random_ids(batch=1).cuda()
    eager = generate_ids(model, idx, 40)
    assert torch.equal(generate_ids(model, idx, 40, compile=True), eager)
    assert list(compiled.decode_graphs(model, 1, BLOCK).graphs) == [1]  # 45 positions: a cache of block_size


def test_a_model_held_to_the_flash_kernel_keeps_the_dynamic_step(monkeypatch):
    """flash attention takes no mask, and the static step needs one: such a model decodes as before (captured, its
    masked step would find no kernel)."""
    monkeypatch.setattr(compiled, "compiler_available", lambda device_type="cpu": False)  # no compile wait
    assert compiled.uses_graphs(cuda_gpt("gpt", 4))
    model = cuda_gpt("gpt", 4, sdpa_backend="flash").to(torch.bfloat16)  # flash runs in 16 bits only
    assert not compiled.uses_graphs(model)
    idx = random_ids(batch=1).cuda()
    assert generate_ids(model, idx, 12, compile=True).shape == (1, 17)


def generate_ids(model, idx, n, compile=False):
    from minigpt.core.generation import generate

    return generate(model, idx, n, temperature=0, compile=compile)


CHARS = "\n abcdefghijklmnopqrstuvwxyz"
PROMPTS = ["hello there", "why", "the cat sat on the mat", "a b c", "good day"]
MAX_TOKENS = [40, 9, 20, 4, 30]


def engine_texts(engine: Engine, tokenizer: CharTokenizer) -> list[str]:
    """PROMPTS submitted together, then the engine started -> each request's text."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    texts, done = [""] * len(prompts), [threading.Event() for _ in prompts]
    for i, (ids, n) in enumerate(zip(prompts, MAX_TOKENS)):

        def on_update(update, i=i):
            texts[i] += update.text
            if update.finish_reason is not None:
                done[i].set()

        engine.submit(Request(prompt=ids, max_tokens=n, temperature=0), on_update)
    engine.start()
    try:
        assert all(event.wait(120) for event in done)
    finally:
        engine.stop()
    return texts


def texts_alone(model, tokenizer: CharTokenizer) -> list[str]:
    prompts = [torch.tensor([tokenizer.encode(p)], device="cuda") for p in PROMPTS]
    return [tokenizer.decode(generate_ids(model, p, n)[0, p.size(1) :].tolist()) for p, n in zip(prompts, MAX_TOKENS)]


def test_the_engine_replays_one_graph_per_bucket_and_each_request_gets_its_ids_alone():
    model, tokenizer = cuda_gpt("llama", 2, vocab_size=len(CHARS), block_size=96), CharTokenizer(CHARS)
    engine = Engine(model, tokenizer, max_batch=8, compile=False)  # the eager step captured
    assert engine_texts(engine, tokenizer) == texts_alone(model, tokenizer)
    graphs = engine.graphs
    assert set(graphs.graphs) == {b for b, steps in graphs.bucket_steps.items() if steps} == {1, 2, 4, 8}


def test_the_engine_compiles_and_captures_every_bucket_before_serving():
    """The server's default with Triton: torch.compile's step, captured for every bucket as the engine starts; each
    request still gets its ids alone (the eager loop's)."""
    if not compiled.compiler_available("cuda"):
        pytest.skip("Triton is not installed")
    model, tokenizer = cuda_gpt("gpt", 4, vocab_size=len(CHARS), block_size=96), CharTokenizer(CHARS)
    engine = Engine(model, tokenizer, max_batch=4)
    assert engine.compile and engine.graphs is None
    engine.start()
    engine.stop()
    assert set(engine.graphs.graphs) == {1, 2, 4} and engine.graphs.forward is compiled.graph_forward()
    assert engine_texts(engine, tokenizer) == texts_alone(model, tokenizer)
    assert set(engine.graphs.graphs) == {1, 2, 4}  # no capture past warm-up
