"""The KV cache: keys and values of one layer for the positions already seen, so decoding a token costs O(S), not
O(S^2).

A batch's rows are written from `input_pos` on: one start for every row (an int: generate, ChatSession), or one
start per row (a (B,) tensor: a server's batch, whose requests are at different lengths).  A cache may hold more
rows than the batch run through it; the batch uses rows 0..B-1 (the server keeps its running requests there).

A static cache (make_static: a CUDA graph's decode step, minigpt.core.decode_graphs) is allocated once and a step at
(B,) positions gets all of it back: its shapes and addresses never change and nothing waits for the host to read
a position; the attention mask hides each row's positions past its own.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache"]


class KVCache:
    """One layer's keys and values, (rows, nkv, capacity, hs) each.

    The buffers grow with the sequence (to what is written, doubling past that, never beyond max_len): eight
    tokens from a model with a 128k context hold eight positions, not the whole context's gigabytes."""

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        n_kv_head: int,
        head_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.max_len = max_len
        self.static = False  # see make_static
        self.k = torch.zeros((batch_size, n_kv_head, 0, head_dim), device=device, dtype=dtype)  # (B, nkv, capacity, hs)
        self.v = torch.zeros_like(self.k)

    def reserve(self, length: int) -> None:
        """Make room for positions 0..length-1: amortised O(1) copies per position."""
        if length > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; position {length - 1} is past it")
        if length > self.k.size(2):
            extra = min(self.max_len, max(length, 2 * self.k.size(2))) - self.k.size(2)
            self.k = torch.cat((self.k, self.k.new_zeros(*self.k.shape[:2], extra, self.k.size(3))), dim=2)
            self.v = torch.cat((self.v, self.v.new_zeros(*self.v.shape[:2], extra, self.v.size(3))), dim=2)

    def make_static(self, length: int) -> None:
        """Allocate positions 0..length-1 now, for good: writes go in place, never into a new buffer, and a step at
        (B,) positions attends over every position (the mask hides the ones past each row's)."""
        self.reserve(length)
        self.max_len = self.k.size(2)
        self.static = True

    def update(
        self, k: torch.Tensor, v: torch.Tensor, input_pos: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, nkv, T, hs) at positions input_pos.. of rows 0..B-1 -> the rows' keys and values so far,
        (B, nkv, S, hs) each.  With per-row starts S is the longest row's end: a shorter row's later keys are
        stale, and the attention mask hides them; a static cache gives every position (S = its capacity)."""
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
        return self.k[:B, :, :end], self.v[:B, :, :end]

    def copy_row(self, row: int, source: KVCache, source_row: int, length: int) -> None:
        """Positions 0..length-1 of `source`'s row -> this cache's `row` (a prefilled request joins a running batch,
        or a batch closes the gap a finished request left)."""
        self.reserve(length)
        self.k[row, :, :length] = source.k[source_row, :, :length]
        self.v[row, :, :length] = source.v[source_row, :, :length]
