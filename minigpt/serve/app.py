"""The HTTP side: OpenAI's Chat Completions and Completions over FastAPI, the chat page at `/`, and the limits.

    app = create_app(model, tokenizer, "my-model", api_key="secret")
    uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=8000)).run()   # what `minigpt serve` does

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, GET /health, GET / (the page).
Every error is OpenAI's JSON (minigpt.serve.errors): a bad request is a 400 naming the field (bodies are checked
once, by the pydantic models of minigpt.serve.protocol), a missing or wrong key 401, an unknown model or path 404, a
body over the size limit 413, a request not all sent within request_timeout 408 and the connection closed (both
minigpt.serve.limits), a full queue 503; the server keeps serving.
Decoding is minigpt.serve.engine's, in its own thread; here each request waits on an asyncio queue that the
engine's thread fills.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from minigpt.core.chat import NO_CHAT_TEMPLATE
from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.errors import UserError, first_line
from minigpt.core.generation import prompt_ids
from minigpt.core.model import GPT
from minigpt.core.tokenizer_base import Tokenizer
from minigpt.serve.engine import SHUTTING_DOWN, Engine, QueueFull, Ticket, Update
from minigpt.serve.engine import Request as Generation
from minigpt.serve.errors import APIError, unparsable_body, validation_error
from minigpt.serve.limits import BodyLimit, uvicorn_config
from minigpt.serve.protocol import ChatRequest, CompletionRequest

__all__ = ["APIError", "create_app", "uvicorn_config"]

# the page may load nothing but itself and talk to nothing but this server
PAGE_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src data:; base-uri 'none'; form-action 'none'"
)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class Server:
    """What the routes share: the model's name and limits, the engine, and the request -> Generation checks."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, name: str, engine: Engine) -> None:
        self.model, self.tokenizer, self.name, self.engine = model, tokenizer, name, engine
        self.context = model.config.block_size
        self.created = int(time.time())
        self.is_chat = isinstance(tokenizer, ChatTokenizer)

    def check_model(self, model: str) -> None:
        if model != self.name:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves '{self.name}' (GET /v1/models)",
                "model",
                "model_not_found",
            )

    def generation(
        self, body: ChatRequest | CompletionRequest, ids: list[int], limit: int | None, default: int | None = None
    ) -> Generation:
        """The engine's request: max_tokens as asked (it must fit the context), else `default` (or all the room)."""
        room = self.context - len(ids)
        if room < 1:  # the prompt alone fills the context
            param = "messages" if isinstance(body, ChatRequest) else "prompt"
            problem = (
                f"the prompt is {len(ids)} tokens, and this model's context of {self.context} tokens must also "
                "hold the reply; send a shorter prompt"
            )
        elif limit is not None and limit > room:
            param = body.limit_field()
            problem = (
                f"{param} is {limit}, but the prompt ({len(ids)} tokens) leaves room for {room} in this model's "
                f"context of {self.context}; ask for at most {room}"
            )
        else:
            problem = None
        if problem:
            raise APIError(400, problem, param, "context_length_exceeded")
        stop_tokens = self.tokenizer.stop_ids
        if limit is None:
            limit = room if default is None else min(default, room)
        settings = (body.temperature, body.top_k, body.top_p, body.seed, body.stops(), stop_tokens)
        return Generation(ids, limit, *settings, continues_prompt=isinstance(body, CompletionRequest))

    def chat_ids(self, body: ChatRequest) -> list[int]:
        """The conversation's ids, what the messages say read as text, never as the template's markers (a
        UserError, e.g. characters outside a char vocabulary: the app's 400)."""
        if not self.is_chat:
            raise APIError(
                400,
                f"the model '{self.name}' is a base model: it {NO_CHAT_TEMPLATE}; or send the text "
                "to POST /v1/completions",
                "messages",
                "model_not_chat",
            )
        return self.tokenizer.encode_prompt([m.as_template_message() for m in body.messages])  # their text is text

    def submit(self, generation: Generation, request: Request) -> AsyncIterator[Update]:
        """Queue the request now (a full queue, QueueFull, is the app's 503 before any response starts) -> its
        updates."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        ticket = self.engine.submit(generation, lambda u: loop.call_soon_threadsafe(queue.put_nowait, u))
        return self.updates(ticket, queue, request)

    @staticmethod
    async def updates(ticket: Ticket, queue: asyncio.Queue, request: Request) -> AsyncIterator[Update]:
        """The engine's updates for one request, ending with the one that has a finish_reason.  The request
        leaves the batch as soon as the client goes away: a task waits for the disconnect message alongside the
        updates (a decoding request sends one every step, so waiting for a pause in them is no way to notice)."""

        async def hang_up() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            ticket.cancel()  # read by the engine before its next step
            queue.put_nowait(None)

        watch = asyncio.create_task(hang_up())
        try:
            while True:
                update = await queue.get()
                if update is None:  # the client went away
                    return
                if update.finish_reason is not None:
                    watch.cancel()  # (before the yield: a caller may stop iterating at the last update)
                yield update
                if update.finish_reason is not None:
                    return
        finally:
            watch.cancel()
            ticket.cancel()  # nothing once it finished; a client gone mid-way frees its row before the next step


class RequireKey:
    """ASGI middleware: a /v1 request without `Authorization: Bearer KEY` (compared in constant time) is answered 401
    at once, before its body is read or checked (as a route's dependency it ran after FastAPI had parsed and
    validated the body, so a client without the key got 400s naming the fields).  The page and /health stay open."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self.allows(scope["headers"]):
            refusal = APIError(
                401, "a valid API key is required: send the header 'Authorization: Bearer KEY'", code="invalid_api_key"
            )
            return await refusal.response()(scope, receive, send)
        await self.app(scope, receive, send)

    def allows(self, headers: list[tuple[bytes, bytes]]) -> bool:
        given = next((value for name, value in headers if name == b"authorization"), b"")
        scheme, _, key = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.key)


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def create_app(
    model: GPT,
    tokenizer: Tokenizer,
    name: str,
    api_key: str | None = None,
    cors_origins: Sequence[str] = (),
    max_batch: int = 8,
    max_queue: int = 64,
    max_body_bytes: int = 1 << 20,
    request_timeout: float = 30.0,
    compile: bool | None = None,
) -> FastAPI:
    """The server's app; its engine thread starts and stops with the app (uvicorn runs the lifespan), once its
    decode step is compiled and captured (on a GPU: Engine.start).  request_timeout: seconds a request's headers
    may take to arrive, and then its body (run it with uvicorn_config's protocol for the headers' bound).
    compile: the engine's (None = on a GPU with Triton)."""
    if api_key is not None and not (api_key and api_key.isascii() and api_key.isprintable()):
        raise UserError(  # "" let a bare "Bearer" in; a header carries no other characters, so no key could match
            "the API key is empty or has characters an HTTP header cannot carry; give one of printable ASCII "
            "characters (--api_key or $MINIGPT_API_KEY), or none"
        )
    server = Server(model, tokenizer, name, Engine(model, tokenizer, max_batch, max_queue, compile=compile))
    page = (files("minigpt.serve") / "static" / "index.html").read_text(encoding="utf-8")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(server.engine.start)  # returns once its thread has compiled and captured its step
        yield
        await asyncio.to_thread(server.engine.stop)

    app = FastAPI(title="minigpt", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server, app.state.request_timeout = server, request_timeout
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout=request_timeout)
    if api_key is not None:  # outside BodyLimit: a request without the key is answered before its body is read
        app.add_middleware(RequireKey, api_key=api_key)
    if cors_origins:  # outermost: a preflight is answered here, and a 401 gets the CORS headers too
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],  # the openai JS client sends x-stainless-* headers; the origins are the guard
        )

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError) -> JSONResponse:
        return validation_error(e, request.headers.get("content-type")).response()

    @app.exception_handler(UserError)
    async def unreadable(request: Request, e: UserError) -> JSONResponse:
        """Text the model cannot read (characters outside a char vocabulary, a template that refuses the roles)."""
        param = "messages" if request.url.path.endswith("/chat/completions") else "prompt"
        return APIError(400, first_line(e, 2000), param, "invalid_value").response()

    @app.exception_handler(QueueFull)
    async def busy(request: Request, e: QueueFull) -> JSONResponse:
        return APIError(503, f"the server is busy ({e}); try again shortly", code="server_busy").response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:  # an unknown path or method
        if e.status_code == 400 and e.__cause__ is not None:  # FastAPI's parse of the body failed: say why
            return unparsable_body(e.__cause__).response()
        code = "not_found" if e.status_code == 404 else None
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code).response()

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception) -> JSONResponse:  # logged with its traceback by the server
        return APIError(500, f"internal error ({type(e).__name__}); the server's log has the details").response()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page, headers={"Content-Security-Policy": PAGE_POLICY})

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "model": name,
            "chat": server.is_chat,
            "context_length": server.context,
            "api_key_required": api_key is not None,
            **server.engine.stats(),
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str) -> dict:
        server.check_model(model_id)
        return model_card()

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": server.created, "owned_by": "minigpt"}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        server.check_model(body.model)
        ids = server.chat_ids(body)
        generation = server.generation(body, ids, body.token_limit())
        updates = server.submit(generation, request)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return streamed(
                updates,
                head | {"object": "chat.completion.chunk"},
                len(ids),
                include_usage,
                lambda text: {"delta": {"content": text}},
                {"delta": {"role": "assistant", "content": ""}},
            )
        text, last = await collected(updates)
        return head | {
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": None,
                    "finish_reason": last.finish_reason,
                }
            ],
            "usage": usage(len(ids), last.completion_tokens),
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server.check_model(body.model)
        ids = prompt_ids(tokenizer, body.prompt)
        generation = server.generation(body, ids, body.max_tokens, default=16)  # OpenAI's default for completions
        updates = server.submit(generation, request)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": name,
            "object": "text_completion",
        }
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return streamed(updates, head, len(ids), include_usage, lambda text: {"text": text, "logprobs": None})
        text, last = await collected(updates)
        return head | {
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}],
            "usage": usage(len(ids), last.completion_tokens),
        }

    return app


async def collected(updates: AsyncIterator[Update]) -> tuple[str, Update]:
    parts, update = [], None
    async for update in updates:
        parts.append(update.text)
    if update is None or update.finish_reason is None:  # nobody is listening any more
        raise APIError(499, "the client closed the request", code="client_closed_request")
    if update.finish_reason == "error" and update.error == SHUTTING_DOWN:
        raise APIError(503, SHUTTING_DOWN, code="server_shutting_down")
    if update.finish_reason == "error":
        raise APIError(500, update.error or "decoding failed", code="decoding_failed")
    return "".join(parts), update


def streamed(
    updates: AsyncIterator[Update],
    head: dict,
    prompt_tokens: int,
    include_usage: bool,
    choice,
    first: dict | None = None,
) -> StreamingResponse:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
    extra = {"usage": None} if include_usage else {}

    def chunk(fields: dict, finish_reason: str | None = None) -> str:
        return sse(head | {"choices": [{"index": 0, **fields, "finish_reason": finish_reason}]} | extra)

    async def events() -> AsyncIterator[str]:
        if first is not None:
            yield chunk(first)
        async for update in updates:
            if update.finish_reason == "error":
                yield sse(
                    {
                        "error": {
                            "message": update.error,
                            "type": "server_error",
                            "param": None,
                            "code": "server_shutting_down" if update.error == SHUTTING_DOWN else "decoding_failed",
                        }
                    }
                )
                return
            if update.text:
                yield chunk(choice(update.text))
            if update.finish_reason is not None:
                yield chunk(choice("") if first is None else {"delta": {}}, update.finish_reason)
                if include_usage:
                    yield sse(head | {"choices": [], "usage": usage(prompt_tokens, update.completion_tokens)})
        yield sse("[DONE]")

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
