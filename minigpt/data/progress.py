"""Preparation's progress, at any size: a bar on a terminal (tqdm), else a log line every LOG_EVERY_S seconds.

progress = Progress(total_bytes, "tinyshakespeare")
progress.update(bytes_read, tokens_written)   # cumulative; cheap enough to call per chunk
progress.close()
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["LOG_EVERY_S", "Progress"]

LOG_EVERY_S = 5.0


class Progress:
    def __init__(
        self, total_bytes: int | None, label: str, stream: TextIO | None = None, every_s: float | None = None
    ) -> None:
        self.stream = stream or sys.stderr
        self.total, self.label = total_bytes or None, label
        self.every_s = LOG_EVERY_S if every_s is None else every_s
        self.started = self.last = time.monotonic()
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm  # (Lightning's dependency)

            self.bar = tqdm(
                total=self.total,
                unit="B",
                unit_scale=True,
                desc=f"data: {label}",
                file=self.stream,
                mininterval=0.5,
                leave=False,
            )

    def update(self, num_bytes: int, tokens: int) -> None:
        now = time.monotonic()
        elapsed = max(now - self.started, 1e-9)
        if self.bar is not None:
            self.bar.update(num_bytes - self.bar.n)
            self.bar.set_postfix_str(f"{tokens / elapsed / 1e6:.2f} M tokens/s", refresh=False)
        elif now - self.last >= self.every_s:
            self.last = now
            rate = num_bytes / elapsed
            done = f"{num_bytes / 1e6:,.1f} MB"
            if self.total and num_bytes <= self.total:  # (a total that was an estimate says nothing past it)
                eta = (self.total - num_bytes) / rate if rate > 0 else float("inf")
                done += f" of {self.total / 1e6:,.1f} MB ({100 * num_bytes / self.total:.0f}%, ETA {eta:.0f}s)"
            print(
                f"data: {self.label}: {done} read, {tokens:,} tokens, {rate / 1e6:.1f} MB/s, "
                f"{tokens / elapsed / 1e6:.2f} M tokens/s",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
