"""`minigpt serve` (minigpt.cli.serve) end to end: a checkpoint served by the command until Ctrl-C, and its mistakes
as one `error:` line with exit code 2.  The server itself is tested in tests/serve/."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from minigpt import ChatSession
from minigpt.cli.serve import default_name, main
from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.tokenizers import CharTokenizer
from support import varied_gpt


@pytest.fixture(scope="module")
def chat_model():
    tokenizer = ChatTokenizer.for_base(CharTokenizer("\n !',.:;?abcdefghijklmnopqrstuvwxyz"))
    return varied_gpt("llama", n_kv_head=2, vocab_size=tokenizer.vocab_size, block_size=96), tokenizer


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory, chat_model):
    path = tmp_path_factory.mktemp("out") / "sft" / "checkpoints" / "best.ckpt"
    path.parent.mkdir(parents=True)
    save_file(model_checkpoint(*chat_model), path)
    return path


@contextlib.contextmanager
def serve_command(ckpt, *flags: str, env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen, str, str]]:
    """`minigpt serve` on a free port -> (its process, its "serving ..." line, its URL), once it serves; killed at
    the end if it still runs, and by a watchdog if it never starts or hangs (a server must not hang the suite)."""
    command = [sys.executable, "-m", "minigpt.cli.main", "serve", "--ckpt", str(ckpt), "--port", "0", *flags]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    watchdog = threading.Timer(120, process.kill)
    watchdog.start()
    try:
        before = []
        while not (line := process.stderr.readline()).startswith("serving "):
            assert line, f"minigpt serve ended before serving: {''.join(before)}"
            before.append(line)
        yield process, line, re.search(r"at (\S+)/v1", line).group(1)
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()


def test_minigpt_serve_answers_with_the_checkpoints_replies_until_interrupted(chat_ckpt, chat_model):
    env = os.environ | {"MINIGPT_API_KEY": "sesame"}
    with serve_command(chat_ckpt, "--log_level", "warning", env=env) as (process, line, url):
        assert line.startswith("serving sft at http://127.0.0.1:"), line
        with pytest.raises(openai.AuthenticationError):  # the key from the environment is required
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model="sft", messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=12
        )
        expected = ChatSession(*chat_model, max_new_tokens=12, temperature=0, top_k=None).reply("hi")
        assert reply.choices[0].message.content == expected
        process.send_signal(signal.SIGINT)  # Ctrl-C: uvicorn shuts down cleanly
        assert process.wait(timeout=30) == 0


def test_a_second_ctrl_c_while_the_server_stops_ends_it_without_a_traceback(chat_ckpt):
    # the second Ctrl-C makes uvicorn skip the app's shutdown; its task, cancelled at exit, logged a traceback
    with serve_command(chat_ckpt) as (process, _, url):
        assert httpx.get(f"{url}/health").status_code == 200
        process.send_signal(signal.SIGINT)
        time.sleep(0.05)  # the first one seen: two at once would be one
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        err = process.stderr.read()
        assert err.rstrip().endswith("stopped") and "Traceback" not in err, err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_ends_the_requests_in_flight_with_openais_error_and_exits_0(tmp_path, sig):
    """Ctrl-C or SIGTERM while requests decode: each ends at once with the engine's error (a stream's error event,
    a 503 JSON), not uvicorn's plain-text 500 and a stream cut off 5 s later; SIGTERM ended the process with 143."""
    tokenizer = CharTokenizer("\n abcdefghij")
    path = tmp_path / "long" / "checkpoints" / "best.ckpt"
    path.parent.mkdir(parents=True)
    save_file(model_checkpoint(varied_gpt("llama", vocab_size=tokenizer.vocab_size, block_size=8192), tokenizer), path)
    with serve_command(path, "--log_level", "warning") as (process, _, url):
        body = {"model": "long", "prompt": "abc", "max_tokens": 8000, "temperature": 0}
        whole = {}
        waiting = threading.Thread(target=lambda: whole.update(r=httpx.post(f"{url}/v1/completions", json=body)))
        with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60) as stream:
            events = stream.iter_lines()
            assert next(events).startswith("data: {")  # decoding (8000 tokens: seconds, not milliseconds)
            waiting.start()
            while httpx.get(f"{url}/health").json()["running"] < 2:  # both decoding
                time.sleep(0.01)
            process.send_signal(sig)
            last = [line for line in events if line.startswith("data: ")][-1]
        assert json.loads(last[6:])["error"] == {
            "message": "the server is shutting down",
            "type": "server_error",
            "param": None,
            "code": "server_shutting_down",  # as the 503's (it was "decoding_failed")
        }
        waiting.join()
        assert whole["r"].status_code == 503, whole["r"].text
        assert whole["r"].json()["error"]["code"] == "server_shutting_down"
        assert process.wait(timeout=30) == 0
        err = process.stderr.read()
        assert err.rstrip().endswith("stopped") and "Traceback" not in err, err


def test_a_stop_answers_a_request_whose_body_is_still_arriving_503_at_once(chat_ckpt):
    """Ctrl-C while a client sends its body: uvicorn waited 5 s for it, then cancelled the request, which answered a
    plain-text 500 and logged a CancelledError's traceback."""
    with serve_command(chat_ckpt, "--log_level", "warning") as (process, _, url):
        with socket.create_connection((httpx.URL(url).host, httpx.URL(url).port)) as sock:
            head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(f'{head}Content-Length: 100\r\n\r\n{{"model"'.encode())  # 8 bytes of 100
            time.sleep(0.5)  # its headers read, its body awaited
            process.send_signal(signal.SIGINT)
            sock.settimeout(30)
            started = time.monotonic()
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
            assert time.monotonic() - started < 3  # at once, not after uvicorn's 5 s
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), answer
        assert json.loads(body)["error"]["code"] == "server_shutting_down", answer
        assert process.wait(timeout=30) == 0
        err = process.stderr.read()
        assert err.rstrip().endswith("stopped") and "Traceback" not in err, err


@pytest.mark.parametrize("flag, compiled", [([], False), (["--compile"], True), (["--compile", "false"], False)])
def test_compile_reaches_the_engine_and_says_the_server_compiles_before_it_answers(
    monkeypatch, capsys, chat_ckpt, flag, compiled
):
    import uvicorn

    import minigpt.serve.engine as engine_module

    monkeypatch.setattr(engine_module, "compiler_available", lambda device_type="cpu": True)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets: None)  # no serving: the set-up only
    main(["--ckpt", str(chat_ckpt), "--port", "0", "--max_batch", "4", *flag])
    err = capsys.readouterr().err
    note = "note: compiling the decode step for batch sizes 1, 2, 4 before the first request is answered"
    assert (note in err) == compiled, err
    assert "serving sft at" in err


def one_error_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_mistakes_are_one_error_line(capsys, chat_ckpt, tmp_path):
    assert "port" in one_error_line(capsys, ["--port", "70000"])
    assert "max_batch" in one_error_line(capsys, ["--max_batch", "0"])
    for timeout in ("0", "-1", "nan", "soon"):
        assert "request_timeout" in one_error_line(capsys, ["--request_timeout", timeout])
    assert "attention" in one_error_line(capsys, ["--attention", "flash"])
    assert "compile" in one_error_line(capsys, ["--compile", "maybe"])
    assert "checkpoint not found" in one_error_line(capsys, ["--ckpt", str(tmp_path / "none.ckpt"), "--port", "0"])
    line = one_error_line(capsys, ["--ckpt", str(chat_ckpt), "--port", "0", "--api_key", ""])
    assert line.startswith("error: the API key is empty"), line
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        line = one_error_line(capsys, ["--ckpt", str(chat_ckpt), "--port", port])
        assert f"cannot listen on 127.0.0.1:{port}" in line and "--port" in line


def test_the_models_default_name(tmp_path, monkeypatch):
    assert default_name("out/sft/checkpoints/best.ckpt") == "sft"
    assert default_name("out/sft") == "sft"
    assert default_name("hf:HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    monkeypatch.chdir(tmp_path)  # no --ckpt: the newest run under out/, the one loaded (it was "minigpt")
    for run, mtime in [("older", 1_000_000), ("newest", 2_000_000)]:
        (ckpt := tmp_path / "out" / run / "checkpoints" / "last.ckpt").parent.mkdir(parents=True)
        ckpt.touch()
        os.utime(ckpt, (mtime, mtime))
    assert default_name(None) == "newest"
