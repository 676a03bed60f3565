"""Many clients at once: continuous batching gives each streaming client exactly the text it would get alone, a
client that leaves frees its place at once, and a full queue answers 503."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import torch
from serve_support import BLOCK, serving

from minigpt import ChatSession
from minigpt.serve.app import create_app

# tiny models run faster on one torch thread; the server's event loop and the clients get the other core
pytestmark = pytest.mark.usefixtures("one_thread")

# eight clients, each with its own conversation and settings: greedy, two seeded samplers, stops, lengths
CLIENTS = [
    ("hello there", dict(temperature=0)),
    ("what is two plus two?", dict(temperature=0, max_tokens=50)),
    ("tell me a story", dict(temperature=0, max_tokens=60, stop=["xag", "HHH"])),
    ("why", dict(temperature=0)),
    ("hi", dict(temperature=0, max_tokens=20)),
    ("good morning", dict(temperature=0.8, seed=3, max_tokens=40)),
    ("the cat sat on the mat", dict(temperature=0.7, top_p=0.9, seed=11, max_tokens=60)),
    ("a b c", dict(temperature=0, max_tokens=5)),
]
LEAVER = ("hi", dict(temperature=0, max_tokens=130))  # reads three chunks, then hangs up


def alone(chat_model, text: str, settings: dict) -> str:
    """What ChatSession (one conversation, nothing else running) replies, cut at the first stop sequence."""
    model, tok = chat_model
    generator = torch.Generator().manual_seed(settings["seed"]) if "seed" in settings else None
    reply = ChatSession(
        model,
        tok,
        max_new_tokens=settings.get("max_tokens", BLOCK),
        top_k=None,
        temperature=settings["temperature"],
        top_p=settings.get("top_p"),
        generator=generator,
    ).reply(text)
    cuts = [reply.find(s) for s in settings.get("stop", []) if s in reply]
    return reply[: min(cuts)] if cuts else reply


async def stream(client: openai.AsyncOpenAI, text: str, settings: dict, leave_after: int | None = None) -> str:
    chunks = await client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": text}], stream=True, **settings
    )
    received = []
    async for chunk in chunks:
        received.append(chunk.choices[0].delta.content or "")
        if leave_after is not None and len(received) == leave_after:
            await chunks.close()  # the client hangs up mid-stream
            break
    return "".join(received)


def test_eight_concurrent_streams_get_what_each_would_get_alone(chat_model):
    expected = [alone(chat_model, text, settings) for text, settings in CLIENTS]
    assert expected[2] != alone(chat_model, "tell me a story", {"temperature": 0, "max_tokens": 60})  # a stop cuts it
    app = create_app(*chat_model, "tiny-chat", max_batch=len(CLIENTS) + 1)
    engine = app.state.server.engine

    async def clients() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        return await asyncio.gather(
            *(stream(client, text, settings) for text, settings in CLIENTS), stream(client, *LEAVER, leave_after=3)
        )

    with serving(app) as url:
        *got, left = asyncio.run(clients())
        deadline = time.monotonic() + 10
        while engine.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.stats()["running"] == 0
        steps = engine.steps
    assert got == expected
    assert 0 < len(left) < len(alone(chat_model, *LEAVER))
    # the leaver asked for 130 tokens; the others need at most 60 steps, so it was dropped when it hung up
    assert steps < 100, steps


def test_a_full_queue_answers_503_and_a_client_that_leaves_frees_its_place(base_model):
    """The engine is not started (lifespan off), so requests stay queued until the test starts it.  The server
    holds max_batch + max_queue requests: the first max_batch of a burst wait for rows that are free (they were
    answered 503 while rows sat idle)."""
    app = create_app(*base_model, "tiny-base", max_batch=1, max_queue=1)
    engine = app.state.server.engine
    body = {"model": "tiny-base", "prompt": "the", "max_tokens": 5, "temperature": 0}

    async def until(condition) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, engine.stats()
            await asyncio.sleep(0.02)

    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            first = asyncio.create_task(http.post("/v1/completions", json=body))
            second = asyncio.create_task(http.post("/v1/completions", json=body))
            await until(lambda: engine.stats()["waiting"] == 2)
            busy = await http.post("/v1/completions", json=body)
            assert busy.status_code == 503
            message = busy.json()["error"]["message"]  # the counts as they are, not the limits
            assert busy.json()["error"]["code"] == "server_busy"
            assert message == "the server is busy (0 requests decoding, 2 waiting); try again shortly"
            first.cancel()  # this client gives up while it waits
            await until(lambda: engine.stats()["waiting"] == 1)
            third = asyncio.create_task(http.post("/v1/completions", json=body))
            await until(lambda: engine.stats()["waiting"] == 2)
            engine.start()
            try:
                served = await asyncio.gather(second, third)
            finally:
                await asyncio.to_thread(engine.stop)
            assert [r.status_code for r in served] == [200, 200]
            assert all(r.json()["usage"]["completion_tokens"] == 5 for r in served)

    with serving(app, lifespan="off") as url:
        asyncio.run(scenario(url))
