"""The `minigpt serve` command: a model behind OpenAI's API, with a chat page, on 127.0.0.1:8000 by default.

    minigpt serve --ckpt out/sft                                   # http://127.0.0.1:8000/ is the chat page
    minigpt serve --ckpt hf:HuggingFaceTB/SmolLM2-135M-Instruct --port 8080 --max_batch 16
    MINIGPT_API_KEY=secret minigpt serve --ckpt out/sft --host 0.0.0.0   # clients send Authorization: Bearer secret

The server is minigpt.serve (FastAPI on uvicorn, the serve extra: pip install 'minigpt[serve]').  Every mistake
in the flags, the checkpoint or the address ends in one `error:` line and exit code 2.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from jsonargparse.typing import PositiveFloat, PositiveInt, restricted_number_type

from minigpt.cli.errors import run_cli
from minigpt.cli.parsing import (
    QUANTIZE_CHOICES,
    CommandParser,
    add_quantize_argument,
    add_source_argument,
    checkpoint_lines,
    misplaced_setting,
    show_checkpoint_lines,
)
from minigpt.core.checkpoint import find_checkpoint
from minigpt.core.config import ATTENTIONS, Attention
from minigpt.core.decode_graphs import batch_buckets
from minigpt.core.devices import resolve_device
from minigpt.core.errors import UserError, first_line
from minigpt.loading import load_chat_model

API_KEY_ENV = "MINIGPT_API_KEY"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
Port = restricted_number_type("Port", int, [(">=", 0), ("<=", 65535)])  # 0: a free port, printed at start


def build_parser() -> CommandParser:
    p = CommandParser(
        prog="serve.py",
        description="Serve a model over OpenAI's Chat Completions and "
        "Completions APIs, with continuous batching and a chat page at /.",
    )
    add_source_argument(p)
    p.add_argument(
        "--host",
        type=str,
        default="127.0.0.1",
        help="address to listen on (0.0.0.0 = every interface; give an --api_key then)",
    )
    p.add_argument("--port", type=Port, default=8000, help="port to listen on (0 = any free port)")
    p.add_argument(
        "--api_key",
        "--api-key",
        type=str | None,
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV}, else none)",
    )
    p.add_argument(
        "--model_name",
        "--model-name",
        type=str | None,
        default=None,
        help="the model's id in the API (default: the checkpoint's run or model name)",
    )
    p.add_argument(
        "--max_batch",
        "--max-batch",
        type=PositiveInt,
        default=8,
        help="requests decoded together; more wait in the queue",
    )
    p.add_argument(
        "--max_queue",
        "--max-queue",
        type=PositiveInt,
        default=64,
        help="requests that may wait for a place; past that the server answers 503",
    )
    p.add_argument(
        "--max_body_bytes",
        "--max-body-bytes",
        type=PositiveInt,
        default=1 << 20,
        help="largest request body accepted (413 past it)",
    )
    p.add_argument(
        "--request_timeout",
        "--request-timeout",
        type=PositiveFloat,
        default=30.0,
        help="seconds a client has to send a request's headers, and then its body; past that the connection "
        "is closed (408)",
    )
    p.add_argument(
        "--cors_origins",
        "--cors-origins",
        type=list[str],
        default=[],
        help="origins whose pages may call the API from a browser (default: none, same origin only)",
    )
    p.add_argument("--device", type=str, default="cpu", help="cpu, cuda, cuda:N, mps, or auto")
    p.add_argument(
        "--attention",
        type=Attention | None,
        default=None,
        help="attention implementation (default: the checkpoint's); all give the same output",
    )
    p.add_argument(
        "--compile",
        type=bool | None,
        default=None,
        nargs="?",
        const=True,  # --compile alone: true
        help="decode through torch.compile's step, compiled (on a GPU: and captured in CUDA graphs) for every "
        "batch size before the server answers: tens of seconds at start, then faster tokens; the same output. "
        "Default: on a GPU where Triton is installed (false: start at once). On a CPU it needs a C++ compiler, and "
        "is kept only where it measures faster than the uncompiled step (else a note)",
    )
    add_quantize_argument(p)
    p.add_argument(
        "--log_level",
        "--log-level",
        type=Literal["critical", "error", "warning", "info", "debug"],
        default="info",
        help="uvicorn's log level (info logs each request)",
    )
    return p


def default_name(source: str | None) -> str:
    """hf:ORG/NAME -> ORG/NAME; out/RUN/checkpoints/best.ckpt, out/RUN, None (the newest run under out/) -> RUN."""
    if source is None:  # the run loaded (it was "minigpt", where --help and serve.md say the run's name)
        source = str(find_checkpoint())
    if source.startswith("hf:"):
        return source[3:]
    path = Path(source).resolve()
    if path.suffix == ".ckpt":
        return path.parent.parent.name if path.parent.name == "checkpoints" else path.stem
    return path.name


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a taken port or an unknown host is one error line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise UserError(
            f"cannot listen on {host}:{port} ({first_line(e)}); choose another --port, or a --host this machine has"
        ) from None


def _main(argv: list[str] | None) -> None:
    parser = build_parser()
    choices = {"attention": ATTENTIONS, **QUANTIZE_CHOICES}
    if problem := misplaced_setting(sys.argv[1:] if argv is None else argv, choices):
        parser.error(problem)
    args = parser.parse_args(argv)
    try:
        from minigpt.serve.app import create_app
        from minigpt.serve.engine import in_passing
        from minigpt.serve.limits import EngineFirstServer, uvicorn_config
    except ImportError as e:
        raise UserError(
            f"minigpt serve needs the serve extra ({e.name} is missing): pip install 'minigpt[serve]'"
        ) from None
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    device = resolve_device(args.device)
    sock = listen(args.host, args.port)
    # on a thread that ends: the engine's thread is then the only one with torch's CPU worker threads (in_passing)
    load = dict(device=device, attention=args.attention, quantize=args.quantize)
    model, tokenizer = in_passing(load_chat_model, args.ckpt, **load)
    name = args.model_name or default_name(args.ckpt)
    app = create_app(
        model,
        tokenizer,
        name,
        api_key=api_key,
        cors_origins=args.cors_origins,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        compile=args.compile,
    )
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    show_checkpoint_lines()
    print(f"serving {name} at {url}/v1 (chat page: {url}/); Ctrl-C stops", file=sys.stderr, flush=True)
    if args.host not in LOCAL_HOSTS and api_key is None:
        print(
            f"warning: listening on {args.host} without an API key: anyone who reaches this port can use the "
            f"model (set --api_key or ${API_KEY_ENV})",
            file=sys.stderr,
            flush=True,
        )
    engine = app.state.server.engine
    if engine.use_graphs:  # a GPU's graphs, or a compiled step: the server answers once they are ready
        graphs = " and capturing its CUDA graphs" if engine.device.type == "cuda" else ""
        sizes = ", ".join(map(str, batch_buckets(engine.max_batch)))
        doing = f"compiling the decode step{graphs}" if engine.compile else "capturing the decode step's CUDA graphs"
        tail = " (tens of seconds; --compile false skips the compile)" if engine.compile else ""
        print(f"note: {doing} for batch sizes {sizes} before the first request is answered{tail}", file=sys.stderr)
    server = EngineFirstServer(uvicorn_config(app, log_level=args.log_level, timeout_graceful_shutdown=5))
    try:
        with sigterm_as_ctrl_c():
            server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shut down cleanly, then re-raised the signal: stopping is what it asked for
        pass
    print("stopped", file=sys.stderr)


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM ends the server as Ctrl-C does (exit 0, "stopped"): uvicorn shuts down cleanly on either, then raises
    the signal again, and SIGTERM's default action ended the process with 143."""
    if threading.current_thread() is not threading.main_thread():  # (only the main thread may set a handler)
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> None:
    with checkpoint_lines():
        run_cli(lambda: _main(argv))
