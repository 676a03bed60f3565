"""hf:ORG/NAME (minigpt.hf.hub): a model loads from a pre-filled cache offline, a download fetches one weight format,
and a hub that is offline, stalls or lies is one line in bounded time.  Offline: the models are built here."""

import contextlib
import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from minigpt.core.errors import CheckpointError
from minigpt.hf.chat_files import read_chat_template
from minigpt.loading import load_model

REPO = Path(__file__).resolve().parents[2]  # the repository root
transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("minigpt.hf.load")
from hf_models import hf_logits, ids, our_logits


def fill_hub_cache(cache, repo_id, model_dir, commit="0123456789abcdef0123456789abcdef01234567"):
    """The layout huggingface_hub's cache has after `hf download REPO_ID`: refs/main -> snapshots/COMMIT/files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


def test_hub_ids_load_from_the_cache_offline(saved, hub_cache):
    hf_model, path = saved["llama-gqa-tied"]
    fill_hub_cache(hub_cache, "someorg/tiny-llama", path)
    model, tokenizer = load_model("hf:someorg/tiny-llama")
    idx = ids()
    assert (our_logits(model, idx) - hf_logits(hf_model, idx)).abs().max() < 1e-4
    assert tokenizer.name == "someorg/tiny-llama"


def test_hub_downloads_fetch_one_weight_format(saved, tmp_path, monkeypatch):
    """A patched snapshot_download stands in for the hub: safetensors are asked for first, and PyTorch weights only
    when the repository has no safetensors (never both: they are the same weights twice)."""
    import fnmatch

    import huggingface_hub

    repo = tmp_path / "repo"
    hf_model, path = saved["gpt2"]
    shutil.copytree(path, repo)
    (repo / "model.safetensors").unlink()
    torch.save(hf_model.state_dict(), repo / "pytorch_model.bin")
    (repo / "flax_model.msgpack").write_text("not wanted")
    (repo / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    calls = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, local_files_only=False, **kwargs):
        if local_files_only:  # the cache is looked at first: empty here
            raise huggingface_hub.errors.LocalEntryNotFoundError("not in the cache")
        calls.append((repo_id, revision, allow_patterns))
        out = tmp_path / "snapshot"
        out.mkdir(exist_ok=True)
        for f in repo.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, out / f.name)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model, _ = load_model("hf:someorg/old-gpt2@v1.0")
    assert [(c[0], c[1]) for c in calls] == [("someorg/old-gpt2", "v1.0")] * 2
    assert "model.safetensors" in calls[0][2] and "pytorch_model.bin" not in calls[0][2]
    assert "pytorch_model.bin" in calls[1][2] and "model.safetensors" not in calls[1][2]
    assert {f.name for f in (tmp_path / "snapshot").iterdir()} == {
        "config.json",
        "generation_config.json",
        "pytorch_model.bin",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    }
    assert read_chat_template(tmp_path / "snapshot") == (repo / "chat_template.jinja").read_text()
    idx = ids()
    assert (our_logits(model, idx) - hf_logits(hf_model, idx)).abs().max() < 1e-4


def test_hub_id_offline_and_not_cached_is_one_line(hub_cache):
    with pytest.raises(CheckpointError) as e:
        load_model("hf:someorg/absent-model")
    message = str(e.value)
    assert "\n" not in message and message.startswith("hf:someorg/absent-model is not in the Hugging Face cache")
    assert f"HF_HOME={hub_cache.parent}" in message and "`hf download someorg/absent-model`" in message
    with pytest.raises(CheckpointError, match=r"is not a hub model id; write hf:ORG/NAME"):
        load_model("hf:not a/valid//id")


def test_sample_cli_offline_hub_id_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("HF_HUB_CACHE", None)
    result = subprocess.run(
        [sys.executable, str(REPO / "sample.py"), "--ckpt", "hf:someorg/absent-model", "--max_new_tokens", "5"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("error: hf:someorg/absent-model is not in the Hugging Face cache (HF_HOME=")


@contextlib.contextmanager
def misbehaving_hub(mode: str):
    """A hub endpoint on 127.0.0.1 that accepts and never answers ("stall"), answers a captive portal's HTML
    ("html") or an empty JSON object ("json"); yields its URL."""
    stop = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if mode == "stall":
                stop.wait(60)
                return
            body = b"<html>sign in to the wifi</html>" if mode == "html" else b"{}"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


HUB_SAMPLE = (
    "from minigpt.cli.sample import main\n"
    "main(['--ckpt', 'hf:someorg/tiny-llama', '--max_new_tokens', '3', '--prompt', 'ab'])"
)


@pytest.mark.parametrize(
    "mode,fragments",
    [
        ("stall", ["is not in the Hugging Face cache", "did not answer in 2 s", "HF_ENDPOINT", "`hf download"]),
        ("html", ["is not the hub's (JSONDecodeError", "captive portal", "HF_ENDPOINT", "HF_HUB_OFFLINE=1"]),
        ("json", ["is not the hub's (KeyError", "HF_ENDPOINT", "`hf download someorg/tiny-llama`"]),
    ],
)
def test_a_hub_that_stalls_or_lies_is_one_line_in_bounded_time(tmp_path, mode, fragments):
    with misbehaving_hub(mode) as endpoint:
        env = {
            **os.environ,
            "HF_HOME": str(tmp_path / "hf_home"),
            "HF_ENDPOINT": endpoint,
            "PYTHONPATH": str(REPO),
            "HF_HUB_ETAG_TIMEOUT": "2",
        }  # huggingface_hub's setting for a slow network: minigpt's bound too
        env.pop("HF_HUB_OFFLINE", None)
        env.pop("HF_HUB_CACHE", None)
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-c", HUB_SAMPLE], capture_output=True, text=True, env=env, timeout=120
        )
    assert time.perf_counter() - start < 40
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)


def test_a_model_complete_in_the_cache_never_waits_on_the_hub(saved, tmp_path):
    """Online (no HF_HUB_OFFLINE) but with the model whole in the cache, a stalled hub costs nothing."""
    fill_hub_cache(tmp_path / "hf_home" / "hub", "someorg/tiny-llama", saved["llama-gqa-tied"][1])
    with misbehaving_hub("stall") as endpoint:
        env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_ENDPOINT": endpoint, "PYTHONPATH": str(REPO)}
        env.pop("HF_HUB_OFFLINE", None)
        env.pop("HF_HUB_CACHE", None)
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-c", HUB_SAMPLE.replace("'ab'", "'x'")],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    assert result.returncode == 0, result.stderr
    assert time.perf_counter() - start < 30
