"""What the serve tests share (importable as `serve_support`; pytest puts tests/serve on sys.path): the tiny
models' shape, the reference outputs of generate(), and a server on 127.0.0.1 (uvicorn in a thread, on a free port)
that is stopped when the test ends."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import torch

from minigpt import GPT
from minigpt.core.generation import generate
from minigpt.serve.limits import EngineFirstServer, uvicorn_config

# "Z" is left out on purpose: a message with it must be refused
CHARS = "\n !',.:;?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXY"
BLOCK = 160


def alone(
    model: GPT, tokenizer, ids: list[int], max_tokens: int, stop_token: int | None = None, **sampling
) -> list[int]:
    """The tokens generate() gives for this prompt alone (greedy unless told), the stop token included."""
    out = generate(
        model,
        torch.tensor([ids]),
        max_tokens,
        stop_token=stop_token,
        vocab_size=tokenizer.vocab_size,
        **({"temperature": 0} | sampling),
    )
    return out[0, len(ids) :].tolist()


def free_port() -> int:
    """A 127.0.0.1 port free now (for a server stopped and started again on one port)."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


@contextmanager
def serving(app, port: int = 0, **config):
    """The app on uvicorn in a thread, on 127.0.0.1 (a free port unless told) -> its base URL; stopped on exit."""
    sock = socket.create_server(("127.0.0.1", port))
    server = EngineFirstServer(uvicorn_config(app, log_level="warning", **config))  # as `minigpt serve` runs it
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
