"""What bounds a request before the routes see it: the size of its body, and the time to receive it (its headers,
then its body), so that a client cannot exhaust the server's memory or its file descriptors.

    uvicorn.Server(uvicorn_config(create_app(...), host="127.0.0.1", port=8000)).run()

BodyLimit is ASGI middleware (create_app adds it); RequestDeadline is uvicorn's HTTP/1.1 protocol with a timer,
since uvicorn bounds neither (its keep-alive timeout runs only between requests); uvicorn_config sets it up.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from minigpt.serve.engine import SHUTTING_DOWN
from minigpt.serve.errors import APIError

__all__ = ["BodyLimit", "EngineFirstServer", "RequestDeadline", "uvicorn_config"]


class BodyLimit:
    """ASGI middleware: a request body over max_bytes is refused with 413 before any of it is parsed, and one that has
    not all arrived `timeout` seconds after the headers with 408 (and the connection closed), so a client that sends
    less than its Content-Length cannot hold a connection open."""

    def __init__(self, app, max_bytes: int, timeout: float) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_large = APIError(
            413,
            f"the request body is over {self.max_bytes:,} bytes; send a shorter one (minigpt serve --max_body_bytes)",
            code="request_too_large",
        ).response()
        too_slow = APIError(
            408,
            f"the request body did not all arrive within {self.timeout:g} s of its headers (a Content-Length larger "
            "than the body?); send the whole request at once (minigpt serve --request_timeout)",
            code="request_timeout",
        ).response()
        too_slow.headers["Connection"] = "close"  # what is still to come of this body is not read
        deadline = asyncio.get_running_loop().time() + self.timeout
        body = bytearray()
        while True:  # read it whole (bounded in size and time), then hand it on
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:  # wait_for's (asyncio.TimeoutError is this builtin from Python 3.11 on)
                return await too_slow(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await too_large(scope, receive, send)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


class RequestDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol (h11) with a deadline on a request's headers, which uvicorn does not bound: they
    must all arrive within `request_timeout` seconds of the connection opening (or of the previous response), else
    the connection is closed, with a 408 when part of a request came.  So sockets that send nothing, or headers a byte
    at a time, cannot pile up and exhaust the server's file descriptors.  The body's deadline is BodyLimit's; a
    response sent before its body arrived (a 413, a 404) gives the rest of the body the same time."""

    request_timeout = 30.0  # uvicorn_config sets the app's

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.deadline: asyncio.TimerHandle | None = None
        self.arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.arm()  # the next request's clock starts

    def connection_lost(self, exc: Exception | None) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        super().connection_lost(exc)

    def arm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = (
            None if self.transport.is_closing() else self.loop.call_later(self.request_timeout, self.expired)
        )

    def expired(self) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:  # the headers have not all arrived (or nothing has)
            if self.conn.trailing_data[0]:  # part of a request: say why it ends
                self.transport.write(headers_timeout(self.request_timeout))
            self.transport.close()
        elif self.conn.their_state is h11.SEND_BODY and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()  # answered already; the rest of its body never came

    def shutdown(self) -> None:
        """Ctrl-C, SIGTERM: a request whose body is still arriving is answered 503 at once and its connection closed
        (the app then reads a disconnect).  uvicorn waited timeout_graceful_shutdown for the body, then cancelled the
        request: a plain-text 500, and a CancelledError's traceback in the server's log."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and self.conn.their_state is h11.SEND_BODY:
            self.transport.write(raw_response(APIError(503, SHUTTING_DOWN, code="server_shutting_down")))
            self.transport.close()
            return
        super().shutdown()


def headers_timeout(seconds: float) -> bytes:
    """A 408 with OpenAI's error JSON, written to the socket as it is (no request was parsed to answer)."""
    error = APIError(
        408,
        f"the request's headers did not all arrive within {seconds:g} s; send the whole request at once "
        "(minigpt serve --request_timeout)",
        code="request_timeout",
    )
    return raw_response(error)


def raw_response(error: APIError) -> bytes:
    """The error's response as bytes to write to the socket (no ASGI cycle to send it through), closing it."""
    body = error.response().body
    reason = HTTPStatus(error.status).phrase
    head = f"HTTP/1.1 {error.status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return (head + "connection: close\r\n\r\n").encode() + body


class EngineFirstServer(uvicorn.Server):
    """uvicorn's server for an app of create_app, whose shutdown (Ctrl-C, SIGTERM) stops the app's engine first: every
    request in flight then ends at once with OpenAI's error JSON ("the server is shutting down"; a stream with its
    error event).  uvicorn's own order waits timeout_graceful_shutdown for the connections, then cancels the
    requests mid-response (a plain-text 500, a stream cut without an end) and only then runs the app's shutdown."""

    async def shutdown(self, sockets=None) -> None:
        for listener in self.servers:
            listener.close()  # no new connections while the engine stops (uvicorn closes them too, later)
        await asyncio.to_thread(self.config.app.state.server.engine.stop)
        await super().shutdown(sockets)
        if self.force_exit:  # a second Ctrl-C skips the app's shutdown, whose task, cancelled at exit, logs a traceback
            await self.lifespan.shutdown()  # quick: the engine has stopped


def uvicorn_config(app: FastAPI, **settings) -> uvicorn.Config:
    """uvicorn's Config for an app of create_app (what `minigpt serve` and the tests run): HTTP/1.1 by h11 with the
    app's deadline on a request's headers (RequestDeadline).  settings: uvicorn.Config's (log_level, ...)."""
    protocol = type("RequestDeadline", (RequestDeadline,), {"request_timeout": app.state.request_timeout})
    return uvicorn.Config(app, http=protocol, **settings)
