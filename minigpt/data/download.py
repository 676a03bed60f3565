"""URL sources: a file fetched over HTTP(S) and kept only when it is provably whole and the file's own bytes.

    fetch("https://host/corpus.txt", dest, timeout=30, max_bytes=2 << 30, write_fix="free space there")
    # DataError when refused (one line), and nothing at dest

The body goes to a temporary file renamed into place when complete, so a failed or killed download is never
mistaken for one. Complete means proven whole by the HTTP framing: all of its Content-Length, or a chunked body up
to its last chunk; a body that only ends when the connection closes (HTTP/1.0 style) looks the same cut short, so
it is refused: what cannot be checked exactly is not guessed. A gzip-encoded body is stored decoded (its CRC
checked); other encodings, an HTML page where data was expected and a server that trickles are refused. Every
refusal is one line naming the way around it: download the file yourself (e.g. with curl) and pass its path.
"""

from __future__ import annotations

import gzip
import http.client
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from typing import Any

from minigpt.core.errors import DataError, UserError, first_line
from minigpt.core.fsutil import atomic_write, write_error

DOWNLOAD_TIMEOUT_S = 30.0  # for connecting and for each read from the server
DOWNLOAD_LIMIT_BYTES = 2 << 30
# A server that trickles (a byte every 20 s never trips the per-read timeout) is given up on: every
# DOWNLOAD_RATE_WINDOW_S of the body must bring at least DOWNLOAD_MIN_RATE bytes per second (~130 kbit/s).
DOWNLOAD_RATE_WINDOW_S = 60.0
DOWNLOAD_MIN_RATE = 16 << 10
READ_BYTES = 1 << 20  # written this much at a time
# an HTML page where data was expected: a sign-in wall, an error page, a "download" page around the file
HTML_TYPES = ("text/html", "application/xhtml+xml")
HTML_STARTS = (b"<!doctype html", b"<html", b"<head")
YOURSELF = "download it yourself (e.g. with curl) and pass the file path"  # the way around every refusal


def fetch(url: str, dest: Path, timeout: float, max_bytes: int, write_fix: str) -> None:
    """Download url into dest (see the module docstring), or raise DataError and leave nothing; write_fix is the fix
    named when dest's folder cannot take the file (full, read-only)."""
    too_big = f"{url} is over the {max_bytes / 2**30:.1f} GiB download limit; {YOURSELF}"

    def html_page(why: str) -> str:
        return (
            f"{url} returned an HTML page ({why}), not a data file: a sign-in, error or download page?; pass "
            f"the direct link to the raw file, or {YOURSELF}"
        )

    def copy(body: _Body, f: Any, gzipped: bool) -> None:
        stream = gzip.GzipFile(fileobj=body, mode="rb") if gzipped else body
        written = 0
        while chunk := stream.read(READ_BYTES):  # (the gzip decoder's errors are named in _refusal)
            if written == 0 and chunk.lstrip()[:64].lower().startswith(HTML_STARTS):
                raise DataError(html_page("its content starts like HTML"))
            written += len(chunk)
            if written > max_bytes:  # (of the decoded data: a gzip bomb stops here too)
                raise DataError(too_big)
            f.write(chunk)

    try:
        # identity: the file's own bytes are asked for; a server that gzips them anyway is decoded in copy()
        request = urllib.request.Request(url, headers={"User-Agent": "minigpt", "Accept-Encoding": "identity"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            length = response.headers.get("Content-Length", "").strip()
            length = int(length) if length.isascii() and length.isdigit() else None  # not "²"
            content_type = response.headers.get_content_type()  # lowercased, without parameters
            encoding = response.headers.get("Content-Encoding", "").strip().lower() or "identity"
            # the headers' rules, checked before any of the body is read: (refused when, the message)
            rules = [
                (length is not None and length > max_bytes, too_big),
                (content_type in HTML_TYPES, html_page(f"Content-Type {content_type}")),
                (
                    encoding not in ("identity", "gzip", "x-gzip"),
                    f"{url} was sent with Content-Encoding {encoding!r}, which minigpt does not decode (only gzip); "
                    f"{YOURSELF}",
                ),
                (
                    encoding != "identity" and dest.suffix == ".gz",  # (Apache's AddEncoding labels .gz files so)
                    f"{url} is a .gz file sent with Content-Encoding gzip: whether the server compressed it once more "
                    f"or only labelled its own compression cannot be told; {YOURSELF}",
                ),
                (
                    length is None and not getattr(response, "chunked", False),  # (a chunked body's end is marked)
                    f"{url} was sent with neither a Content-Length nor chunked encoding, so a download cut short could "
                    "not be told from a whole one; download it yourself (e.g. with curl), check that it is whole, and "
                    "pass the file path",
                ),
            ]
            if broken := [message for refused, message in rules if refused]:
                raise DataError(broken[0])
            atomic_write(dest, lambda f: copy(_Body(response, url, length), f, encoding != "identity"))
    except (OSError, ValueError, EOFError, zlib.error, http.client.HTTPException) as e:
        raise _refusal(e, url, dest, write_fix) from None


def _refusal(e: Exception, url: str, dest: Path, write_fix: str) -> UserError:
    """The one-line error for what the network, the server, the gzip decoder or the disk raised during fetch."""
    if isinstance(e, urllib.error.HTTPError):
        return DataError(
            f"could not download {url}: HTTP {e.code} {e.reason}; check the URL, or download the file "
            "yourself and pass its path"
        )
    if isinstance(e, http.client.IncompleteRead):  # a chunked body cut before its last chunk
        return DataError(
            f"the download of {url} is incomplete: the connection closed before its last chunk; try "
            f"again, or {YOURSELF}"
        )
    if isinstance(e, http.client.HTTPException):  # a reply that is not HTTP: a bad status line, over-long headers
        return DataError(
            f"could not download {url}: the reply is not valid HTTP ({type(e).__name__}: "
            f"{first_line(e)}); check the URL, or {YOURSELF}"
        )
    if isinstance(e, (EOFError, zlib.error, gzip.BadGzipFile)):  # (raised by the gzip decoder only)
        return DataError(
            f"the gzip-encoded download of {url} does not decode ({first_line(e)}); try again, or {YOURSELF}"
        )
    if isinstance(e, OSError) and (error := write_error(e, f"the download in {dest.parent}", write_fix)):
        return error
    reason = getattr(e, "reason", None) or first_line(e)  # URLError, timeouts, resets; ValueError: a bad URL
    return DataError(
        f"could not download {url} ({reason}); check the URL and your network, or download the "
        "file yourself and pass its path"
    )


class _Body:
    """A response's body as it arrives (still content-encoded), counted. read() returns what one read from the
    socket gives (read1; read would wait for all n bytes), so a trickle is seen between reads: every
    DOWNLOAD_RATE_WINDOW_S must bring DOWNLOAD_MIN_RATE bytes a second, a bound the per-read timeout cannot give.
    A body that ends before its Content-Length is refused at its end (for a gzip body too, before the decoder
    would call it a truncated stream)."""

    def __init__(self, response: Any, url: str, length: int | None) -> None:
        self.response, self.url, self.length, self.received = response, url, length, 0
        self.window_start, self.window_bytes = time.monotonic(), 0

    def read(self, n: int = -1) -> bytes:
        chunk = self.response.read1(n if n > 0 else READ_BYTES)
        self.received += len(chunk)
        self.window_bytes += len(chunk)
        # urllib's read returns short data, without an error, when the connection ends early
        if not chunk and self.length is not None and self.received != self.length:
            raise DataError(
                f"the download of {self.url} is incomplete: {self.received:,} of its {self.length:,} "
                f"bytes arrived; try again, or {YOURSELF}"
            )
        if chunk and (elapsed := time.monotonic() - self.window_start) >= DOWNLOAD_RATE_WINDOW_S:
            if self.window_bytes < DOWNLOAD_MIN_RATE * elapsed:
                raise DataError(
                    f"the download of {self.url} is too slow: {self.window_bytes:,} bytes in the last "
                    f"{elapsed:.0f} s, under the minimum of {DOWNLOAD_MIN_RATE // 1024} KiB/s; try again "
                    f"later, or {YOURSELF}"
                )
            self.window_start, self.window_bytes = time.monotonic(), 0
        return chunk
