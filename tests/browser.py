"""Open a page in headless Chromium: the page's state after its scripts ran, a screenshot, or a live page to drive.

Used by the tests and the benchmark to check that the attention lab page really builds its views.  The page
marks its state on <body>: data-ready="1" once every view is built, data-errors (a JSON list of script errors),
and data-render-ms (milliseconds from navigation to ready).  `Browser` drives a live page instead (the chat page of
`minigpt serve`): it types, presses keys, evaluates JavaScript and records every request the page makes, over
the DevTools protocol on a pipe (--remote-debugging-pipe: no port, no websocket library).  Chromium runs with no
network features, in a fresh profile, and never leaves a process behind.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CHROMIUM", "chromium_path", "PageState", "open_page", "screenshot", "Browser"]

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--run-all-compositor-stages-before-draw",
]


def chromium_path() -> str | None:
    """Debian's chromium, or another chromium on PATH; None when there is none."""
    return CHROMIUM if Path(CHROMIUM).is_file() else shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class PageState:
    dom: str  # the document after its scripts ran (--dump-dom)
    ready: bool
    errors: str  # body[data-errors]: "[]" when the scripts ran cleanly
    render_ms: float | None

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.dom))


def _run(page: Path, extra: list[str], size: tuple[int, int], budget_ms: int, timeout: float) -> str:
    exe = chromium_path()
    if exe is None:
        raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        cmd = [
            exe,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={size[0]},{size[1]}",
            f"--virtual-time-budget={budget_ms}",
            *extra,
            Path(page).resolve().as_uri(),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"chromium exited with {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def open_page(
    page: str | Path, size: tuple[int, int] = (1400, 1000), budget_ms: int = 10000, timeout: float = 120
) -> PageState:
    """Load the page, let its scripts run (up to budget_ms of virtual time), return its state."""
    dom = _run(Path(page), ["--dump-dom"], size, budget_ms, timeout)
    body = re.search(r"<body([^>]*)>", dom)
    attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', body.group(1))) if body else {}
    render = attrs.get("data-render-ms")
    return PageState(
        dom=dom,
        ready=attrs.get("data-ready") == "1",
        errors=attrs.get("data-errors", "missing").replace("&quot;", '"'),
        render_ms=float(render) if render else None,
    )


def screenshot(
    page: str | Path,
    png: str | Path,
    size: tuple[int, int] = (1400, 1000),
    budget_ms: int = 10000,
    timeout: float = 120,
) -> Path:
    """A PNG of the page's first screenful after its scripts ran."""
    png = Path(png).resolve()
    _run(Path(page), [f"--screenshot={png}"], size, budget_ms, timeout)
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no screenshot to {png}")
    return png


class Browser:
    """A headless Chromium driven over the DevTools protocol: one tab, its requests and its script errors.

    with Browser() as page:
        page.goto("http://127.0.0.1:8000/")
        page.type_text("#input", "hello"); page.press("Enter")
        page.wait_for("document.body.dataset.busy === '0'")
    """

    def __init__(self, size: tuple[int, int] = (1200, 900)) -> None:
        self.size = size
        self.requests: list[str] = []  # every URL the page asked for
        self.errors: list[str] = []  # uncaught exceptions in the page's scripts
        self._buffer, self._next_id, self._session = b"", 0, None

    def __enter__(self) -> Browser:
        exe = chromium_path()
        if exe is None:
            raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
        self._profile = tempfile.TemporaryDirectory(prefix="chromium-profile-", ignore_cleanup_errors=True)
        to_chrome, self._to_chrome = os.pipe()  # Chromium reads commands on its fd 3 ...
        self._from_chrome, from_chrome = os.pipe()  # ... and writes replies and events on its fd 4

        def pipes_as_3_and_4() -> None:
            read, write = os.dup(to_chrome), os.dup(from_chrome)  # above 4, so the dup2s cannot clobber them
            os.dup2(read, 3)
            os.dup2(write, 4)

        self._process = subprocess.Popen(
            [
                exe,
                *FLAGS,
                f"--user-data-dir={self._profile.name}",
                f"--window-size={self.size[0]},{self.size[1]}",
                "--remote-debugging-pipe",
                "about:blank",
            ],
            pass_fds=(3, 4),
            preexec_fn=pipes_as_3_and_4,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        os.close(to_chrome)
        os.close(from_chrome)
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Network", "Runtime"):
            self._call(f"{domain}.enable")
        return self

    def __exit__(self, *exc: object) -> None:
        try:  # close it as a user would, so its helper processes are gone before the profile is removed
            self._call("Browser.close", timeout=10)
            self._process.wait(timeout=10)
        except (OSError, RuntimeError, TimeoutError, subprocess.TimeoutExpired):
            pass
        if self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)  # its own process group: the browser and its helpers
            self._process.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)
        self._profile.cleanup()

    # ------------------------------------------------------------------------------------------ the protocol

    def _call(self, method: str, params: dict | None = None, timeout: float = 30) -> dict[str, Any]:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if self._session is not None and not method.startswith("Target."):
            message["sessionId"] = self._session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self._event(reply)

    def _receive(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from_chrome], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise RuntimeError(f"chromium exited with {self._process.wait()}")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def _event(self, event: dict[str, Any]) -> None:
        if event.get("method") == "Network.requestWillBeSent":
            self.requests.append(event["params"]["request"]["url"])
        elif event.get("method") == "Runtime.exceptionThrown":
            self.errors.append(event["params"]["exceptionDetails"].get("text", "exception"))

    # ------------------------------------------------------------------------------------------ the page

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited if it is a promise)."""
        result = self._call("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60) -> Any:
        """Poll until the expression is truthy; its value."""
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout} s for {expression}")
            time.sleep(0.05)
        return value

    def goto(self, url: str) -> None:
        self._call("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete'")

    def type_text(self, selector: str, text: str) -> None:
        """Focus the element and type the text into it, as a keyboard's input events."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self._call("Input.insertText", {"text": text})

    def press(self, key: str = "Enter", shift: bool = False) -> None:
        """Press and release the key; with shift, Shift+key as typed, its text included (Shift+Enter: a new line)."""
        codes = {"Enter": 13, "Tab": 9, "Escape": 27}
        for kind in ("keyDown", "keyUp"):
            event = {"type": kind, "key": key, "code": key, "windowsVirtualKeyCode": codes[key]}
            if shift:
                event |= {"modifiers": 8} | ({"text": "\r"} if kind == "keyDown" and key == "Enter" else {})
            self._call("Input.dispatchKeyEvent", event)
