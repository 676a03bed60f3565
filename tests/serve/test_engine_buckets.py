"""The engine's static, bucketed decode step (what CUDA graphs replay on a GPU), run eagerly: a batch padded to its
bucket (1, 2, 4, 8 rows) gives every request exactly what generate() gives it alone, as requests finish and the
batch shrinks through the buckets."""

from __future__ import annotations

import threading

import pytest
import torch
from serve_support import alone

from minigpt.serve.engine import Engine, Request

pytestmark = pytest.mark.usefixtures("one_thread")

# five requests: bucket 8 (three padding rows), then 4 (as they finish), 2 and 1
PROMPTS = ["hello there", "why", "the cat sat on the mat", "a b c", "good morning to you"]
MAX_TOKENS = [30, 9, 16, 4, 24]


def run_engine(engine: Engine, requests: list[Request]) -> list[str]:
    """Submit every request before the engine starts (so they decode as one batch) -> each one's text."""
    texts = ["" for _ in requests]
    done = [threading.Event() for _ in requests]
    for i, request in enumerate(requests):

        def on_update(update, i=i):
            texts[i] += update.text
            if update.finish_reason is not None:
                assert update.error is None, update.error
                done[i].set()

        engine.submit(request, on_update)
    engine.start()
    try:
        for event in done:
            assert event.wait(120), "a request never finished"
    finally:
        engine.stop()
    return texts


@pytest.mark.parametrize("fixture", ["base_model", "chat_model"])  # gpt blocks; llama blocks with GQA
def test_a_padded_bucket_gives_each_request_what_it_gets_alone(request, fixture):
    model, tokenizer = request.getfixturevalue(fixture)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    requests = [Request(prompt=p, max_tokens=n, temperature=0) for p, n in zip(prompts, MAX_TOKENS)]
    requests.append(Request(prompt=prompts[0], max_tokens=20, temperature=0.8, seed=3))  # a seeded sampler
    engine = Engine(model, tokenizer, max_batch=8, decode_graphs=True)
    got = run_engine(engine, requests)
    for ids, r, out in zip(prompts, requests, got):
        sampling = dict(temperature=r.temperature)
        if r.seed is not None:
            sampling["generator"] = torch.Generator().manual_seed(r.seed)
        assert out == tokenizer.decode(alone(model, tokenizer, ids, r.max_tokens, **sampling))
    steps = engine.graphs.bucket_steps
    assert sum(steps.values()) == engine.steps
    assert steps[8] > 0 and steps[4] > 0 and steps[2] > 0 and steps[1] > 0, steps  # six rows, then fewer
    assert engine.graphs.cache[0].k.size(2) == model.config.block_size  # one cache for the engine's life


def test_without_room_for_the_static_cache_the_engine_decodes_with_a_growing_one(monkeypatch, base_model, caplog):
    """A long context's max_batch x block_size cache may not fit on the GPU: the engine says so and goes on."""
    import minigpt.serve.engine as engine_module

    def no_room(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(engine_module, "DecodeGraphs", no_room)
    model, tokenizer = base_model
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
    engine = Engine(model, tokenizer, max_batch=4, decode_graphs=True)
    got = run_engine(engine, [Request(prompt=p, max_tokens=12, temperature=0) for p in prompts])
    assert got == [tokenizer.decode(alone(model, tokenizer, p, 12)) for p in prompts]
    assert engine.graphs is None and not engine.use_graphs
    assert "decoding without CUDA graphs" in caplog.text


@pytest.mark.parametrize("decode_graphs", [False, True])
def test_a_sliding_window_model_serves_each_request_as_it_decodes_alone(chat_model, decode_graphs):
    """Sliding layers (window 8, one of the two) keep a ring in the batch's cache, growing or static; prompts and
    replies run past the window, rows join, leave and move, and each request gets what generate() gives it alone."""
    from support import varied_gpt

    _, tokenizer = chat_model
    model = varied_gpt(
        "llama",
        n_kv_head=2,
        vocab_size=tokenizer.vocab_size,
        block_size=64,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    requests = [Request(prompt=p, max_tokens=n, temperature=0) for p, n in zip(prompts, MAX_TOKENS)]
    engine = Engine(model, tokenizer, max_batch=4, decode_graphs=decode_graphs)
    got = run_engine(engine, requests)
    assert got == [tokenizer.decode(alone(model, tokenizer, p, n)) for p, n in zip(prompts, MAX_TOKENS)]
    if decode_graphs:
        assert [layer.k.size(2) for layer in engine.graphs.cache] == [8, 64]
