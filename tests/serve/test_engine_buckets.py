"""The engine's static, bucketed decode step (what CUDA graphs replay on a GPU), run eagerly: a batch padded to its
bucket (1, 2, 4, 8 rows) gives every request exactly what generate() gives it alone, as requests finish and the
batch shrinks through the buckets."""

from __future__ import annotations

import copy
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
        assert out == tokenizer.decode_text(alone(model, tokenizer, ids, r.max_tokens, **sampling))
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
    monkeypatch.setattr(engine_module, "compiler_available", lambda device_type="cpu": True)
    engine = Engine(model, tokenizer, max_batch=4, compile=True)  # the static step, compiled: no room for it
    got = run_engine(engine, [Request(prompt=p, max_tokens=12, temperature=0) for p in prompts])
    assert got == [tokenizer.decode_text(alone(model, tokenizer, p, 12)) for p in prompts]
    assert engine.graphs is None and not engine.use_graphs and not engine.compile
    assert "decoding without CUDA graphs" in caplog.text


@pytest.mark.parametrize("decode_graphs", [False, True])
def test_a_greedy_request_on_nan_logits_ends_with_the_broken_weights_error(base_model, decode_graphs):
    """A decode step's NaN logits (here: learned position 4 is NaN, past the prompt) end a greedy request with the
    error a sampled one gets, not with max_tokens of argmax's garbage; a row that never reaches position 4 goes on."""
    model, tokenizer = copy.deepcopy(base_model[0]), base_model[1]
    with torch.no_grad():
        model.transformer.wpe.weight[4].fill_(float("nan"))
    short, shorter = tokenizer.encode("abcd"), tokenizer.encode("ab")
    requests = [Request(prompt=short, max_tokens=8, temperature=t, seed=1) for t in (0, 0.8)]
    requests.append(Request(prompt=shorter, max_tokens=2, temperature=0))  # positions 0..2
    engine = Engine(model, tokenizer, max_batch=4, decode_graphs=decode_graphs)
    finals, done = {}, threading.Event()
    for i, request in enumerate(requests):

        def on_update(update, i=i):
            if update.finish_reason is not None:
                finals[i] = update
                if len(finals) == len(requests):
                    done.set()

        engine.submit(request, on_update)
    engine.start()
    try:
        assert done.wait(120), "a request never finished"
    finally:
        engine.stop()
    for i in (0, 1):
        assert finals[i].finish_reason == "error" and "NaN/inf logits" in finals[i].error, finals[i]
        assert finals[i].completion_tokens == 1  # the prefill's token, then the step at position 4
    assert finals[2].finish_reason == "length" and finals[2].error is None


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
    assert got == [tokenizer.decode_text(alone(model, tokenizer, p, n)) for p, n in zip(prompts, MAX_TOKENS)]
    if decode_graphs:
        assert [layer.k.size(2) for layer in engine.graphs.cache] == [8, 64]


class StepClock:
    """The engine's clock for timing its steps on a CPU: it moves only by what the forwards under test cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def forward(self, seconds: float, calls: list[int] | None = None):
        """A stand-in for the compiled forward: runs the model's own and costs `seconds` (recording its rows)."""

        def forward(model, idx, **kwargs):
            self.now += seconds
            if calls is not None:
                calls.append(idx.size(0))
            return type(model).forward(model, idx, **kwargs)

        return forward

    def uncompiled(self, monkeypatch, model, seconds: float) -> None:
        """The model's own step (uncompiled) costs `seconds` on this clock."""
        forward = model.forward

        def timed(*args, **kwargs):
            self.now += seconds
            return forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", timed)


@pytest.fixture
def step_clock(monkeypatch) -> StepClock:
    """A compiler "found", and a clock for the engine's timing of its steps."""
    import minigpt.core.compiled as compiled
    import minigpt.serve.engine as engine_module

    clock = StepClock()
    compiled.note_once.cache_clear()
    monkeypatch.setattr(engine_module, "step_clock", clock)
    monkeypatch.setattr(engine_module, "compiler_available", lambda device_type="cpu": True)
    return clock


def test_a_compiled_engine_warms_every_bucket_up_before_serving_and_each_request_gets_its_ids_alone(
    monkeypatch, step_clock, chat_model
):
    """start() runs each bucket's step through the compiled forward before any request (on a GPU: compiles and
    captures it; on a CPU it then times bucket 1 against the eager step), writing padding into the static cache;
    the requests after it decode what they do alone."""
    import minigpt.serve.engine as engine_module

    calls: list[int] = []
    monkeypatch.setattr(engine_module, "static_forward", lambda device_type: step_clock.forward(0.001, calls))
    model, tokenizer = chat_model
    step_clock.uncompiled(monkeypatch, model, 0.002)
    engine = Engine(model, tokenizer, max_batch=8, compile=True)  # on a CPU: the static step, compiled
    assert engine.compile and engine.use_graphs and engine.graphs is None
    engine.start()
    engine.stop()
    timed = engine_module.TIMED_STEPS
    assert calls == [1, 2, 4, 8] + [1] * timed and sum(engine.graphs.bucket_steps.values()) == 0
    assert engine.compile and engine.use_graphs  # 1 ms a step against 2 uncompiled: kept
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    got = run_engine(engine, [Request(prompt=p, max_tokens=n, temperature=0) for p, n in zip(prompts, MAX_TOKENS)])
    assert got == [tokenizer.decode_text(alone(model, tokenizer, p, n)) for p, n in zip(prompts, MAX_TOKENS)]
    assert len(calls) == 4 + timed + engine.steps  # every step went through it; the second start warmed nothing


def test_a_compiled_step_that_measures_slower_on_a_cpu_is_dropped_with_a_note(
    monkeypatch, step_clock, base_model, capsys
):
    """As int8 weights' compiled step is on a CPU (21 against 13 to 18 ms a step for the GPT-2-124M shape, AVX512):
    the engine goes back to the default, the uncompiled step over a cache that grows."""
    import minigpt.serve.engine as engine_module

    calls: list[int] = []
    monkeypatch.setattr(engine_module, "static_forward", lambda device_type: step_clock.forward(0.003, calls))
    model, tokenizer = base_model
    step_clock.uncompiled(monkeypatch, model, 0.002)
    engine = Engine(model, tokenizer, max_batch=2, compile=True)
    engine.start()
    engine.stop()
    assert not engine.compile and not engine.use_graphs and engine.graphs is None  # the default: a growing cache
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "measured slower here (3.0 against 2.0 ms a step uncompiled)" in err
    ids = tokenizer.encode(PROMPTS[0])
    assert run_engine(engine, [Request(prompt=ids, max_tokens=9, temperature=0)]) == [
        tokenizer.decode_text(alone(model, tokenizer, ids, 9))
    ]
    assert len(calls) == 2 + engine_module.TIMED_STEPS  # none after the warm-up


def test_compile_is_the_static_step_where_a_compiler_is(monkeypatch, base_model, capsys):
    import minigpt.core.compiled as compiled
    import minigpt.serve.engine as engine_module

    model, tokenizer = base_model
    engine = Engine(model, tokenizer)  # a CPU's default: the growing cache, uncompiled
    assert not engine.compile and not engine.use_graphs
    with pytest.raises(ValueError, match="decode_graphs=False"):
        Engine(model, tokenizer, decode_graphs=False, compile=True)
    compiled.note_once.cache_clear()
    monkeypatch.setattr(engine_module, "compiler_available", lambda device_type="cpu": False)
    engine = Engine(model, tokenizer, compile=True)
    assert not engine.compile and not engine.use_graphs
    assert "C++ compiler" in capsys.readouterr().err


def test_the_app_warms_its_engine_up_before_it_answers(monkeypatch, base_model):
    """On a GPU every bucket's graph is captured (and compiled) as the server starts, not on a first request."""
    from serve_support import serving

    from minigpt.serve.app import create_app

    model, tokenizer = base_model
    app = create_app(model, tokenizer, "bench", max_batch=4, compile=False)
    engine = app.state.server.engine
    engine.use_graphs = True  # as on a GPU (its static step runs eagerly here)
    assert engine.graphs is None
    with serving(app):
        assert engine.graphs is not None and not engine.running  # made before any request


@pytest.mark.slow  # torch.compile of the static step: tens of seconds on 2 cores
def test_the_engines_step_really_compiled_gives_each_request_its_ids_alone(base_model):
    model, tokenizer = base_model
    engine = Engine(model, tokenizer, max_batch=4, decode_graphs=True, compile=True)  # buckets 4, 2, 1
    if not engine.compile:
        pytest.skip("no C++ compiler for torch.compile")
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    got = run_engine(engine, [Request(prompt=p, max_tokens=n, temperature=0) for p, n in zip(prompts, MAX_TOKENS)])
    assert got == [tokenizer.decode_text(alone(model, tokenizer, p, n)) for p, n in zip(prompts, MAX_TOKENS)]


def test_a_warm_up_that_fails_fails_start_and_leaves_no_thread(monkeypatch, step_clock, base_model):
    """A compile that breaks as the server starts: start() raises it (uvicorn's start-up fails with it), and a later
    start tries again."""
    import minigpt.serve.engine as engine_module

    def broken(model, idx, **kwargs):
        raise RuntimeError("the compiler crashed")

    monkeypatch.setattr(engine_module, "static_forward", lambda device_type: broken)
    model, tokenizer = base_model
    engine = Engine(model, tokenizer, max_batch=2, compile=True)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="the compiler crashed"):
            engine.start()
        assert not [t for t in threading.enumerate() if t.name == "minigpt-engine"]
