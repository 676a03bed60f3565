"""The data/ recipes, run on local stand-ins (never the network): they write the corpus a user then trains on."""

from __future__ import annotations

import http.server
import importlib.util
import json
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def recipe(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "data" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fineweb_recipe_streams_the_first_rows_with_text(tmp_path, capsys):
    rows = tmp_path / "stand-in.jsonl"
    rows.write_text("".join(json.dumps({"text": t, "url": "u"}) + "\n" for t in ["first", "  ", "second", "third"]))
    out = tmp_path / "corpus" / "sample.jsonl"
    recipe("fineweb_edu").main(["--docs", "2", "--dataset", "json", "--data_files", str(rows), "--out", str(out)])
    assert [json.loads(line)["text"] for line in out.read_text().splitlines()] == ["first", "second"]
    assert f"python3 train.py --data.source {out}" in capsys.readouterr().out
    assert [p.name for p in out.parent.iterdir()] == ["sample.jsonl"]  # no temporary file left


def test_the_fineweb_recipe_fails_in_one_line_offline(tmp_path, capsys, monkeypatch):
    """With no network, datasets retried for ~25 s and ended in a traceback; the hub's host is looked up first."""
    import socket
    import urllib.request

    import datasets
    from huggingface_hub import constants

    def no_dns(*a, **k):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    def no_load(*a, **k):
        pytest.fail("datasets.load_dataset was called: it retries for ~25 s when the hub cannot be reached")

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # (tests/conftest.py sets offline mode)
    monkeypatch.setattr(constants, "ENDPOINT", "https://huggingface.co")
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.setattr(urllib.request, "getproxies", dict)
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    load_dataset = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", no_load)
    out = tmp_path / "corpus" / "sample.jsonl"
    with pytest.raises(SystemExit) as e:
        recipe("fineweb_edu").main(["--docs", "2", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: cannot reach the Hugging Face Hub") and "\n" not in err
    # a stream that fails (a missing local file here, a dropped connection on the hub): one line, no file
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(SystemExit) as e:
        recipe("fineweb_edu").main(["--docs", "2", "--dataset", "json", "--data_files", "no.jsonl", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: could not read json (") and "\n" not in err
    assert not out.parent.exists() or not list(out.parent.iterdir())
    # an --out that cannot be written (under a file here): one line, not a traceback
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "first"}\n')
    with pytest.raises(SystemExit) as e:
        recipe("fineweb_edu").main(["--dataset", "json", "--data_files", str(rows), "--out", str(rows / "x.jsonl")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: cannot write ") and "is a file, not a folder" in err


def test_the_shakespeare_recipe_fetches_the_text_whole(tmp_path):
    body = ("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 200).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "data" / "tinyshakespeare.txt"
        recipe("tinyshakespeare").main(["--out", str(out), "--url", f"http://127.0.0.1:{server.server_port}/input.txt"])
    finally:
        server.shutdown()
        server.server_close()
    assert out.read_bytes() == body
    assert [p.name for p in out.parent.iterdir()] == ["tinyshakespeare.txt"]  # the download cache moved, not copied


def test_the_shakespeare_recipe_fails_in_one_line_offline(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        recipe("tinyshakespeare").main(["--out", str(tmp_path / "t.txt"), "--url", "http://127.0.0.1:9/input.txt"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: ") and "\n" not in err
    assert not (tmp_path / "t.txt").exists()


def test_the_addition_recipe_holds_out_whole_pairs_and_writes_chat_rows(tmp_path, capsys):
    addition = recipe("addition_chat")
    addition.main(["--out", str(tmp_path), "--train", "3000", "--test", "100", "--digits", "2"])
    train, test = (
        [json.loads(line) for line in (tmp_path / f"{side}.jsonl").read_text().splitlines()]
        for side in ("train", "test")
    )
    assert (len(train), len(test)) == (3000, 100)
    assert "configs/sft_addition.yaml" in capsys.readouterr().out
    # GRPO's prompt rows (configs/grpo_addition.yaml reads them; no documented step wrote them)
    from minigpt.data.prompts import read_prompts

    prompts = read_prompts(str(tmp_path / "prompts.jsonl"))
    assert len(prompts) == 3000 and prompts[0].answer == train[0]["messages"][1]["content"]

    def pair(row):
        (user, assistant) = row["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        a, b = map(int, user["content"].removeprefix("What is ").removesuffix("?").split(" + "))
        assert assistant["content"] == str(a + b) and 0 <= a < 100 and 0 <= b < 100
        return frozenset((a, b))

    seen = [pair(row) for row in train]
    assert len({row["messages"][0]["content"] for row in train}) == 3000  # no question twice
    assert not set(seen) & {pair(row) for row in test}, "a held-out pair (in either order) was trained on"
    with pytest.raises(SystemExit, match="too few distinct sums"):  # 1-digit operands: 100 questions in all
        addition.make(200, 10, digits=1, seed=0)
