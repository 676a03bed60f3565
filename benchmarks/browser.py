"""Open an attention lab page in headless Chromium: the page's state after its scripts ran, and a screenshot.

Used by the tests and the benchmark to check that the page really builds its views.  The page marks its state
on <body>: data-ready="1" once every view is built, data-errors (a JSON list of script errors), and
data-render-ms (milliseconds from navigation to ready).  Chromium runs with no network features, in a fresh
profile, and never leaves a process behind.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CHROMIUM", "chromium_path", "PageState", "open_page", "screenshot"]

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--run-all-compositor-stages-before-draw"]


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
        cmd = [exe, *FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
               f"--virtual-time-budget={budget_ms}", *extra, Path(page).resolve().as_uri()]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"chromium exited with {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def open_page(page: str | Path, size: tuple[int, int] = (1400, 1000), budget_ms: int = 10000,
              timeout: float = 120) -> PageState:
    """Load the page, let its scripts run (up to budget_ms of virtual time), return its state."""
    dom = _run(Path(page), ["--dump-dom"], size, budget_ms, timeout)
    body = re.search(r"<body([^>]*)>", dom)
    attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', body.group(1))) if body else {}
    render = attrs.get("data-render-ms")
    return PageState(dom=dom, ready=attrs.get("data-ready") == "1",
                     errors=attrs.get("data-errors", "missing").replace("&quot;", '"'),
                     render_ms=float(render) if render else None)


def screenshot(page: str | Path, png: str | Path, size: tuple[int, int] = (1400, 1000), budget_ms: int = 10000,
               timeout: float = 120) -> Path:
    """A PNG of the page's first screenful after its scripts ran."""
    png = Path(png).resolve()
    _run(Path(page), [f"--screenshot={png}"], size, budget_ms, timeout)
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no screenshot to {png}")
    return png
