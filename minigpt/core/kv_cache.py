"""The KV cache: keys and values of one layer for the positions already seen, so decoding a token costs O(S), not
O(S^2).

A batch's rows are written from `input_pos` on: one start for every row (an int: generate, ChatSession), or one
start per row (a (B,) tensor: a server's batch, whose requests are at different lengths).  A cache may hold more
rows than the batch run through it; the batch uses rows 0..B-1 (the server keeps its running requests there).

A static cache (make_static: a CUDA graph's decode step, minigpt.core.decode_graphs) is allocated once and a step at
(B,) positions gets all of it back: its shapes and addresses never change and nothing waits for the host to read
a position; the attention mask hides each row's positions past its own.

A sliding layer's cache (window set) is a ring buffer of `window` slots: position p lives in slot p % window, and
`pos` records which position each slot holds, so a decode step's memory and work are bounded by the window however
long the sequence.  Positions stay absolute (RoPE's angles, learned positions are baked into the keys); the mask
reads them from `pos`.  A write at position p drops what the ring held at p and later (a rewind, a refill): only a
sequence that continues as it was written can run on; `resumable` says from where.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache"]


EMPTY = 1 << 62  # the position of a ring slot that holds nothing: later than any query, so always masked


class KVCache:
    """One layer's keys and values, (rows, nkv, capacity, hs) each.

    The buffers grow with the sequence (to what is written, doubling past that, never beyond max_len, or a sliding
    layer's window): eight tokens from a model with a 128k context hold eight positions, not the whole context's
    gigabytes."""

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        n_kv_head: int,
        head_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        window: int | None = None,
    ) -> None:
        self.max_len = max_len
        self.window = window  # set: a ring of `window` slots (a sliding layer whose sequence can outgrow it)
        self.static = False  # see make_static
        self.k = torch.zeros((batch_size, n_kv_head, 0, head_dim), device=device, dtype=dtype)  # (B, nkv, capacity, hs)
        self.v = torch.zeros_like(self.k)
        # a ring's slot -> the position it holds, (B, capacity); EMPTY where none
        self.pos = torch.full((batch_size, 0), EMPTY, device=device) if window is not None else None
        # a ring written with one start for every row: one past its last position, kept on the host so that a decode
        # step's check reads no device memory (None once rows were written apart: read from pos)
        self.end: int | None = 0

    @property
    def slots(self) -> int:
        """The most positions this cache holds at once."""
        return self.max_len if self.window is None else min(self.window, self.max_len)

    def reserve(self, length: int) -> None:
        """Make room for positions 0..length-1 (a ring: its first `window`): amortised O(1) copies per position."""
        if self.window is not None:
            length = min(length, self.window)
        elif length > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; position {length - 1} is past it")
        if length > self.k.size(2):
            extra = min(self.slots, max(length, 2 * self.k.size(2))) - self.k.size(2)
            self.k = torch.cat((self.k, self.k.new_zeros(*self.k.shape[:2], extra, self.k.size(3))), dim=2)
            self.v = torch.cat((self.v, self.v.new_zeros(*self.v.shape[:2], extra, self.v.size(3))), dim=2)
            if self.pos is not None:
                self.pos = torch.cat((self.pos, self.pos.new_full((self.pos.size(0), extra), EMPTY)), dim=1)

    def make_static(self, length: int) -> None:
        """Allocate positions 0..length-1 now, for good: writes go in place, never into a new buffer, and a step at
        (B,) positions attends over every position (the mask hides the ones past each row's)."""
        self.reserve(length)
        if self.window is None:
            self.max_len = self.k.size(2)
        self.static = True

    def resumable(self, start: int) -> bool:
        """Can the sequence in this cache (written with one start for every row) go on from position `start`, its
        positions before start as they were?  Always for a full cache, which keeps every position; a ring that has
        dropped positions only from 0 (over again) or from its last position on: a query at `start` needs the
        window - 1 positions before it, and the ring holds `window` positions."""
        if self.window is None or start == 0:
            return True
        end = self.end
        if end is None:
            held = self.pos[0][self.pos[0] != EMPTY]
            end = int(held.max()) + 1 if held.numel() else 0
        return start <= end and (end <= self.window or start >= end - 1)

    def rows_resumable(self, starts: torch.Tensor) -> bool:
        """resumable, per row: can each row b of a ring go on from position starts[b]?  Read from `pos` (a host sync,
        as the per-row write's own); a static cache's step (a CUDA graph's) is not checked."""
        if self.static:
            return True
        B = starts.size(0)
        end = torch.where(self.pos[:B] != EMPTY, self.pos[:B], -1).amax(dim=1) + 1  # (B,): one past each row's last
        return bool(((starts == 0) | ((starts <= end) & ((end <= self.window) | (starts >= end - 1)))).all())

    def update(
        self, k: torch.Tensor, v: torch.Tensor, input_pos: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Write k, v (B, nkv, T, hs) at positions input_pos.. of rows 0..B-1 -> the rows' keys and values so far,
        (B, nkv, S, hs) each, and their positions: None for keys at 0..S-1, a ring's (B, S).  With per-row starts S
        is the longest row's end: a shorter row's later keys are stale, and the attention mask hides them; a static
        cache gives every position (S = its capacity)."""
        if self.window is not None:
            return self._update_ring(k, v, input_pos)
        B, T = k.size(0), k.size(2)
        if isinstance(input_pos, torch.Tensor):
            end = self.k.size(2) if self.static else int(input_pos.max()) + T  # static: no host sync
            self.reserve(end)
            rows = torch.arange(B, device=k.device)[:, None]  # (B, 1)
            cols = input_pos[:, None] + torch.arange(T, device=k.device)  # (B, T): row b's own positions
            self.k[rows, :, cols] = k.transpose(1, 2)  # indexed as (B, T, nkv, hs)
            self.v[rows, :, cols] = v.transpose(1, 2)
        else:
            end = input_pos + T
            self.reserve(end)
            self.k[:B, :, input_pos:end] = k
            self.v[:B, :, input_pos:end] = v
        return self.k[:B, :, :end], self.v[:B, :, :end], None

    def _update_ring(
        self, k: torch.Tensor, v: torch.Tensor, input_pos: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A ring's update: one new position per row is written into its slot and the ring attended over; T > 1
        new ones (a prefill, maybe longer than the window) are attended over with the ring as it was, and only the
        last `window` of them kept."""
        B, T, W = k.size(0), k.size(2), self.window
        per_row = isinstance(input_pos, torch.Tensor)
        if not self.static:
            self.reserve((int(input_pos.max()) if per_row else input_pos) + T)
        start = input_pos[:, None] if per_row else torch.full((B, 1), input_pos, device=k.device)  # (B, 1)
        new_pos = start + torch.arange(T, device=k.device)  # (B, T)
        # one token too: a decode step at an earlier position would attend over a ring that has lost its window.
        # Not while compiling: a compiled decode step (generate's) always continues
        if not torch.compiler.is_compiling() and not (
            self.rows_resumable(input_pos) if per_row else self.resumable(input_pos)
        ):
            at = start[:, 0].tolist() if per_row else input_pos
            raise ValueError(
                f"a sliding layer's cache has dropped the positions a query at {at} needs; start again from position 0"
            )
        self.end = None if per_row or torch.compiler.is_compiling() else input_pos + T  # compiled: read from pos
        if T > 1:
            self.pos[:B].masked_fill_(self.pos[:B] >= start, EMPTY)  # a rewound sequence's later positions: gone
            attended = (
                torch.cat((self.k[:B], k), 2),
                torch.cat((self.v[:B], v), 2),
                torch.cat((self.pos[:B], new_pos), 1),
            )
        kept = slice(max(0, T - W), T)  # the last `window` new positions
        rows = torch.arange(B, device=k.device)[:, None]  # (B, 1)
        slots = new_pos[:, kept] % W  # (B, n)
        self.k[rows, :, slots] = k[:, :, kept].transpose(1, 2)  # indexed as (B, n, nkv, hs)
        self.v[rows, :, slots] = v[:, :, kept].transpose(1, 2)
        self.pos[rows, slots] = new_pos[:, kept]
        return attended if T > 1 else (self.k[:B], self.v[:B], self.pos[:B])  # S = capacity (+ T)

    def read(self, row: int, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions first..end-1 of `row`, (nkv, end - first, hs) each, in position order."""
        at = torch.arange(first, end, device=self.k.device) % self.window if self.window is not None else None
        if at is None:
            return self.k[row, :, first:end], self.v[row, :, first:end]
        return self.k[row, :, at], self.v[row, :, at]

    def copy_row(self, row: int, source: KVCache, source_row: int, length: int) -> None:
        """Positions 0..length-1 of `source`'s row (a ring: those it keeps) -> this cache's `row` (a prefilled request
        joins a running batch, or a batch closes the gap a finished request left)."""
        first = 0 if self.window is None else max(0, length - self.window)
        k, v = source.read(source_row, first, length)
        self.reserve(length)
        if self.window is None:
            self.k[row, :, :length], self.v[row, :, :length] = k, v
            return
        positions = torch.arange(first, length, device=self.k.device)
        self.end = None
        self.pos[row] = EMPTY
        self.k[row, :, positions % self.window], self.v[row, :, positions % self.window] = k, v
        self.pos[row, positions % self.window] = positions
