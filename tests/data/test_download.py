"""A URL source is downloaded whole or refused, never hangs and never caches a wrong corpus (minigpt.data.download;
issue 30).  A body whose completeness the HTTP framing cannot prove (HTTP/1.0, closed without a Content-Length), a
chunked body cut short, content encodings (gzip decoded exactly; others refused) and a server that trickles are
served by a misbehaving server on 127.0.0.1 (local special files: tests/data/test_sources.py).
"""

from __future__ import annotations

import gzip
import http.server
import os
import threading
import time
from pathlib import Path

import pytest

import minigpt.data.download as download_mod
import minigpt.data.sources as sources_mod
from minigpt.core.errors import DataError
from minigpt.data.prepare import load_prepared, prepare_data
from support import deadline

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(300))
GZ = gzip.compress(TEXT.encode())


# ------------------------------------------------------------------------------------------ a misbehaving server


def reply(*headers: str, body: bytes = b"", status: str = "HTTP/1.1 200 OK"):
    """A response written byte for byte (status line and headers as given), then the connection closes."""
    head = "\r\n".join([status, "Content-Type: text/plain", *headers]) + "\r\n\r\n"
    return lambda wfile: wfile.write(head.encode() + body)


def chunked(*parts: bytes, last: bool = True) -> bytes:
    """Chunked transfer coding; last=False: the connection closes before the final zero-size chunk."""
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + (b"0\r\n\r\n" if last else b"")


def trickle(wfile, size: int = 1000, every_s: float = 0.05) -> None:
    """A Content-Length promised, then one byte every `every_s` seconds: no single read ever times out."""
    wfile.write(f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {size}\r\n\r\n".encode())
    for i in range(size):
        wfile.write(b"abcdefghij\n"[i % 11 : i % 11 + 1])
        time.sleep(every_s)


class _Misbehaving(http.server.BaseHTTPRequestHandler):
    routes: dict = {}  # path -> function writing the whole response to wfile

    def do_GET(self):
        try:
            self.routes[self.path](self.wfile)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up, as it should

    def log_message(self, *a):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Misbehaving)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def nothing_kept(root: Path) -> bool:
    """No download (not even a temporary file) and no prepared data."""
    return sorted(os.listdir(root)) == ["downloads"] and os.listdir(root / "downloads") == []


_Misbehaving.routes = {
    # HTTP/1.0: the body ends when the connection closes, so a cut cannot be told from an end
    "/close.txt": reply(body=TEXT.encode()[:1000], status="HTTP/1.0 200 OK"),
    "/close-whole.txt": reply(body=TEXT.encode(), status="HTTP/1.0 200 OK"),
    "/chunked-cut.txt": reply("Transfer-Encoding: chunked", body=chunked(TEXT.encode()[:1000], last=False)),
    "/chunked-torn.txt": reply("Transfer-Encoding: chunked", body=b"%x\r\n" % len(TEXT) + TEXT.encode()[:1000]),
    "/gzip-cut.txt": reply("Content-Encoding: gzip", f"Content-Length: {len(GZ)}", body=GZ[: len(GZ) // 2]),
    "/not-gzip.txt": reply("Content-Encoding: gzip", f"Content-Length: {len(TEXT)}", body=TEXT.encode()),
    "/gzip-no-length.txt": reply("Content-Encoding: gzip", body=GZ, status="HTTP/1.0 200 OK"),
    "/br.txt": reply("Content-Encoding: br", "Content-Length: 5", body=b"\x0b\x02\x80hi"),
    "/deflate.txt": reply("Content-Encoding: deflate", "Content-Length: 4", body=b"x\x9c\x03\x00"),
    "/packed.txt.gz": reply("Content-Encoding: gzip", f"Content-Length: {len(GZ)}", body=GZ),
    "/trickle.txt": trickle,
    # what a whole body looks like, however it is framed or encoded
    "/gzip.txt": reply("Content-Encoding: gzip", f"Content-Length: {len(GZ)}", body=GZ),
    "/x-gzip-chunked.txt": reply(
        "Transfer-Encoding: chunked", "Content-Encoding: x-gzip", body=chunked(GZ[:100], GZ[100:])
    ),
    "/chunked.txt": reply(
        "Transfer-Encoding: chunked", body=chunked(*[line.encode() for line in TEXT.splitlines(keepends=True)])
    ),
}


@pytest.mark.parametrize(
    "path, needle",
    [
        (
            "/close.txt",
            "sent with neither a Content-Length nor chunked encoding, so a download cut short could not be "
            "told from a whole one; download it yourself (e.g. with curl), check that it is whole",
        ),
        ("/close-whole.txt", "neither a Content-Length nor chunked encoding"),  # whole, but nothing proves it
        ("/gzip-no-length.txt", "neither a Content-Length nor chunked encoding"),
        (
            "/chunked-cut.txt",
            "is incomplete: the connection closed before its last chunk; try again, or download it yourself",
        ),
        ("/chunked-torn.txt", "is incomplete: the connection closed before its last chunk"),
        ("/gzip-cut.txt", f"is incomplete: {len(GZ) // 2:,} of its {len(GZ):,} bytes arrived"),
        ("/not-gzip.txt", "gzip-encoded download of"),
        ("/br.txt", "Content-Encoding 'br', which minigpt does not decode (only gzip); download it yourself"),
        ("/deflate.txt", "Content-Encoding 'deflate', which minigpt does not decode"),
        ("/packed.txt.gz", "is a .gz file sent with Content-Encoding gzip"),
    ],
)
def test_a_download_not_proven_whole_and_plain_is_refused_and_not_kept(tmp_path, server, path, needle):
    root = tmp_path / "data"
    with deadline(30), pytest.raises(DataError) as e:
        prepare_data(server + path, "char", data_root=root)
    message = str(e.value)
    assert needle in message and server + path in message and "\n" not in message
    assert nothing_kept(root)


@pytest.mark.parametrize("path", ["/gzip.txt", "/x-gzip-chunked.txt", "/chunked.txt"])
def test_a_whole_download_is_kept_as_its_text(tmp_path, server, path):
    root = tmp_path / "data"
    with deadline(30):
        d = prepare_data(server + path, "char", data_root=root)
    assert load_prepared(d).meta["num_chars"] == len(TEXT)
    [cached] = (root / "downloads").iterdir()
    assert cached.read_bytes() == TEXT.encode()  # decoded: never the compressed bytes


def test_a_trickling_server_is_given_up_on_in_bounded_time(tmp_path, server, monkeypatch):
    root = tmp_path / "data"
    monkeypatch.setattr(download_mod, "DOWNLOAD_RATE_WINDOW_S", 0.5)  # (60 s by default)
    t0 = time.monotonic()
    with (
        deadline(30),
        pytest.raises(
            DataError,
            match=r"is too slow: \d+ bytes in the last \d+ s, under the minimum "
            r"of 16 KiB/s; try again later, or download it yourself",
        ),
    ):
        prepare_data(server + "/trickle.txt", "char", data_root=root)
    assert time.monotonic() - t0 < 5  # the 1,000 bytes would take 50 s
    assert nothing_kept(root)

    # the bound is a rate, not a deadline: as slow a server, above the minimum, is waited for
    monkeypatch.setattr(download_mod, "DOWNLOAD_MIN_RATE", 10)  # bytes/s; the server sends ~20
    _Misbehaving.routes["/trickle-short.txt"] = lambda wfile: trickle(wfile, size=40)
    with deadline(30):
        cached = sources_mod.download(server + "/trickle-short.txt", root / "downloads")
    assert cached.read_bytes() == (b"abcdefghij\n" * 4)[:40]
